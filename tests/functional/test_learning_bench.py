"""bench/learning.py end to end on the tiny model: the task generator, eval before, GRPO, `run_grpo.py export`,
eval after on the export, and the lr-0 control through the same phases, each a subprocess of the project's CLIs.

The task is the one a random tiny model learns in seconds (tests/functional/test_grpo.py's): answer "yes"
(`--task say_yes`: training and held-out prompts name disjoint words), trained with the full_ft recipe at the
lr that test measured. Greedy held-out only (`--samples 0`): the sampled eval is the same CLI with another
temperature, and each eval is a process start (~5 s) more. Measured on 2 shared cores: 60 s at load ~3, 143 s
at load ~8 (7 subprocesses; GRPO itself is ~7 s of it, the rest process starts); held-out greedy pass@1
0.000 -> 1.000, control +0.000.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from child_env import one_thread_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_the_learning_bench_shows_a_gain_and_a_null_control(tmp_path: Path) -> None:
    from nemo_rl_ext.models.tiny import build_tiny_model

    # initializer_range 0.05: random, but with enough entropy that a group's samples differ (test_grpo.py)
    model = build_tiny_model(tmp_path / "soft_tiny", seed=0, initializer_range=0.05)
    out = tmp_path / "bench"
    cmd = [sys.executable, str(REPO / "bench" / "learning.py"), "--recipe", "full_ft", "--task", "say_yes",
           "--model", str(model), "--train-size", "16", "--heldout-size", "32", "--eval-size", "32",
           "--samples", "0", "--steps", "20", "--control-steps", "2", "--resamples", "2000", "--out", str(out),
           "--set", "optimizer.lr=3e-3", "rollouts.num_generations_per_prompt=16", "grpo.num_prompts_per_step=4",
           "optimizer.micro_batch_size=16", "policy.max_model_len=256", "rollouts.max_seq_len=128",
           "policy.generation.max_new_tokens=8"]
    proc = subprocess.run(cmd, cwd=REPO, env=one_thread_env(), capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())

    gain = results["run"]["greedy"]["lenient"]["overall"]
    control = results["control"]["greedy"]["lenient"]["overall"]
    assert gain["low"] > 0.0, gain  # the gain's interval excludes 0
    assert control["low"] <= 0.0 <= control["high"], control  # the lr-0 control's contains 0
    assert results["run"]["greedy"]["strict"]["overall"]["low"] > 0.0

    # the evals after read the exported folders (their own config.yaml says which model they loaded), and the
    # export is a Hugging Face folder written by `run_grpo.py export` from the run's checkpoint
    for tag, run in (("after", "run"), ("control", "control")):
        loaded = yaml.safe_load((out / "evals" / f"{tag}_greedy" / "config.yaml").read_text())["policy"]
        assert loaded["model_name"] == str(out / run / "export")
        assert (out / run / "export" / "config.json").is_file()
    assert results["export"]["run_eval_read"] == results["export"]["run"]
    # the control really ran with lr 0, through GRPO: its config file says so and its steps were logged
    control_cfg = yaml.safe_load((out / "configs" / "grpo_control.yaml").read_text())
    assert control_cfg["optimizer"]["lr"] == 0.0
    assert [s for s, _ in results["reward_curve"]["lr-0 control"]] == [1, 2]
    assert len(results["reward_curve"]["GRPO"]) == 20

    for name in ("results.md", "results.json", "reward_curve.png", "heldout.png", "timings.json"):
        assert (out / name).is_file(), name
    assert set(results["timings_s"]) == {"eval_before_greedy", "grpo_run", "export_run", "eval_after_greedy",
                                         "grpo_control", "export_control", "eval_control_greedy"}
    assert "held-out greedy pass@1" in proc.stdout


@pytest.mark.timeout(120)
def test_a_failing_phase_names_its_log_and_the_cause(tmp_path: Path) -> None:
    # a model folder that does not exist: run_eval.py refuses it (exit 2), and the bench says which phase, where
    # its log is, and the phase's own message, then stops (exit 2: the user's error)
    out = tmp_path / "bench"
    cmd = [sys.executable, str(REPO / "bench" / "learning.py"), "--model", str(tmp_path / "no_model"),
           "--train-size", "20", "--heldout-size", "5", "--eval-size", "5", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=one_thread_env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"phase eval_before_greedy failed with exit status 2; its log: {out}/logs/eval_before_greedy.log" \
        in proc.stderr
    assert "no_model" in proc.stderr and "Traceback" not in proc.stderr
    assert not (out / "run").exists()  # nothing after the failed phase ran
