"""bench/learning_distill.py end to end on the tiny model, as a user on a fresh clone runs it (no --teacher): GRPO
trains the teacher (recipe lora) and exports it, the teacher is evaluated, served by the policy server CLI on a
free port, three students train from the untrained model with the opd recipe (distillation alone, GRPO, both),
each checkpoint is exported and evaluated, the lr-0 control, then the table and the crossings.

The task is the one a random tiny model learns in seconds (`--task say_yes`, LoRA at lr 3e-2 as
test_learning_trl_bench.py). The teacher's 20 steps must teach it the task (its held-out interval above the
untrained model's); the students' learning is not asserted here (3 steps: the loop-level comparison is
test_grpo_distill.py's), only that each ran its budget with the teacher where it should be and nowhere else.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import one_thread_env

REPO = Path(__file__).resolve().parents[2]
STEPS = 4


@pytest.mark.timeout(600)
def test_the_bench_trains_a_teacher_serves_it_and_compares_three_students(tmp_path: Path) -> None:
    from nemo_rl_ext.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "soft_tiny", seed=0, initializer_range=0.05)
    out = tmp_path / "bench"
    cmd = [sys.executable, str(REPO / "bench" / "learning_distill.py"), "--task", "say_yes", "--model", str(model),
           "--train-size", "16", "--heldout-size", "32", "--eval-size", "32", "--teacher-steps", "20",
           "--steps", str(STEPS), "--save-every", str(STEPS // 2), "--control-steps", "1", "--resamples", "2000",
           "--out", str(out), "--set", "optimizer.lr=3e-2", "rollouts.num_generations_per_prompt=16",
           "grpo.num_prompts_per_step=4", "optimizer.micro_batch_size=16", "policy.max_model_len=256",
           "rollouts.max_seq_len=128", "policy.generation.max_new_tokens=8"]
    proc = subprocess.run(cmd, cwd=REPO, env=one_thread_env(), capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())

    # the teacher was trained here, on this run's data, and learned the task
    teacher, untrained = results["teacher"], results["curves"]["distill"][0]
    assert str(out / "teacher") in teacher["how"] and teacher["folder"] == str(out / "teacher" / "export")
    assert teacher["lenient"]["low"] > untrained["lenient"]["high"]

    # every student: the same evaluated steps and budget, each checkpoint's eval read its own export
    for name in ("distill", "grpo", "mixed"):
        rows = results["curves"][name]
        assert [r["step"] for r in rows] == [0, STEPS // 2, STEPS]
        assert [r["samples"] for r in rows] == [0, 2 * 64, 4 * 64]
        assert rows[0] == untrained and 0.0 < rows[1]["train_s"] < rows[2]["train_s"]
    for tag, read in results["evals_read"].items():
        assert read["run_eval_read"] == read["export"], tag

    # the teacher scored the distill and mixed students' samples over HTTP, and never GRPO's
    for name, distilled in (("distill", True), ("mixed", True), ("grpo", False)):
        metrics = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in metrics if m.get("step", 0) > 0]
        assert len(steps) == STEPS
        if distilled:
            assert all(math.isfinite(m["distill/reverse_kl"]) and m["distill/scored_tokens"] > 0 for m in steps)
            assert all(math.isfinite(m["train/distill/reverse_kl"]) for m in steps)
        else:
            assert not any(k.startswith(("distill/", "train/distill/")) for m in steps for k in m), name
    config = (out / "configs" / "grpo_mixed.yaml").read_text()
    assert "default_teacher_alias: http://127.0.0.1:" in config and "reward_weight: 1.0" in config
    assert results["teacher_requests"].get("200", 0) > 0  # the server's own /metrics count
    assert "listening on http://127.0.0.1:" in (out / "logs" / "teacher_server.log").read_text()

    # the control trained with lr 0: its pass@1 is the untrained model's
    assert results["control"]["gain"]["diff"] == 0.0
    assert "First evaluated step at a share of the teacher's pass@1" in proc.stdout
