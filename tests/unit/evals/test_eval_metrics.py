"""Eval metrics: exact estimators against brute force over all k-subsets, edge cases, aggregation."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter

import pytest

from nemo_rl_ext.data.records import Completion, Message, PromptGroupRecord, StopReason
from nemo_rl_ext.evals.metrics import (
    PromptSamples,
    aggregate_eval_metrics,
    maj_at_k,
    mean_at_k,
    mean_reward,
    pass_at_k,
    pass_at_k_rewards,
    prompt_samples_from_record,
    vote_key,
)

# ---- brute-force references (tests only) -------------------------------------------------------------


def brute_pass_at_k(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


def brute_maj_at_k(answers: list[str | None], correct: list[bool], k: int) -> float:
    """The documented definition, literally: mean over k-subsets of the mean credit of the modes."""
    counts = Counter(a for a in answers if a is not None)
    n_ok = Counter(a for a, ok in zip(answers, correct, strict=True) if a is not None and ok)
    credit = {a: n_ok[a] / m for a, m in counts.items()}
    subsets = list(itertools.combinations(range(len(answers)), k))
    total = 0.0
    for s in subsets:
        c = Counter(answers[i] for i in s if answers[i] is not None)
        if not c:
            continue
        top = max(c.values())
        modes = [a for a, v in c.items() if v == top]
        total += sum(credit[a] for a in modes) / len(modes)
    return total / len(subsets)


def brute_mean_at_k(rewards: list[float], k: int) -> float:
    subsets = list(itertools.combinations(range(len(rewards)), k))
    return sum(sum(rewards[i] for i in s) / k for s in subsets) / len(subsets)


# ---- pass@k -------------------------------------------------------------------------------------------


def test_pass_at_k_matches_brute_force_on_random_cases() -> None:
    rng = random.Random(1234)
    for _ in range(400):
        n = rng.randint(1, 12)
        correct = [rng.random() < rng.random() for _ in range(n)]
        k = rng.randint(1, n)
        assert pass_at_k(n, sum(correct), k) == pytest.approx(brute_pass_at_k(correct, k), abs=1e-12)


def test_pass_at_k_closed_form_and_simple_values() -> None:
    # n=10, c=3, k=2: 1 - C(7,2)/C(10,2) = 1 - 21/45 = 24/45
    assert pass_at_k(10, 3, 2) == pytest.approx(24 / 45, abs=1e-15)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every 3-subset holds a correct one
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)  # pass@1 = c / n
    # large n stays stable and matches exact integer arithmetic
    assert pass_at_k(1000, 7, 100) == pytest.approx(1 - math.comb(993, 100) / math.comb(1000, 100), rel=1e-12)


@pytest.mark.parametrize(
    ("n", "c", "k"), [(3, 1, 4), (3, 1, 0), (3, 4, 1), (-1, 0, 1), (3, -1, 1), (3, 1, -1), (0, 0, 1)]
)
def test_pass_at_k_rejects_bad_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_rejects_non_integers() -> None:
    with pytest.raises(ValueError, match="integer"):
        pass_at_k(4.0, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="integer"):
        pass_at_k(4, True, 1)  # type: ignore[arg-type]


def test_pass_at_k_with_reward_threshold() -> None:
    rewards = [0.2, 0.9, 0.5, 1.0]
    # threshold 0.5 -> 3 correct of 4; pass@2 = 1 - C(1,2)/C(4,2) = 1
    assert pass_at_k_rewards(rewards, 2, threshold=0.5) == 1.0
    # threshold 0.95 -> 1 correct; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k_rewards(rewards, 2, threshold=0.95) == pytest.approx(0.5)
    # default threshold 1.0: reward exactly 1.0 counts (>=)
    assert pass_at_k_rewards(rewards, 1) == pytest.approx(0.25)


# ---- maj@k --------------------------------------------------------------------------------------------


def test_maj_at_k_matches_brute_force_on_random_cases() -> None:
    rng = random.Random(99)
    for _ in range(300):
        n = rng.randint(1, 11)
        pool = [None, "a", "b", "c", "d", "e"][: rng.randint(2, 6)]
        answers = [rng.choice(pool) for _ in range(n)]
        truth = rng.choice(pool[1:])
        if rng.random() < 0.8:  # consistent correctness (a function of the answer)
            correct = [a == truth for a in answers]
        else:  # inconsistent: exercises the fractional credit
            correct = [rng.random() < 0.5 for _ in answers]
        k = rng.randint(1, n)
        assert maj_at_k(answers, correct, k) == pytest.approx(brute_maj_at_k(answers, correct, k), abs=1e-12)


def test_maj_at_k_hand_cases() -> None:
    # a, a, b with a correct, k=2: subsets {a,a}->1, {a,b}->tie 1/2, {a,b}->1/2 => (1 + .5 + .5)/3
    assert maj_at_k(["a", "a", "b"], [True, True, False], 2) == pytest.approx(2 / 3)
    # k=n: the full-set majority
    assert maj_at_k(["a", "a", "b"], [True, True, False], 3) == 1.0
    assert maj_at_k(["a", "b", "b"], [True, False, False], 3) == 0.0
    # maj@1 = fraction of samples that are correct and have an answer
    assert maj_at_k(["a", None, "b", "a"], [True, True, False, True], 1) == pytest.approx(2 / 4)
    # all answers None -> 0, even if marked correct
    assert maj_at_k([None, None], [True, True], 2) == 0.0
    # None is ignored, not a vote: {None, b}: b wins (wrong) ; {None, a}: a wins ; {a, b}: tie 1/2
    assert maj_at_k([None, "a", "b"], [False, True, False], 2) == pytest.approx((0 + 1 + 0.5) / 3)


def test_maj_at_k_is_fast_for_64_samples() -> None:
    rng = random.Random(7)
    answers = [rng.choice([None, *map(str, range(12))]) for _ in range(64)]
    correct = [a in ("0", "1") for a in answers]
    start = time.perf_counter()
    for k in (1, 2, 4, 8, 16, 32, 64):
        value = maj_at_k(answers, correct, k)
        assert 0.0 <= value <= 1.0
    assert time.perf_counter() - start < 2.0
    # all distinct and all correct: every mode is correct
    assert maj_at_k([str(i) for i in range(64)], [True] * 64, 32) == pytest.approx(1.0)


def test_maj_at_k_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="correctness"):
        maj_at_k(["a", "b"], [True], 1)
    with pytest.raises(ValueError, match="larger"):
        maj_at_k(["a", "b"], [True, False], 3)
    with pytest.raises(ValueError):
        maj_at_k(["a"], [True], 0)
    with pytest.raises(ValueError):
        maj_at_k([], [], 1)


# ---- mean@k / mean_reward -----------------------------------------------------------------------------


def test_mean_at_k_equals_brute_force_expected_subset_mean() -> None:
    rng = random.Random(5)
    for _ in range(100):
        n = rng.randint(1, 9)
        rewards = [rng.uniform(-1, 2) for _ in range(n)]
        k = rng.randint(1, n)
        assert mean_at_k(rewards, k) == pytest.approx(brute_mean_at_k(rewards, k), abs=1e-12)
        assert mean_at_k(rewards, k) == pytest.approx(mean_reward(rewards), abs=1e-15)


def test_mean_reward_and_mean_at_k_edges() -> None:
    assert mean_reward([1.0, 0.0, 0.5]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        mean_reward([])
    with pytest.raises(ValueError):
        mean_at_k([1.0], 2)
    with pytest.raises(ValueError):
        mean_at_k([1.0], 0)


# ---- aggregation --------------------------------------------------------------------------------------


def _example() -> list[PromptSamples]:
    return [
        # math p0: 4 samples, 2 correct (answer "4"); p1: 4 samples, 0 correct; code p2: 2 samples, 1 correct
        PromptSamples("math", (1.0, 0.0, 1.0, 0.0), ("4", "5", "4", None)),
        PromptSamples("math", (0.0, 0.0, 0.0, 0.0), ("1", "1", "2", "3")),
        PromptSamples("code", (1.0, 0.0), ("x", "y")),
    ]


def test_aggregate_keys_and_values() -> None:
    m = aggregate_eval_metrics(_example(), ks=[4, 1, 1])
    # per-prompt pass@1 = c/n: 0.5, 0.0, 0.5 -> mean 1/3; sample std = sqrt(((1/6)^2*2 + (1/3)^2)/2) = sqrt(1/12)
    assert m["pass@1"] == pytest.approx(1 / 3)
    assert m["pass@1/stderr"] == pytest.approx(math.sqrt(1 / 12) / math.sqrt(3))
    assert m["num_prompts"] == 3.0 and m["num_samples"] == 10.0
    assert m["mean_reward"] == pytest.approx((0.5 + 0.0 + 0.5) / 3)
    assert m["mean_reward/stderr"] == pytest.approx(math.sqrt(1 / 12) / math.sqrt(3))
    # k=4 only over the two 4-sample prompts: pass@4 = 1 and 0; maj@4: p0 votes 4,4,5 -> correct; p1 -> 0
    assert m["num_prompts@4"] == 2.0 and m["num_prompts@1"] == 3.0
    assert m["pass@4"] == pytest.approx(0.5)
    assert m["pass@4/stderr"] == pytest.approx(math.sqrt(0.5) / math.sqrt(2))
    assert m["maj@4"] == pytest.approx(0.5)
    assert m["mean@4"] == pytest.approx(0.25)
    # maj@1 per prompt = correct-with-answer fraction: 0.5, 0, 0.5
    assert m["maj@1"] == pytest.approx(1 / 3)
    # per agent
    assert m["agent/math/num_prompts"] == 2.0
    assert m["agent/math/pass@1"] == pytest.approx(0.25)
    assert m["agent/math/pass@4"] == pytest.approx(0.5)
    assert m["agent/code/pass@1"] == pytest.approx(0.5)
    assert m["agent/code/pass@1/stderr"] == 0.0  # one prompt
    assert m["agent/code/num_prompts@4"] == 0.0
    assert "agent/code/pass@4" not in m and "agent/code/maj@4" not in m
    assert m["num_errors"] == 0.0 and m["num_prompts_short@4"] == 0.0
    expected_group = {
        "num_prompts",
        "num_samples",
        "num_errors",
        "mean_reward",
        "mean_reward/stderr",
        "num_prompts@1",
        "num_prompts@4",
        "num_prompts_short@1",
        "num_prompts_short@4",
    }
    expected_group |= {
        f"{x}@{k}{s}" for x in ("pass", "maj", "mean", "majority", "cons") for k in (1, 4) for s in ("", "/stderr")
    }
    code_keys = {k for k in expected_group if not k.endswith("@4") and "@4/" not in k}
    code_keys |= {"num_prompts@4", "num_prompts_short@4"}
    expected = (
        expected_group | {f"agent/math/{k}" for k in expected_group} | {f"agent/code/{k}" for k in code_keys}
    )
    assert set(m) == expected
    assert all(isinstance(v, float) for v in m.values())


def test_aggregate_threshold_and_errors() -> None:
    prompts = [PromptSamples("a", (0.6, 0.2), ("1", "2"))]
    assert aggregate_eval_metrics(prompts, [1], threshold=0.5)["pass@1"] == pytest.approx(0.5)
    assert aggregate_eval_metrics(prompts, [1])["pass@1"] == 0.0
    with pytest.raises(ValueError):
        aggregate_eval_metrics([], [1])
    with pytest.raises(ValueError):
        aggregate_eval_metrics(prompts, [0])
    with pytest.raises(ValueError):
        PromptSamples("a", (1.0,), ())
    with pytest.raises(ValueError):
        PromptSamples("a", (), ())


def test_prompt_samples_from_record() -> None:
    prompt = (Message("user", "q", (1, 2)),)

    def completion(reward: float, answer: object, stop: StopReason = StopReason.NATURAL) -> Completion:
        log = (*prompt, Message("assistant", "a", (3,), (-0.1,)))
        extras = {} if answer is None else {"answer": answer}
        return Completion(
            log, reward, False, stop, 1, "math", extras, "boom" if stop == StopReason.ERROR else None
        )

    record = PromptGroupRecord(
        prompt_idx=0,
        prompt=prompt,
        extra_env_info={},
        metadata={},
        completions=(completion(1.0, 4), completion(0.0, None), completion(0.0, "4", StopReason.ERROR)),
        rollout_metrics={},
        agent_name="math",
    )
    samples = prompt_samples_from_record(record)
    assert samples == PromptSamples("math", (1.0, 0.0), ("4", None), num_errors=1)


# ---- error samples are not answers ---------------------------------------------------------------------


def test_error_samples_are_counted_not_scored() -> None:
    """A prompt's n is its non-error samples: 2 errors out of 4 leave pass@k over the other 2, not 4."""
    with_errors = [
        PromptSamples("math", (1.0, 0.0), ("4", "5"), num_errors=2),  # 4 samples, 2 failed
        PromptSamples("math", (1.0, 1.0, 0.0, 1.0), ("4", "4", "3", "4")),
        PromptSamples("code", (), (), num_errors=2),  # every sample failed
    ]
    m = aggregate_eval_metrics(with_errors, ks=[1, 2, 4])
    # the same as the metrics of the non-error samples alone (the all-error prompt has none)
    alone = aggregate_eval_metrics(with_errors[:2], ks=[1, 2, 4])
    for key in ("pass@1", "pass@2", "maj@2", "mean@2", "mean_reward", "pass@4", "mean_reward/stderr"):
        assert m[key] == pytest.approx(alone[key]), key
    assert m["pass@1"] == pytest.approx((0.5 + 0.75) / 2)  # not (0.25 + 0.75) / 2: errors are not 0s
    assert m["mean_reward"] == pytest.approx((0.5 + 0.75) / 2)
    assert m["num_prompts"] == 3.0 and m["num_samples"] == 6.0 and m["num_errors"] == 4.0
    # k=4: only the whole prompt; errors left the first one short of 4 samples (counted), the all-error
    # prompt had 2 samples to begin with (never eligible for k=4) but is short of k=1 and k=2
    assert m["num_prompts@4"] == 1.0 and m["num_prompts_short@4"] == 1.0
    assert m["num_prompts@2"] == 2.0 and m["num_prompts_short@2"] == 1.0
    assert m["num_prompts@1"] == 2.0 and m["num_prompts_short@1"] == 1.0
    assert m["agent/math/num_errors"] == 2.0 and m["agent/code/num_errors"] == 2.0
    assert m["agent/code/num_samples"] == 0.0 and m["agent/code/num_prompts@1"] == 0.0
    assert "agent/code/mean_reward" not in m and "agent/code/pass@1" not in m
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())
    with pytest.raises(ValueError, match="num_errors"):
        PromptSamples("a", (1.0,), ("1",), num_errors=-1)


