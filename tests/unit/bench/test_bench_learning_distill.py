"""bench/learning_distill.py's pieces on hand-made cases: the curve rows (samples, seconds, share of the teacher's
score, the paired gain), the first crossings of half and 80% of the teacher's score, each student's config, the
teacher's data check and the options it refuses. The whole pipeline runs in tests/functional (tiny model)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import learning  # noqa: E402
import learning_distill  # noqa: E402
from learning_distill_report import curve_rows, reached, results_markdown  # noqa: E402
from learning_stats import PromptScores  # noqa: E402


def scores(passed: int, n: int = 10) -> PromptScores:
    """n greedy answers, the first `passed` of them correct, none truncated."""
    lenient = np.array([1.0] * passed + [0.0] * (n - passed))
    return PromptScores(strict=lenient.copy(), lenient=lenient, truncated=np.zeros(n), num_samples=1)


def rows_of(points: dict[int, tuple[float, int]], teacher: int = 8) -> list[dict]:
    """curve_rows from {step: (training seconds, passed of 10)}, 64 samples a step, untrained = step 0's."""
    sc = {s: scores(p) for s, (_, p) in points.items()}
    return curve_rows(sc, {s: t for s, (t, _) in points.items()}, sc[0], scores(teacher), 64, seed=0, resamples=200)


def test_curve_rows_count_samples_seconds_and_the_share_of_the_teachers_score():
    rows = rows_of({0: (0.0, 0), 5: (50.0, 4), 10: (110.0, 6)})
    r = rows[1]
    assert (r["step"], r["samples"], r["train_s"], r["passed"], r["n"]) == (5, 320, 50.0, 4, 10)
    assert r["of_teacher"] == pytest.approx(0.4 / 0.8)
    assert r["gain"]["diff"] == pytest.approx(0.4) and r["gain"]["low"] > 0.0  # 4 of 10 up, none down
    assert r["lenient"]["low"] <= 0.4 <= r["lenient"]["high"]
    assert rows[0]["samples"] == 0 and rows[0]["gain"]["diff"] == 0.0


def test_a_teacher_that_passes_nothing_gives_no_share():
    assert rows_of({0: (0.0, 0), 5: (1.0, 2)}, teacher=0)[1]["of_teacher"] is None


def test_reached_is_the_first_evaluated_step_at_each_share_and_none_when_never():
    curves = {"distill": rows_of({0: (0.0, 0), 5: (40.0, 4), 10: (80.0, 7)}),
              "grpo": rows_of({0: (0.0, 0), 5: (30.0, 1), 10: (60.0, 3)})}
    r = reached(curves)
    assert r["distill"]["50%"] == {"step": 5, "samples": 320, "train_s": 40.0}
    assert r["distill"]["80%"] == {"step": 10, "samples": 640, "train_s": 80.0}
    assert r["grpo"] == {"50%": None, "80%": None}


def test_step_zero_never_counts_as_reaching_the_teacher():
    """An untrained student already at the teacher's score has not been distilled to it."""
    assert reached({"distill": rows_of({0: (0.0, 8), 5: (10.0, 2)})})["distill"]["50%"] is None


def bench_args(tmp_path: Path, *argv: str) -> argparse.Namespace:
    return learning_distill.parse_args(["--out", str(tmp_path / "out"), *argv])


def test_each_student_gets_the_teacher_url_and_its_reward_weight(tmp_path):
    args = bench_args(tmp_path, "--mixed-reward-weight", "0.5")
    base = learning.grpo_config(learning.load_recipe("opd")[1], args, tmp_path / "t.jsonl", tmp_path, control=False)
    url = "http://127.0.0.1:9/v1"
    distill = learning_distill.student_config(base, "distill", url, tmp_path, args)
    mixed = learning_distill.student_config(base, "mixed", url, tmp_path, args)
    grpo = learning_distill.student_config(base, "grpo", url, tmp_path, args)
    assert distill["on_policy_distillation"]["default_teacher_alias"] == url
    assert (distill["on_policy_distillation"]["reward_weight"], mixed["on_policy_distillation"]["reward_weight"]) == (
        0.0, 0.5)
    assert grpo["on_policy_distillation"] == {"enabled": False}
    assert {c["output_dir"] for c in (distill, mixed, grpo)} == {str(tmp_path / n) for n in ("distill", "mixed", "grpo")}
    for c in (distill, mixed, grpo):  # the same budget: only the teacher's part differs
        assert {k: v for k, v in c.items() if k not in ("on_policy_distillation", "output_dir")} == {
            k: v for k, v in base.items() if k not in ("on_policy_distillation", "output_dir")}


