"""scripts/gpu_check_teacher.py (gpu_check's local-teacher check) on the CPU: it passes for a teacher that GRPO's
config puts on the device in float32, and fails, saying why, for one in bf16 (weights, or compute under
`trainer.mixed_precision: bf16`): the differences a wrong precision makes are far outside its tolerance. The whole
script runs it through tests/functional/test_gpu_check.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_check_teacher as gct  # noqa: E402  (not gpu_check itself: it blocks ray and vllm in sys.modules)


def run(tiny_model_dir: Path, tmp_path: Path, policy: dict, trainer: dict) -> SimpleNamespace:
    config = tmp_path / "teacher.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "policy": {"model_name": str(tiny_model_dir), "device": "cpu", **policy}, "trainer": trainer,
        "data": {"train_path": str(tmp_path / "unused.jsonl")}, "output_dir": str(tmp_path / "out"),
        "on_policy_distillation": {"enabled": True, "default_teacher_alias": str(tiny_model_dir)},
    }))
    result = SimpleNamespace(status="FAIL", figures={}, detail="", section="")
    gct.teacher_check("cpu", tiny_model_dir, config, result)
    return result


@pytest.mark.timeout(120)
def test_a_float32_teacher_on_the_device_passes(tiny_model_dir, tmp_path):
    result = run(tiny_model_dir, tmp_path, {}, {})
    assert result.status == "PASS", result.detail
    figures = result.figures
    assert figures["teacher_on"] == "cpu/float32" and figures["assistant_turns_scored"] == "6/6", figures
    assert float(figures["logprob_max_abs_diff_vs_cpu_fp32"]) <= gct.TEACHER_ATOL, figures


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("policy", "trainer", "placed"), [
    ({"dtype": "bfloat16"}, {}, "cpu/bfloat16"),
    ({}, {"mixed_precision": "bf16"}, "cpu/float32"),  # float32 weights, bf16 compute: only the numbers tell
])
def test_a_bf16_teacher_fails_the_check_saying_why(tiny_model_dir, tmp_path, policy, trainer, placed):
    result = run(tiny_model_dir, tmp_path, policy, trainer)
    assert result.status == "FAIL" and result.figures["teacher_on"] == placed, result
    assert "teacher logprobs differ from the CPU float32 forward pass" in result.detail
    assert float(result.figures["logprob_max_abs_diff_vs_cpu_fp32"]) > 10 * gct.TEACHER_ATOL  # bf16: ~1e-2
    assert ("not cpu in float32" in result.detail) == (placed != "cpu/float32")