# ---- maj@k votes on answers (vote keys), not on strings ------------------------------------------------


def record_of(samples: list[tuple[float, object, dict]]) -> PromptGroupRecord:
    """A record whose completions have these (reward, answer, extra env_extras)."""
    prompt = (Message("user", "q", (1, 2)),)
    completions = tuple(
        Completion(
            (*prompt, Message("assistant", "a", (3,), (-0.1,))),
            reward, False, StopReason.NATURAL, 1, "math", {"answer": answer, **extras},
        )
        for reward, answer, extras in samples
    )
    return PromptGroupRecord(0, prompt, {}, {}, completions, {}, agent_name="math")


def test_stored_vote_keys_make_spellings_one_vote() -> None:
    # "21", 21 and "21." are one answer (key "21"); 20 is a wrong answer with two votes
    record = record_of([
        (1.0, "21", {"vote_key": "21"}),
        (1.0, 21, {"vote_key": "21"}),
        (1.0, "21.", {"vote_key": "21"}),
        (0.0, "20", {"vote_key": "20"}),
        (0.0, "20", {"vote_key": "20"}),
    ])
    samples = prompt_samples_from_record(record)
    assert samples.answers == ("21", "21", "21", "20", "20")
    correct = [r >= 1.0 for r in samples.rewards]
    assert maj_at_k(samples.answers, correct, 5) == 1.0  # 3 votes beat 2 (as strings: 20 won with 2 of 5)
    for k in range(1, 6):
        assert maj_at_k(samples.answers, correct, k) == pytest.approx(
            brute_maj_at_k(["21", "21", "21", "20", "20"], correct, k)
        )


