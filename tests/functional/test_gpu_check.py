"""scripts/gpu_check.sh (the device checks of issue 26) on the CPU: `--device cpu` runs the logic the lent GPU
machine runs, and the report says PASS for the engine and the fp32 GRPO steps, and PASS or NOT BUILT for each
trainer setting, NOT BUILT exactly while the config still refuses it (`trainer_config.UNBUILT`), PASS for the local
distillation teacher on the device (its logprobs against a CPU fp32 forward pass), and PASS for
the learning bench (`bench/learning.py --device cpu` on the tiny model's say_yes task, its table in the report)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rl_ext.training.config import UNBUILT

REPO = Path(__file__).resolve().parents[2]
FEATURE_ROWS = {"mixed_precision": "trainer.mixed_precision", "activation_checkpointing":
                "trainer.activation_checkpointing", "lora": "trainer.lora", "workers": "trainer.workers"}


def _env(out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the repository itself
    return {**env, "OUT": str(out), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "WHEELS": str(out / "none")}


def _rows(report: str) -> dict[str, tuple[str, str]]:
    """The report's table: check name -> (result, figures)."""
    rows = re.findall(r"^\| (.+?) \| (PASS|FAIL|NOT BUILT) \| (.*) \|$", report, flags=re.MULTILINE)
    return {name: (status, figures) for name, status, figures in rows}


@pytest.mark.timeout(300)
def test_gpu_check_runs_on_the_cpu_and_reports_every_check(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--device", "cpu"], cwd=tmp_path,
                          env=_env(tmp_path), capture_output=True, text=True, timeout=290)
    report = (tmp_path / "gpu_report.md").read_text()  # $OUT/gpu_report.md
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + report
    rows = _rows(report)
    assert len(rows) == 9, rows
    assert "- blocked (absent on the GPU image): ray, vllm" in report
    assert "INCOMPLETE" not in report  # rewritten after each check, final once all ran
    assert f"- nemo_rl_ext: {REPO / 'nemo_rl_ext'}" in report  # this checkout's code, not an installed copy
    engine = next(v for k, v in rows.items() if k.startswith("engine"))
    assert engine[0] == "PASS", report
    # continuous batching: the second wave joined a batch that was decoding
    assert "batches_from_empty=1" in engine[1] and "prefills=2" in engine[1], engine
    diff = float(re.search(r"logprob_max_abs_diff=([0-9.e+-]+)", engine[1]).group(1))
    assert diff < 1e-4, engine
    fp32 = rows["grpo: 2 steps, fp32"]
    assert fp32[0] == "PASS" and "train/grad_norm=" in fp32[1], fp32
    for key, row_start in FEATURE_ROWS.items():
        (name,) = [k for k in rows if row_start in k]
        status = rows[name][0]
        assert status == ("NOT BUILT" if key in UNBUILT else "PASS"), (key, report)
        if status == "NOT BUILT":
            assert f"{row_start}: " in report and "is not built yet" in report  # the config's own message
    (fsdp,) = [v for k, v in rows.items() if k.startswith("trainer.workers")]
    assert "backend=gloo" in fsdp[1] and "shards_on=cpu" in fsdp[1], fsdp  # shards and AdamW state, after the step
    (teacher,) = [v for k, v in rows.items() if k.startswith("teacher")]
    assert teacher[0] == "PASS" and "teacher_on=cpu/float32" in teacher[1], teacher  # GRPO's placement: policy.device
    assert "assistant_turns_scored=6/6" in teacher[1], teacher  # two completions of three assistant turns
    teacher_diff = float(re.search(r"logprob_max_abs_diff_vs_cpu_fp32=([0-9.e+-]+)", teacher[1]).group(1))
    assert teacher_diff < 1e-4, teacher
    _assert_learning_section(report, rows)


def _assert_learning_section(report: str, rows: dict[str, tuple[str, str]]) -> None:
    """The learning bench's row (the tiny say_yes task learned on the CPU, the control null) and its results table,
    which says which device produced it."""
    status, figures = rows["learning bench: bench/learning.py --device cpu"]
    assert status == "PASS", report
    assert "device=cpu" in figures and "tiny random model on say_yes" in figures, figures
    assert "4 prompts x 16 samples a step" in figures, figures
    gain = re.search(r"gain=([+-][0-9.]+) \[([+-][0-9.]+), ([+-][0-9.]+)\]", figures)
    assert gain and float(gain.group(2)) > 0.0, figures  # the gain's interval excludes 0
    section = report.split("## learning bench: bench/learning.py --device cpu", 1)[1]
    assert "\nDevice: cpu\n" in section, section
    assert "| held-out metric | n | before | after | gain [95% CI] |" in section
    table = re.search(r"^\| greedy pass@1, lenient \| all \| ([0-9.]+) \| ([0-9.]+) \| ([^|]+) \|", section,
                      flags=re.MULTILINE)
    assert table and table.group(3).strip() in figures, (table, figures)  # the row's gain is the table's


@pytest.mark.timeout(60)
def test_a_missing_package_is_one_failed_check_naming_it(tmp_path: Path) -> None:
    """On the image a pure-Python dependency that was not carried fails the import check, which names it."""
    code = ("import runpy, sys; sys.modules['orjson'] = None; sys.argv = ['gpu_check.py', '--device', 'cpu']; "
            f"runpy.run_path({str(REPO / 'scripts' / 'gpu_check.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = (tmp_path / "gpu_report.md").read_text()
    rows = _rows(report)
    assert [status for status, _ in rows.values()] == ["FAIL"], report
    assert "orjson" in report and "wheels/" in report
