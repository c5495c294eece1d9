"""bench/learning_trl.py's pieces on hand-made cases: the training seconds per step, the curve points and their
intervals, the goal line (met, met too late, never reached, a TRL run that did not learn), the TRL arguments
derived from a recipe and the settings the comparison refuses. No TRL needed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import learning  # noqa: E402
import learning_trl  # noqa: E402
from learning_stats import PromptScores, mean_interval  # noqa: E402
from learning_trl_report import curve_points, goal  # noqa: E402


def scores(passed: int, n: int = 10) -> PromptScores:
    """n greedy answers, the first `passed` of them correct (strictly too), none truncated."""
    lenient = np.array([1.0] * passed + [0.0] * (n - passed))
    return PromptScores(strict=lenient.copy(), lenient=lenient, truncated=np.zeros(n), num_samples=1)


def test_step_seconds_are_the_running_sum_in_step_order():
    rows = [{"step": 2, "s": 3.0}, {"step": 1, "s": 1.5}, {"step": 3, "s": 0.5}]
    assert learning_trl.step_seconds(rows, "s") == {1: 1.5, 2: 4.5, 3: 5.0}


def test_mean_interval_brackets_the_mean_and_is_a_point_for_constant_scores():
    constant = mean_interval(np.ones(20), seed=0, resamples=500)
    assert (constant.after, constant.low, constant.high) == (1.0, 1.0, 1.0)
    half = mean_interval(np.array([0.0, 1.0] * 20), seed=0, resamples=2000)
    assert half.after == 0.5 and 0.0 < half.low < 0.5 < half.high < 1.0


def curves_of(ours: dict[int, tuple[float, int]], trl: dict[int, tuple[float, int]]):
    """(curves, scores) from {step: (training seconds, passed of 10)} per side."""
    sc = {"ours": {s: scores(p) for s, (_, p) in ours.items()}, "trl": {s: scores(p) for s, (_, p) in trl.items()}}
    secs = {"ours": {s: t for s, (t, _) in ours.items()}, "trl": {s: t for s, (t, _) in trl.items()}}
    return {side: curve_points(sc[side], secs[side], seed=0, resamples=200) for side in sc}, sc


def test_curve_points_carry_seconds_passed_counts_and_intervals():
    curves, _ = curves_of({0: (0.0, 1), 10: (30.0, 6)}, {0: (0.0, 1), 10: (60.0, 4)})
    p = curves["ours"][1]
    assert (p["step"], p["train_s"], p["passed"], p["n"], p["truncation"]) == (10, 30.0, 6, 10, 0.0)
    assert p["lenient"]["low"] <= p["lenient"]["after"] == 0.6 <= p["lenient"]["high"]


def test_goal_met_when_ours_reaches_trls_final_score_within_half_its_time():
    curves, sc = curves_of({0: (0.0, 0), 10: (40.0, 5), 20: (80.0, 8)}, {0: (0.0, 0), 10: (100.0, 3), 20: (200.0, 5)})
    g = goal(curves, sc, seed=0, resamples=200)
    assert g["met"] and g["target"] == 0.5 and g["budget_s"] == 100.0
    assert g["ours_reached_at"] == {"step": 10, "train_s": 40.0}
    assert "MET." in g["line"] and "NOT MET" not in g["line"]
    assert g["final_diff"]["diff"] == pytest.approx(0.3)  # ours 0.8 - TRL 0.5 at the last step, same problems


def test_goal_not_met_when_ours_gets_there_after_half_of_trls_time():
    curves, sc = curves_of({0: (0.0, 0), 10: (40.0, 4), 20: (110.0, 5)}, {0: (0.0, 0), 20: (200.0, 5)})
    g = goal(curves, sc, seed=0, resamples=200)
    assert not g["met"] and g["ours_reached_at"] == {"step": 20, "train_s": 110.0}
    assert "NOT MET" in g["line"]


def test_goal_not_met_when_ours_never_reaches_it_and_says_so():
    curves, sc = curves_of({0: (0.0, 0), 20: (10.0, 4)}, {0: (0.0, 0), 20: (200.0, 5)})
    g = goal(curves, sc, seed=0, resamples=200)
    assert not g["met"] and g["ours_reached_at"] is None
    assert "ours never reached it in its 20 steps (final 0.400)" in g["line"]


def test_a_trl_run_that_did_not_learn_makes_the_goal_trivial_and_the_line_says_so():
    curves, sc = curves_of({0: (0.0, 2), 20: (10.0, 2)}, {0: (0.0, 2), 20: (200.0, 1)})
    g = goal(curves, sc, seed=0, resamples=200)
    assert g["met"] and "not above the base model's (0.200): reaching it shows nothing" in g["line"]


def lora_cfg(tmp_path: Path, *extra: str) -> tuple[argparse.Namespace, dict]:
    args = learning_trl.parse_args(["--out", str(tmp_path / "o"), *extra])
    _, recipe = learning.load_recipe(args.recipe)
    return args, learning.grpo_config(recipe, args, tmp_path / "train.jsonl", tmp_path / "ours", control=False)


def test_trl_arguments_follow_the_lora_recipe(tmp_path):
    args, cfg = lora_cfg(tmp_path)
    assert (args.samples, args.control_steps, args.save_every) == (0, 0, 10)
    assert learning_trl.check(args, cfg) == ([10, 20, 30], [10, 20, 30])
    a = learning_trl.trl_args(cfg, ["loss_type=grpo", "scale_rewards=none"])
    # 8 prompts x 8 samples: one group per micro-batch, 8 accumulated micro-batches per optimizer step
    assert (a["per_device_train_batch_size"], a["gradient_accumulation_steps"], a["num_generations"]) == (8, 8, 8)
    assert (a["max_completion_length"], a["temperature"], a["learning_rate"], a["max_steps"]) == (16, 1.0, 1e-4, 30)
    assert (a["beta"], a["epsilon"], a["epsilon_high"], a["max_grad_norm"], a["weight_decay"]) == (0.0, 0.2, 0.28, 1.0, 0.0)
    assert (a["lr_scheduler_type"], a["gradient_checkpointing"], a["seed"]) == ("constant", False, 42)
    assert (a["loss_type"], a["scale_rewards"]) == ("grpo", "none")
    with pytest.raises(ValueError, match="--trl-set 'loss_type': write KEY=VALUE"):
        learning_trl.trl_args(cfg, ["loss_type"])


def test_ours_may_run_more_steps_than_trl_in_multiples_of_the_save_interval(tmp_path):
    args, cfg = lora_cfg(tmp_path, "--ours-steps", "60")
    assert learning_trl.check(args, cfg) == ([10, 20, 30, 40, 50, 60], [10, 20, 30])
    args, cfg = lora_cfg(tmp_path, "--ours-steps", "55", "--trl-from", str(tmp_path / "nothing"))
    with pytest.raises(ValueError) as err:
        learning_trl.check(args, cfg)
    assert "--ours-steps 55 must be >= 1 and a multiple of --save-every 10" in str(err.value)
    assert "no finished TRL run there" in str(err.value)


def test_a_reused_trl_run_must_have_the_same_spec_and_data(tmp_path):
    earlier, now = tmp_path / "earlier", tmp_path / "now"
    spec = {"model": "m", "trl_args": {"learning_rate": 1e-4}, "out": str(earlier / "trl"), "train_path": "a"}
    for folder, train in ((earlier, "x"), (now, "y")):
        (folder / "configs").mkdir(parents=True)
        (folder / "data").mkdir()
        (folder / "data" / "train.jsonl").write_text(train)
        (folder / "data" / "heldout.jsonl").write_text("h")
    (earlier / "configs" / "trl_spec.json").write_text(learning_trl.json.dumps(spec))
    with pytest.raises(ValueError, match="differs from this one in trl_args, data/train.jsonl"):
        learning_trl.reuse_trl(earlier, {**spec, "trl_args": {"learning_rate": 3e-4}, "out": "o"}, now)
    (now / "data" / "train.jsonl").write_text("x")
    assert learning_trl.reuse_trl(earlier, {**spec, "out": "o", "train_path": "b"}, now) == earlier / "trl"
    assert "reused from" in (now / "trl_from.txt").read_text()


def test_a_yaml_float_spelled_without_a_dot_reaches_trl_as_a_float(tmp_path):
    # YAML 1.1 reads "3e-2" as a string; our config validation coerces it, TRL's optimizer would not
    _, cfg = lora_cfg(tmp_path, "--set", "optimizer.lr=3e-2")
    assert learning_trl.trl_args(cfg, [])["learning_rate"] == 0.03


def test_settings_the_comparison_cannot_run_are_named_together(tmp_path):
    args = learning_trl.parse_args(["--recipe", "full_ft", "--save-every", "7", "--out", str(tmp_path / "o")])
    _, recipe = learning.load_recipe("full_ft")
    cfg = learning.grpo_config(recipe, args, tmp_path / "t.jsonl", tmp_path / "ours", control=False)
    learning.set_key(cfg, "optimizer.scheduler", {"type": "cosine"})
    with pytest.raises(ValueError) as err:
        learning_trl.check(args, cfg)
    text = str(err.value)
    assert "no trainer.lora" in text and "optimizer.scheduler" in text
    assert "--save-every 7 must be >= 1 and divide grpo.max_num_steps (30)" in text


def no_trl(name: str) -> str:
    import importlib.metadata

    if name == "trl":
        raise importlib.metadata.PackageNotFoundError(name)
    raise AssertionError(name)


def test_without_trl_the_bench_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("importlib.metadata.version", no_trl)
    assert learning_trl.main(["--out", str(tmp_path / "o")]) == 2
    assert "error: trl is not installed: pip install -e '.[bench]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_recipe_it_cannot_compare_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("importlib.metadata.version", lambda name: learning_trl.TRL_VERSION)
    assert learning_trl.main(["--recipe", "async", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "rollouts.mode must be native and grpo.async off" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