async def test_math_environment_keys_feed_maj_at_k() -> None:
    from nemo_rl_ext.environments import MathEnvironment

    texts = ["\\boxed{0.5}", "\\boxed{1/2}", "\\boxed{\\frac{1}{2}}", "\\boxed{3}", "\\boxed{3.}"]
    prompt = (Message("user", "q", ()),)
    step = await MathEnvironment().step(
        [(*prompt, Message("assistant", t, ())) for t in texts], [{"ground_truth": "1/2"}] * len(texts)
    )
    record = record_of(
        [(r, a, dict(e)) for r, a, e in zip(step.rewards, step.answers, step.extras, strict=True)]
    )
    samples = prompt_samples_from_record(record)
    assert len(set(samples.answers[:3])) == 1 and len(set(samples.answers[3:])) == 1
    assert samples.answers[0] != samples.answers[3]
    correct = [True, True, True, False, False]
    assert maj_at_k(samples.answers, correct, 5) == 1.0  # 1/2 has three votes, 3 has two


def test_tied_answers_still_share_the_credit() -> None:
    # 0.5 and 1/2 are one correct answer with two votes; 3 and "3." one wrong answer with two votes
    keys = ["1/2", "1/2", "3", "3"]
    record = record_of([
        (1.0, "0.5", {"vote_key": "1/2"}),
        (1.0, "\\frac{1}{2}", {"vote_key": "1/2"}),
        (0.0, "3", {"vote_key": "3"}),
        (0.0, "3.", {"vote_key": "3"}),
    ])
    samples = prompt_samples_from_record(record)
    assert samples.answers == tuple(keys)
    correct = [True, True, False, False]
    assert maj_at_k(samples.answers, correct, 4) == 0.5  # a 2-2 tie: the correct answer gets half
    # k=2: {1/2,1/2} -> 1, {3,3} -> 0, the 4 mixed pairs tie -> 1/2 each: (1 + 0 + 4 * 0.5) / 6
    assert maj_at_k(samples.answers, correct, 2) == pytest.approx(0.5)
    assert maj_at_k(samples.answers, correct, 3) == pytest.approx(brute_maj_at_k(keys, correct, 3))


