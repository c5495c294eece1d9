"""bench/learning.py's pieces on hand-made cases: the strict / lenient scorer, the paired bootstrap, the task
generator (no problem in both splits), and the configs it writes (they validate as the CLIs read them)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path.insert(0, str(BENCH))

import learning  # noqa: E402
from learning_stats import (  # noqa: E402
    ErrorSamplesLeft,
    lenient_correct,
    paired_bootstrap,
    read_scores,
    strict_correct,
    turn_profile,
)
from learning_task import TaskSpec, make_task, parse_ranges  # noqa: E402

from nemo_rl_ext.config import load_config  # noqa: E402
from nemo_rl_ext.evals.config import EvalConfig  # noqa: E402
from nemo_rl_ext.grpo.config import GRPOConfig  # noqa: E402


@pytest.mark.parametrize(("text", "expected", "ok"), [
    ("44", "44", True), (" 44\n", "44", True), ("-32", "-32", True),
    ("44.", "44", False), ("The answer is 44", "44", False), ("44 apples", "44", False), ("4", "44", False),
    ("", "44", False), (None, "44", False), ("yes", "yes", True), ("yes!", "yes", False),
])
def test_strict_is_the_whole_answer(text, expected, ok):
    assert strict_correct(text, expected) is ok


def test_lenient_is_the_graders_reward():
    assert lenient_correct(1.0) and not lenient_correct(0.0) and not lenient_correct(0.99)
    assert lenient_correct(0.5, threshold=0.5)


def _line(idx, sample, text, reward, truncated=False, stop="stop"):
    return json.dumps({"prompt_idx": idx, "sample_idx": sample, "agent": "default", "reward": reward,
                       "stop_reason": stop, "truncated": truncated, "num_turns": 1,
                       "message_log": [{"role": "user", "content": "q", "num_tokens": 1},
                                       {"role": "assistant", "content": text, "num_tokens": 1}]})


def test_read_scores_strict_beside_lenient(tmp_path):
    # prompt 0: "44" twice (strict and lenient); prompt 1: "It is 7." (lenient only) and a truncated wrong one
    path = tmp_path / "completions.jsonl"
    path.write_text("\n".join([_line(0, 0, "44", 1.0), _line(0, 1, "44", 1.0),
                               _line(1, 0, "It is 7.", 1.0), _line(1, 1, "To find 3 + 4 we", 0.0, True)]) + "\n")
    scores = read_scores(path, ["44", "7"])
    assert scores.strict.tolist() == [1.0, 0.0]
    assert scores.lenient.tolist() == [1.0, 0.5]
    assert scores.truncated.tolist() == [0.0, 0.5]
    assert scores.num_samples == 2


@pytest.mark.parametrize(("lines", "message"), [
    ([_line(0, 0, "1", 1.0)], "have no completion"),
    ([_line(0, 0, "1", 1.0), _line(1, 0, "", 0.0, stop="error")], "is an error sample"),
    ([_line(0, 0, "1", 1.0), _line(0, 1, "1", 1.0), _line(1, 0, "2", 1.0)], "different sample counts"),
])
def test_read_scores_refuses_an_incomplete_eval(tmp_path, lines, message):
    path = tmp_path / "completions.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        read_scores(path, ["1", "2"])


def test_error_samples_are_an_infrastructure_failure(tmp_path):
    path = tmp_path / "completions.jsonl"
    path.write_text(_line(0, 0, "", 0.0, stop="error") + "\n")
    with pytest.raises(ErrorSamplesLeft, match="re-run the eval"):
        read_scores(path, ["1"])


def test_bootstrap_of_equal_pairs_is_zero():
    d = paired_bootstrap([0, 1, 1, 0, 1], [0, 1, 1, 0, 1], resamples=2000)
    assert (d.diff, d.low, d.high) == (0.0, 0.0, 0.0)
    assert not d.excludes_zero()


def test_bootstrap_of_a_constant_shift_is_that_shift():
    before = np.array([0.0, 0.25, 0.5, 0.75])
    d = paired_bootstrap(before, before + 0.25, resamples=2000)
    # every resample's mean difference is the mean of copies of 0.25: exact up to float summation
    assert d.diff == pytest.approx(0.25, rel=1e-12)
    assert d.low == pytest.approx(0.25, rel=1e-12) and d.high == pytest.approx(0.25, rel=1e-12)
    assert d.excludes_zero()


def test_bootstrap_interval_brackets_the_mean_and_matches_the_normal_width():
    # 100 problems: 30 gained (0 -> 1), 10 lost (1 -> 0), 60 unchanged: mean +0.2, per-problem sd ~0.6
    before = np.array([0] * 30 + [1] * 10 + [0] * 60, dtype=float)
    after = np.array([1] * 30 + [0] * 10 + [0] * 60, dtype=float)
    d = paired_bootstrap(before, after, seed=1, resamples=10_000)
    assert d.diff == pytest.approx(0.2)
    assert d.low < 0.2 < d.high and d.excludes_zero()
    sd = np.std(after - before) / np.sqrt(100)  # the normal approximation's half-width: 1.96 sd
    # the percentile interval's half-width agrees with it to the bootstrap's Monte-Carlo error and the skew of
    # a 3-valued variable (a few percent at n = 100): 25% is far outside both
    assert (d.high - d.low) / 2 == pytest.approx(1.96 * sd, rel=0.25)


def test_bootstrap_is_seeded():
    rng = np.random.default_rng(5)
    # sampled pass@1 shares (continuous): two seeds' percentile ends differ, one seed's are reproduced
    before, after = rng.random(50), rng.random(50)
    assert paired_bootstrap(before, after, seed=3) == paired_bootstrap(before, after, seed=3)
    assert paired_bootstrap(before, after, seed=3) != paired_bootstrap(before, after, seed=4)


def test_bootstrap_refuses_unpaired_input():
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([1, 0], [1])


def test_arithmetic_task_shares_no_problem_and_is_seeded():
    spec = TaskSpec(name="arithmetic", train_size=2000, heldout_size=500, seed=0)
    train, heldout = make_task(spec)
    assert (len(train), len(heldout)) == (2000, 500)
    triple = {row["question"] for row in train}
    assert len(triple) == 2000 and len({r["question"] for r in heldout}) == 500
    assert not triple & {r["question"] for r in heldout}
    for row in train[:50] + heldout[:50]:
        a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split()
        assert str({"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]) == row["answer"]
    assert {r["op"] for r in heldout} == {"+", "-", "*"}
    assert make_task(spec) == (train, heldout)
    assert make_task(TaskSpec(name="arithmetic", train_size=2000, heldout_size=500, seed=1)) != (train, heldout)


def test_arithmetic_task_options_and_errors():
    # 36 products 2..7 x 2..7, split 27 : 9 in proportion to the sizes asked
    train, heldout = make_task(TaskSpec(name="arithmetic", train_size=27, heldout_size=9, ops=("*",),
                                        ranges=parse_ranges(["*:2:7"])))
    assert {r["op"] for r in train + heldout} == {"*"}
    # 40 : 10 asked: the 36 split 29 : 7, fewer than 40 for training
    with pytest.raises(ValueError, match="training split has only 29 distinct problems"):
        make_task(TaskSpec(name="arithmetic", train_size=40, heldout_size=10, ops=("*",),
                           ranges=parse_ranges(["*:2:7"])))
    with pytest.raises(ValueError, match="OP:LOW:HIGH"):
        parse_ranges(["+10:99"])
    with pytest.raises(ValueError, match="operators"):
        make_task(TaskSpec(name="arithmetic", train_size=4, heldout_size=2, ops=("/",)))


def test_say_yes_words_are_disjoint():
    train, heldout = make_task(TaskSpec(name="say_yes", train_size=16, heldout_size=32))
    assert not {r["question"] for r in train} & {r["question"] for r in heldout}
    assert {r["answer"] for r in train + heldout} == {"yes"}


@pytest.mark.parametrize("recipe", sorted(p.stem for p in learning.RECIPES.glob("*.yaml")))
def test_every_recipe_validates(recipe):
    path, _ = learning.load_recipe(recipe)
    assert path.read_text().startswith("# Recipe"), "each recipe says what it is in a header comment"
    load_config(path, [], GRPOConfig)


def test_the_configs_the_bench_writes_validate(tmp_path):
    args = learning.parse_args(["--task", "arithmetic", "--set", "optimizer.micro_batch_size=16"])
    _, recipe = learning.load_recipe("lora")
    cfg = learning.grpo_config(recipe, args, tmp_path / "train.jsonl", tmp_path / "run", control=False)
    control = learning.grpo_config(recipe, args, tmp_path / "train.jsonl", tmp_path / "c", control=True)
    grpo = GRPOConfig.model_validate(cfg)
    assert grpo.optimizer.micro_batch_size == 16 and grpo.optimizer.lr == 1e-4
    assert GRPOConfig.model_validate(control).optimizer.lr == 0.0  # the control: lr 0 is a valid config
    for sampled in (False, True):
        ev = EvalConfig.model_validate(learning.eval_config(cfg, args, tmp_path / "h.jsonl", "smollm2",
                                                            tmp_path / "e", sampled=sampled))
        assert ev.policy.generation.temperature == (1.0 if sampled else 0.0)
        assert ev.rollouts.env.system_prompt == learning.SYSTEM_PROMPT


def test_user_errors_exit_2(tmp_path, capsys):
    assert learning.main(["--recipe", "nope", "--out", str(tmp_path / "o")]) == 2
    assert "recipe 'nope'" in capsys.readouterr().err
    assert learning.main(["--eval-size", "600", "--out", str(tmp_path / "o2")]) == 2
    assert "--eval-size" in capsys.readouterr().err
    assert learning.main(["--set", "optimizer.lr", "--out", str(tmp_path / "o3")]) == 2


def test_parse_args_defaults():
    args = learning.parse_args([])
    assert isinstance(args, argparse.Namespace)
    assert (args.recipe, args.task, args.heldout_size, args.train_size, args.samples) == \
        ("lora", "arithmetic", 500, 2000, 4)


def test_device_and_batch_reach_every_phase_config(tmp_path):
    args = learning.parse_args(["--device", "cuda", "--prompts-per-step", "16", "--generations", "32"])
    _, recipe = learning.load_recipe("lora")
    for control in (False, True):
        grpo = GRPOConfig.model_validate(learning.grpo_config(recipe, args, tmp_path / "t.jsonl", tmp_path / "r",
                                                              control=control))
        assert grpo.policy.device == "cuda"
        assert (grpo.grpo.num_prompts_per_step, grpo.rollouts.num_generations_per_prompt) == (16, 32)
    cfg = learning.grpo_config(recipe, args, tmp_path / "t.jsonl", tmp_path / "r", control=False)
    for sampled in (False, True):
        ev = EvalConfig.model_validate(learning.eval_config(cfg, args, tmp_path / "h.jsonl", "smollm2",
                                                            tmp_path / "e", sampled=sampled))
        assert ev.policy.device == "cuda"
    default = learning.parse_args([])
    assert default.device == "cpu"
    assert learning.grpo_config(recipe, default, tmp_path / "t.jsonl", tmp_path / "r",
                                control=False)["policy"]["device"] == "cpu"


def test_the_results_say_which_device_produced_them():
    assert learning.device_line({"device": "cpu"}) == "cpu"
    assert learning.device_line({"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "cuda": "12.8"}) == \
        "cuda (NVIDIA H100 80GB HBM3, CUDA 12.8)"
    assert learning.device_info("cpu") == {"device": "cpu"}


def test_cuda_without_a_cuda_device_is_a_user_error(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert learning.main(["--device", "cuda", "--out", str(tmp_path / "o")]) == 2
    assert "--device cuda but torch sees no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before any phase or file


def test_no_plots_without_matplotlib(monkeypatch, tmp_path, capsys):
    # the lent GPU image has no matplotlib: the bench writes its tables and says there are no plots
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert learning.write_plots({}, {}, {}, tmp_path) == []
    assert "matplotlib is not installed: no plots" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_guess_number_games_are_disjoint_and_in_range():
    train, heldout = make_task(TaskSpec(name="guess_number", train_size=2000, heldout_size=500))
    assert (len(train), len(heldout)) == (2000, 500)
    assert not {(r["question"], r["answer"]) for r in train} & {(r["question"], r["answer"]) for r in heldout}
    for row in train + heldout:
        lo, hi = (int(w) for w in row["question"].removesuffix(". Guess it.").split()[-3::2])
        assert lo <= int(row["answer"]) <= hi and 3 <= hi - lo + 1 <= 10 and row["op"] == f"width {hi - lo + 1}"
    with pytest.raises(ValueError, match="distinct games"):
        make_task(TaskSpec(name="guess_number", train_size=20, heldout_size=5, guess_lows=(1, 1),
                           guess_widths=(3, 3)))


def test_guess_123_words_are_disjoint_and_secrets_balanced():
    train, heldout = make_task(TaskSpec(name="guess_123", train_size=32, heldout_size=36))
    assert not {r["question"] for r in train} & {r["question"] for r in heldout}
    assert sorted(r["answer"] for r in heldout) == sorted(["1", "2", "3"] * 12)


def test_multi_turn_tasks_set_the_turn_cap_of_training_and_eval(tmp_path):
    args = learning.parse_args(["--task", "guess_number", "--recipe", "lora"])
    _, recipe = learning.load_recipe("lora")
    cfg = GRPOConfig.model_validate(learning.grpo_config(recipe, args, tmp_path / "t.jsonl", tmp_path / "r",
                                                         control=False))
    assert cfg.rollouts.max_rollout_turns == 4 and cfg.rollouts.env.name == "guess_number"
    assert cfg.rollouts.env.kwargs == {"max_guesses": 4, "discount": 0.8}
    raw = learning.grpo_config(recipe, args, tmp_path / "t.jsonl", tmp_path / "r", control=False)
    ev = EvalConfig.model_validate(learning.eval_config(raw, args, tmp_path / "h.jsonl", "smollm2", tmp_path / "e",
                                                        sampled=False))
    assert ev.rollouts.max_rollout_turns == 4 and ev.rollouts.env.kwargs == {"max_guesses": 4}


def test_turn_profile_counts_solves_per_turn_and_the_moves_after_each_reply(tmp_path):
    def line(reward, *contents):
        roles = ["user"] + ["assistant", "user"] * 2
        return json.dumps({"reward": reward, "message_log": [{"role": r, "content": c}
                                                             for r, c in zip(roles, ("q", *contents), strict=False)]})
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join([line(1.0, "2"), line(1.0, "2", "Higher.", "3"), line(0.0, "2", "Lower.", "2")]))
    profile = turn_profile(path)
    assert profile["solved_first_turn"] == pytest.approx(1 / 3) and profile["solved_later_turn"] == pytest.approx(1 / 3)
    assert profile["mean_turns"] == pytest.approx(5 / 3)
    assert profile["next_move_after_reply"] == {"Higher.": {"3": 1}, "Lower.": {"2": 1}}


def test_signal_word_prompts_are_disjoint_balanced_and_never_name_the_answer():
    train, heldout = make_task(TaskSpec(name="signal_word", train_size=31, heldout_size=32))
    assert not {r["question"] for r in train} & {r["question"] for r in heldout}
    assert sorted(r["answer"] for r in heldout) == sorted(["dog", "cat"] * 16)
    assert {(r["op"], r["answer"]) for r in train + heldout} == {("Woof.", "dog"), ("Meow.", "cat")}
    # the prompt is the same for both answers but for its word, never a signal: only the environment's reply
    # says which
    assert {r["question"].rsplit(" ", 1)[0] for r in train + heldout} == {"Woof: dog. Meow: cat."}
    assert not {r["question"].rsplit(" ", 1)[1] for r in train + heldout} & {"dog", "cat"}
    with pytest.raises(ValueError, match="signal_word has 66 words"):
        make_task(TaskSpec(name="signal_word", train_size=35, heldout_size=32))


def test_signal_word_trains_on_similarity_and_evaluates_the_exact_answer_over_two_turns(tmp_path):
    args = learning.parse_args(["--task", "signal_word", "--recipe", "full_ft"])
    _, recipe = learning.load_recipe("full_ft")
    raw = learning.grpo_config(recipe, args, tmp_path / "t.jsonl", tmp_path / "r", control=False)
    cfg = GRPOConfig.model_validate(raw)
    assert cfg.rollouts.max_rollout_turns == 2 and cfg.rollouts.env.name == "signal_word"
    assert cfg.rollouts.env.kwargs == {"signals": {"Woof.": "dog", "Meow.": "cat"}, "mode": "similarity"}
    ev = EvalConfig.model_validate(learning.eval_config(raw, args, tmp_path / "h.jsonl", "tiny", tmp_path / "e",
                                                        sampled=False))
    assert ev.rollouts.max_rollout_turns == 2 and ev.rollouts.env.kwargs["mode"] == "exact"
    assert list(ev.policy.generation.stop_strings) == ["dog", "cat"]