def test_options_it_cannot_run_are_named_together(tmp_path):
    args = bench_args(tmp_path, "--recipe", "lora", "--save-every", "7", "--teacher", str(tmp_path),
                      "--mixed-reward-weight", "0")
    with pytest.raises(ValueError) as err:
        learning_distill.check(args, learning.load_recipe("lora")[1])
    text = str(err.value)
    for part in ("on_policy_distillation is not enabled", "--save-every 7", "not a model folder",
                 "--mixed-reward-weight must be > 0"):
        assert part in text


def test_the_save_steps_divide_the_run(tmp_path):
    args = bench_args(tmp_path, "--steps", "20", "--save-every", "5")
    assert learning_distill.check(args, learning.load_recipe("opd")[1]) == [5, 10, 15, 20]


def teacher_of_bench_run(tmp_path: Path, train: str) -> Path:
    """A folder laid out as a bench run's export (OUT/run/export) whose run trained on `train`."""
    run = tmp_path / "earlier"
    (run / "run" / "export").mkdir(parents=True)
    (run / "run" / "export" / "config.json").write_text("{}")
    (run / "data").mkdir()
    (run / "data" / "train.jsonl").write_text(train)
    (run / "data" / "heldout.jsonl").write_text("held\n")
    return run / "run" / "export"


@pytest.mark.parametrize("train, ok", [("train\n", True), ("other\n", False)])
def test_a_bench_runs_teacher_must_have_trained_on_this_runs_data(tmp_path, train, ok):
    teacher = teacher_of_bench_run(tmp_path, train)
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "data" / "train.jsonl").write_text("train\n")
    (out / "data" / "heldout.jsonl").write_text("held\n")
    args = bench_args(tmp_path, "--teacher", str(teacher))
    if ok:
        folder, how = learning_distill.teacher_folder(args, runner=None, out=out)
        assert folder == str(teacher.resolve()) and "the same data" in how
    else:
        with pytest.raises(ValueError, match="data/train.jsonl differs"):
            learning_distill.teacher_folder(args, runner=None, out=out)


def test_results_markdown_has_the_table_the_crossings_and_the_control(tmp_path):
    curves = {n: rows_of({0: (0.0, 0), 5: (40.0, p)}) for n, p in (("distill", 5), ("grpo", 2), ("mixed", 7))}
    teacher = rows_of({0: (0.0, 8)})[0]
    results = {"task": "arithmetic", "date": "d", "machine": "m", "model": "smollm2", "recipe": "opd",
               "kl_type": "reverse", "lr": 1e-4, "steps": 5, "prompts_per_step": 8, "generations": 8,
               "save_every": 5, "eval_size": 10, "heldout_size": 20, "mixed_reward_weight": 1.0, "resamples": 200,
               "seed": 0, "teacher": {**teacher, "folder": "T", "how": "h"}, "curves": curves,
               "reached": reached(curves), "control": rows_of({0: (0.0, 0)})[0], "control_steps": 3,
               "timings_s": {"grpo_distill": 40.0}}
    text = results_markdown(results)
    assert "| distill | 5 | 320 | 40 | 0.500" in text and "| grpo | 5 | 320 | 40 | 0.200" in text
    assert "`distill`: 50% at step 5 (320 samples, 40 s); 80% not reached in 5 steps" in text
    assert "lr-0 control (3 steps of `distill` with lr 0): pass@1 0.000, gain +0.000" in text