def test_vote_key_of_a_sample() -> None:
    assert vote_key("21.", {"vote_key": "21"}) == "21"
    assert vote_key(21, {}) == "21"
    assert vote_key("  a   b ", None) == "a b"  # no stored key (Gym rows, older files): whitespace-normalized
    assert vote_key(None, {"vote_key": "21"}) is None  # no answer, no vote


def test_the_eval_summary_votes_with_the_keys_written_to_completions_jsonl(tmp_path) -> None:
    from nemo_rl_ext.config import load_config
    from nemo_rl_ext.data.records import DatumSpec
    from nemo_rl_ext.evals.config import EvalConfig
    from nemo_rl_ext.evals.lines import CompletionLine
    from nemo_rl_ext.evals.store import CompletionStore
    from nemo_rl_ext.evals.summary import summarize

    record = record_of([
        (1.0, "21", {"vote_key": "21", "grading": "ok"}),
        (1.0, '"21"', {"vote_key": "21", "grading": "ok"}),
        (1.0, "21.", {"vote_key": "21", "grading": "ok"}),
        (0.0, "20", {"vote_key": "20", "grading": "ok"}),
        (0.0, "20", {"vote_key": "20", "grading": "ok"}),
    ])
    path = tmp_path / "completions.jsonl"
    CompletionStore(path).append(
        CompletionLine.from_completion(record, i, c, False) for i, c in enumerate(record.completions)
    )
    cfg = load_config(
        None,
        ["eval.dataset_path=d.jsonl", f"eval.save_path={tmp_path}", "rollouts.num_generations_per_prompt=5",
         "rollouts.max_rollout_turns=1",
         "policy.generation.temperature=0.7"],
        EvalConfig,
    )
    datum = DatumSpec(idx=0, message_log=record.prompt, task_name="math")
    summary = summarize(cfg, [datum], {0: 5}, CompletionStore(path))  # read back, as a resumed run does
    assert summary["metrics"]["maj@5"] == 1.0  # as strings, "20" would win 2 votes to 1
