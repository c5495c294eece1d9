"""The three majority votes named apart (ours `maj@k`, NeMo-Skills' `majority@k`, NeMo-RL's `cons@k`), and
NeMo-Skills' `pass@k` / `pass@1[avg-of-k]` beside ours: each other project's definition is written out here from its
code (NeMo-Skills `BaseMetrics._compute_majority_at_k` / `_compute_pass_at_k`, NeMo-RL `eval_cons_k`), hand-made
cases carry values worked out by hand, and docs/fidelity.md's worked example is checked cell by cell."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError, dump_config, load_config
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.merge import merge_run
from nemo_rl_ext.evals.metrics import PromptSamples, aggregate_eval_metrics, maj_at_k, pass_at_k
from nemo_rl_ext.evals.report import format_metric_table, markdown_report
from nemo_rl_ext.evals.shards import ShardRecord, ShardSpec
from nemo_rl_ext.evals.store import CompletionStore, check_dataset
from nemo_rl_ext.evals.summary import EvalSummary, summarize
from nemo_rl_ext.evals.votes import cons_at_k, majority_at_k

DOC = Path(__file__).resolve().parents[3] / "docs" / "fidelity.md"

# ---- the other projects' definitions, written out (tests only) ------------------------------------------


def nemo_rl_cons_at_k(answers: Sequence[str | None], rewards: Sequence[float], k: int) -> float:
    """NeMo-RL's `eval_cons_k` for one group, literally: every k-subset in index order, its
    `Counter(...).most_common(1)` answer, the reward of `answers.index(winner)`, a subset counts when it is 1.0."""
    subsets = list(itertools.combinations(range(len(answers)), k))
    hits = 0
    for subset in subsets:
        winner = Counter(answers[i] for i in subset).most_common(1)[0][0]
        hits += rewards[list(answers).index(winner)] == 1.0
    return hits / len(subsets)


def nemo_skills_majority_at_k(answers: Sequence[str | None], scores: Sequence[bool], k: int) -> float:
    """NeMo-Skills' majority@k for one problem: the (answer, score) pairs of the first k predictions with an
    answer, the most common pairs' mean score; 0 without any answer."""
    pairs = [(a, s) for a, s in zip(answers[:k], scores[:k], strict=True) if a is not None]
    if not pairs:
        return 0.0
    counts = Counter(pairs)
    top = counts.most_common(1)[0][1]
    tied = [s for (_, s), c in counts.items() if c == top]
    return sum(tied) / len(tied)


def nemo_skills_pass_at_k(scores: Sequence[float], k: int) -> float:
    """NeMo-Skills' pass@k for one problem: the unbiased estimator for 0/1 scores, else the max of the first k."""
    if all(s in (0, 1, True, False) for s in scores):
        n, c = len(scores), int(sum(scores))
        return 1 - (math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 0)
    return max(scores[:k])


def nemo_skills_pass1_avg_of_k(scores: Sequence[float], k: int) -> float:
    """NeMo-Skills' pass@1[avg-of-k] for one problem: the mean score of the first k predictions."""
    return sum(scores[:k]) / k


# ---- cons@k (NeMo-RL) -------------------------------------------------------------------------------------

# NeMo-RL tests/unit/evals/test_eval.py::test_eval_cons_k_multiple_groups, its inputs copied by hand: two groups of
# five samples, k = 3; it expects (8/10 + 3/10) / 2 = 0.55.
NEMO_RL_REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
NEMO_RL_ANSWERS = ["Correct", "Wrong1", "Correct", "Wrong2", "Correct", "Wrong3", "Correct", "Wrong4", "Correct",
                   "Wrong4"]


def test_cons_at_k_gives_nemo_rl_s_0_55_where_our_maj_at_k_gives_0_6167() -> None:
    prompts = [PromptSamples("math", tuple(NEMO_RL_REWARDS[i:i + 5]), tuple(NEMO_RL_ANSWERS[i:i + 5]))
               for i in (0, 5)]
    metrics = aggregate_eval_metrics(prompts, [3])
    assert metrics["cons@3"] == pytest.approx(0.55, rel=1e-12)
    per_group = [cons_at_k(p.answers, [r == 1.0 for r in p.rewards], 3) for p in prompts]
    assert per_group == pytest.approx([8 / 10, 3 / 10], rel=1e-12)  # the test's own per-group counts
    # ours: group 1 has Correct x3, Wrong1, Wrong2: 7 subsets with >= 2 Correct win, the 3 {Correct, Wrong1,
    # Wrong2} subsets tie three ways (1/3 each): 8/10. Group 2 has Correct x2, Wrong4 x2, Wrong3: {C, C, x} 3
    # subsets win, {W4, W4, x} 3 lose, the 4 {W3, C, W4} subsets tie (1/3 each): (3 + 4/3)/10 = 13/30.
    assert metrics["maj@3"] == pytest.approx((8 / 10 + 13 / 30) / 2, rel=1e-12)
    assert round(metrics["maj@3"], 4) == 0.6167


def test_cons_at_k_hand_cases() -> None:
    # B A A B (A correct), k=3: {B,A,A} A wins; {B,A,B} and {B,A,B} B wins; {A,A,B} A wins: 2/4
    assert cons_at_k(["B", "A", "A", "B"], [False, True, True, False], 3) == pytest.approx(1 / 2, rel=1e-12)
    # a tie goes to the answer drawn first: A B, k=2, one subset {A, B}: A (correct) -> 1; B A -> B -> 0
    assert cons_at_k(["A", "B"], [True, False], 2) == 1.0
    assert cons_at_k(["B", "A"], [False, True], 2) == 0.0
    # a missing answer is a vote: None None A B (A correct), k=2: only {A, B} elects A: 1/6
    assert cons_at_k([None, None, "A", "B"], [False, False, True, False], 2) == pytest.approx(1 / 6, rel=1e-12)
    # ... and wins when it is the majority of the whole group: None None A, k=3 -> None -> 0
    assert cons_at_k([None, None, "A"], [False, False, True], 3) == 0.0
    # the subset scores the FIRST sample of the group with the winning answer: A graded 0 first, 1 later; every
    # subset's winner is A or B, and both first samples are wrong: 0 although a correct sample exists
    assert cons_at_k(["A", "A", "B"], [False, True, False], 1) == 0.0
    assert cons_at_k(["A", "A", "B"], [True, False, False], 1) == pytest.approx(2 / 3, rel=1e-12)
    # NeMo-RL's test_eval_cons_k_basic: A B A with A correct, k=1 -> 2/3
    assert cons_at_k(["A", "B", "A"], [True, False, True], 1) == pytest.approx(2 / 3, rel=1e-12)


def test_cons_at_k_equals_nemo_rl_s_enumeration_on_random_cases() -> None:
    rng = random.Random(25)
    for case in range(500):
        n = rng.randint(1, 9) if case < 400 else rng.randint(10, 12)
        pool = [None, "a", "b", "c", "d", "e", "f", "g"][: rng.randint(1, 5 if case < 400 else 8)]
        answers = [rng.choice(pool) for _ in range(n)]
        truth = rng.choice(pool)
        if rng.random() < 0.7:
            rewards = [float(a == truth and a is not None) for a in answers]
        else:  # inconsistent grading: the first sample of an answer decides
            rewards = [float(rng.random() < 0.5) for _ in answers]
        k = rng.randint(1, n)
        want = nemo_rl_cons_at_k(answers, rewards, k)
        assert cons_at_k(answers, [r == 1.0 for r in rewards], k) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_cons_at_k_is_exact_and_fast_for_64_samples() -> None:
    rng = random.Random(3)
    answers = [rng.choice([None, *map(str, range(10)), "7", "7", "7"]) for _ in range(64)]
    correct = [a == "7" for a in answers]
    start = time.perf_counter()
    values = [cons_at_k(answers, correct, k) for k in (1, 2, 4, 8, 16, 32, 64)]
    assert time.perf_counter() - start < 5.0  # NeMo-RL's enumeration would visit C(64, 32) ~ 1.8e18 subsets
    assert all(0.0 <= v <= 1.0 for v in values)
    # k = n: the one subset is the whole group, whose Counter winner is checked here directly
    winner = Counter(answers).most_common(1)[0][0]
    assert values[-1] == float(correct[answers.index(winner)])
    # k = 1: each sample elects its own answer and scores that answer's first sample
    assert values[0] == pytest.approx(sum(correct[answers.index(a)] for a in answers) / 64, rel=1e-12)


@pytest.mark.parametrize("bad", [(["a"], [True, False], 1), (["a", "b"], [True, False], 3), (["a"], [True], 0),
                                 ([], [], 1), (["a"], [True], True)])
def test_the_votes_refuse_bad_arguments(bad: tuple) -> None:
    for vote in (cons_at_k, majority_at_k):
        with pytest.raises(ValueError):
            vote(*bad)


# ---- majority@k (NeMo-Skills) -------------------------------------------------------------------------------


def test_majority_at_k_hand_cases() -> None:
    answers, correct = ["B", "A", "A", "A"], [False, True, True, True]
    assert majority_at_k(answers, correct, 1) == 0.0  # the first sample alone: B
    assert majority_at_k(answers, correct, 2) == 0.5  # B and A tie and share
    assert majority_at_k(answers, correct, 3) == 1.0  # A twice, B once
    # ours over every pair of the same samples: 3 pairs {A, A} win, 3 {B, A} tie: (3 + 3/2) / 6
    assert maj_at_k(answers, correct, 2) == pytest.approx(3 / 4, rel=1e-12)
    # no answer casts no vote; the first k with no answer at all score 0
    assert majority_at_k([None, None, "A"], [False, False, True], 2) == 0.0
    assert majority_at_k([None, None, "A"], [False, False, True], 3) == 1.0
    assert majority_at_k([None, "B", "A"], [False, False, True], 3) == 0.5  # B and A tie
    # the order is the sample order: the same samples reversed
    assert majority_at_k(["A", "A", "A", "B"], [True, True, True, False], 1) == 1.0
    # votes are (answer, correct) pairs: A graded both ways splits into two votes of one each, tied with B
    assert majority_at_k(["A", "A", "B"], [True, False, False], 3) == pytest.approx(1 / 3, rel=1e-12)
    assert majority_at_k(["A", "A"], [True, False], 2) == 0.5


def test_majority_at_k_equals_nemo_skills_on_random_cases() -> None:
    rng = random.Random(52)
    for _ in range(400):
        n = rng.randint(1, 9)
        pool = [None, "a", "b", "c"][: rng.randint(1, 4)]
        answers = [rng.choice(pool) for _ in range(n)]
        scores = [rng.random() < 0.5 for _ in answers]
        k = rng.randint(1, n)
        assert majority_at_k(answers, scores, k) == pytest.approx(nemo_skills_majority_at_k(answers, scores, k))


# ---- pass@k and pass@1[avg-of-k] beside NeMo-Skills' ------------------------------------------------------


def test_pass_at_k_equals_nemo_skills_for_0_1_scores_and_differs_for_others() -> None:
    for scores in ([1, 0, 0, 0], [0, 1, 0, 1, 1], [0, 0, 0], [1, 1], [0, 1, 0, 0, 0, 0, 1, 0]):
        for k in range(1, len(scores) + 1):
            assert pass_at_k(len(scores), sum(scores), k) == pytest.approx(nemo_skills_pass_at_k(scores, k), rel=1e-12)
    # 1 0 0 0, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 in both
    assert pass_at_k(4, 1, 2) == 0.5 and nemo_skills_pass_at_k([1, 0, 0, 0], 2) == 0.5
    # scores that are not 0/1: NeMo-Skills takes the max of the first k; ours thresholds at 1.0 (1 of 3 correct)
    scores = [0.5, 1.0, 0.0]
    assert [nemo_skills_pass_at_k(scores, k) for k in (1, 2)] == [0.5, 1.0]
    prompt = PromptSamples("x", tuple(scores), ("a", "b", "c"))
    metrics = aggregate_eval_metrics([prompt], [1, 2])
    assert metrics["pass@1"] == pytest.approx(1 / 3) and metrics["pass@2"] == pytest.approx(2 / 3)


def test_pass1_avg_of_k_is_ours_at_k_equal_n_and_our_mean_at_k_is_its_average_over_orders() -> None:
    scores = [1.0, 0.0, 0.0, 0.0]
    metrics = aggregate_eval_metrics([PromptSamples("x", tuple(scores), ("a", "b", "b", "b"))], [1, 2, 4])
    assert nemo_skills_pass1_avg_of_k(scores, 4) == metrics["pass@1"] == 0.25  # avg-of-n: the same number
    assert nemo_skills_pass1_avg_of_k(scores, 2) == 0.5 != metrics["pass@1"]  # the first two only
    orders = list(itertools.permutations(scores))
    for k in (1, 2, 4):  # mean@k = pass@1[avg-of-k] averaged over every order of the samples
        assert sum(nemo_skills_pass1_avg_of_k(o, k) for o in orders) / len(orders) == pytest.approx(metrics[f"mean@{k}"])


# ---- docs/fidelity.md's worked example ---------------------------------------------------------------------

EXAMPLE_ANSWERS = ["12", "15", None, "15"]  # s0 wrong, s1 right, s2 no answer, s3 right
EXAMPLE_CORRECT = [False, True, False, True]
EXAMPLE_BY_HAND = {  # k: (maj, majority, cons, pass), worked out in the doc's k=2 table and here
    1: ("1/2", "0", "1/2", "1/2"),  # maj@1: 2 of 4 correct; majority@1: s0; cons@1: s0 0, s1 1, s2 0, s3 -> s1 1
    2: ("2/3", "1/2", "1/3", "5/6"),  # pass@2 = 1 - C(2,2)/C(4,2)
    3: ("3/4", "1/2", "1/2", "1"),  # maj@3: {s0 s1 s2} 1/2, {s0 s1 s3} 1, {s0 s2 s3} 1/2, {s1 s2 s3} 1;
    4: ("1", "1", "1", "1"),  # cons@3: 12 first in {s0 s1 s2} and {s0 s2 s3}: 0, 15 wins the other two
}


def doc_example_rows() -> dict[int, tuple[str, ...]]:
    section = DOC.read_text().split("## Eval metrics", 1)[1].split("\n## ", 1)[0]
    table = section.split("| k | `maj@k` | `majority@k` | `cons@k` | `pass@k` |", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.strip().splitlines()[1:]]
    return {int(r[0]): tuple(r[1:]) for r in rows}


def test_the_docs_worked_example_matches_every_definition() -> None:
    assert doc_example_rows() == EXAMPLE_BY_HAND
    rewards = [float(c) for c in EXAMPLE_CORRECT]
    metrics = aggregate_eval_metrics([PromptSamples("x", tuple(rewards), tuple(EXAMPLE_ANSWERS))], [1, 2, 3, 4])
    for k, cells in EXAMPLE_BY_HAND.items():
        maj, majority, cons, passed = (float(Fraction(c)) for c in cells)
        assert metrics[f"maj@{k}"] == pytest.approx(maj, rel=1e-12)
        assert metrics[f"majority@{k}"] == pytest.approx(majority, rel=1e-12)
        assert metrics[f"cons@{k}"] == pytest.approx(cons, rel=1e-12)
        assert metrics[f"pass@{k}"] == pytest.approx(passed, rel=1e-12)
        assert nemo_rl_cons_at_k(EXAMPLE_ANSWERS, rewards, k) == pytest.approx(cons, rel=1e-12)
        if k >= 2:  # NeMo-Skills reports majority@k from k = 2
            assert nemo_skills_majority_at_k(EXAMPLE_ANSWERS, EXAMPLE_CORRECT, k) == pytest.approx(majority)
    assert len({metrics["maj@2"], metrics["majority@2"], metrics["cons@2"]}) == 3  # three numbers, three names


# ---- eval.metrics, the summary, the report, the merge ------------------------------------------------------


def cfg_with(*extra: str) -> EvalConfig:
    return load_config(None, ["eval.dataset_path=data.jsonl", "eval.save_path=out", "policy.model_name=tiny",
                              "rollouts.num_generations_per_prompt=4", "rollouts.max_rollout_turns=1", *extra],
                       EvalConfig)


def test_eval_metrics_names_and_refuses_unknown_ones_listing_the_valid() -> None:
    assert cfg_with().eval.metrics is None
    assert cfg_with("eval.metrics=[cons@k,maj,majority,maj@k]").eval.metrics == ("cons", "maj", "majority")
    with pytest.raises(ConfigError) as info:
        cfg_with("eval.metrics=[maj,majorty,consensus@k]")
    msg = str(info.value)
    assert "eval.metrics" in msg and "'majorty'" in msg and "'consensus@k'" in msg
    assert "valid: mean_reward, pass@k, maj@k, mean@k, majority@k, cons@k" in msg
    with pytest.raises(ConfigError, match="at least one metric"):
        cfg_with("eval.metrics=[]")


def example_lines(prompt_idx: int = 0) -> list[CompletionLine]:
    return [CompletionLine(prompt_idx=prompt_idx, sample_idx=s, agent="math", reward=float(ok), answer=a,
                           stop_reason="natural", truncated=False, num_turns=1)
            for s, (a, ok) in enumerate(zip(EXAMPLE_ANSWERS, EXAMPLE_CORRECT, strict=True))]


def summary_of(cfg: EvalConfig, lines: list[CompletionLine]) -> EvalSummary:
    prompts = sorted({x.prompt_idx for x in lines})
    datums = [DatumSpec(idx=p, message_log=(), task_name="math") for p in prompts]
    return summarize(cfg, datums, dict.fromkeys(prompts, 4), CompletionStore.of_lines(lines), timings={})


def table_rows(summary: EvalSummary) -> list[str]:
    return [row.split()[0] for row in format_metric_table(summary).splitlines()[2:] if "@" in row.split()[0]]


def test_the_table_shows_ours_by_default_and_eval_metrics_picks_rows_while_the_summary_has_all_three() -> None:
    ks = "eval.ks=[2,4]"
    default = summary_of(cfg_with(ks), example_lines())
    assert table_rows(default) == ["pass@2", "pass@4", "maj@2", "maj@4", "mean@2", "mean@4"]  # today's table
    assert "report_metrics" not in default.to_json()  # summary.json's bytes as before
    chosen = summary_of(cfg_with(ks, "eval.metrics=[majority,cons,maj]"), example_lines())
    assert table_rows(chosen) == ["majority@2", "majority@4", "cons@2", "cons@4", "maj@2", "maj@4"]
    md = markdown_report(chosen, "p.png")
    assert "| cons@2 | 0.333 ± 0.000 |" in md
    assert "mean_reward" not in format_metric_table(chosen) and "`mean_reward`" not in md
    # report.md says in one line what each shown vote is
    assert "- `cons@k`: NeMo-RL's eval: the mean over all k-subsets" in md and "- `majority@k`: NeMo-Skills'" in md
    assert ("- `maj@k`: ours: the mean over all k-subsets of the samples of the majority answer's credit"
            in markdown_report(default, "p.png"))
    for s in (default, chosen):  # summary.json always has the three, under their own names
        assert (s.metrics["maj@2"], s.metrics["majority@2"], s.metrics["cons@2"]) == pytest.approx((2 / 3, 1 / 2, 1 / 3))
    back = EvalSummary.from_json(chosen.to_json())
    assert back.report_metrics == ("majority", "cons", "maj") and table_rows(back) == table_rows(chosen)


def test_summarize_orders_samples_by_sample_idx_whatever_the_file_order() -> None:
    shuffled = list(reversed(example_lines()))  # the store is read by (prompt, sample), not in file order
    metrics = summary_of(cfg_with("eval.ks=[1,2,3]"), shuffled).metrics
    assert metrics["majority@1"] == 0.0 and metrics["majority@3"] == 0.5  # s0 (12, wrong) first
    assert metrics["cons@2"] == pytest.approx(1 / 3)


def write_job(root: Path, cfg: EvalConfig, seed: int | None, name: str, lines: list[CompletionLine],
              num_prompts: int, samples: int) -> None:
    """A job store as the driver leaves it (config.yaml, dataset fingerprint, completions, shard.json)."""
    folder = (root if seed is None else root / "seeds" / str(seed)) / "shards" / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(dump_config(cfg))
    check_dataset(folder / "dataset_fingerprint.json", "data.jsonl", [f"{i:016x}" for i in range(num_prompts)], False)
    CompletionStore(folder / "completions.jsonl").append(lines)
    prompts = sorted({x.prompt_idx for x in lines})
    ShardRecord(cfg.eval.shard, seed, num_prompts, dict.fromkeys(prompts, samples), True).write(folder)


def test_the_merge_of_shards_recomputes_the_votes_from_the_merged_lines(tmp_path: Path) -> None:
    lines = example_lines(0) + [CompletionLine(**{**x.to_json(), "prompt_idx": 1}) for x in example_lines(0)]
    for i in range(2):
        cfg = cfg_with(f"eval.save_path={tmp_path}", f"eval.shard={i}/2", "eval.metrics=[cons,majority]", "eval.ks=[1,2,3,4]")
        write_job(tmp_path, cfg, None, ShardSpec(i, 2).name, [x for x in lines if x.prompt_idx == i][::-1], 2, 4)
    summary = merge_run(tmp_path).summary
    for k, (maj, majority, cons, _) in EXAMPLE_BY_HAND.items():  # both prompts are the worked example
        assert summary.metrics[f"maj@{k}"] == pytest.approx(float(Fraction(maj)), rel=1e-12)
        assert summary.metrics[f"majority@{k}"] == pytest.approx(float(Fraction(majority)), rel=1e-12)
        assert summary.metrics[f"cons@{k}"] == pytest.approx(float(Fraction(cons)), rel=1e-12)
    assert summary.report_metrics == ("cons", "majority")
    assert "| cons@2 | 0.333 ± 0.000 |" in (tmp_path / "report.md").read_text()


@pytest.mark.usefixtures("no_report_plots")
def test_seeds_pool_in_the_order_eval_seeds_lists_them_as_nemo_skills_seed_files(tmp_path: Path) -> None:
    # seeds [9, 3], 2 samples each: seed 9 holds s0 s1 of the example, seed 3 holds s2 s3; pooled: s0 s1 s2 s3
    seeds = {9: example_lines()[:2], 3: [CompletionLine(**{**x.to_json(), "sample_idx": x.sample_idx - 2})
                                         for x in example_lines()[2:]]}
    for j, (seed, lines) in enumerate(seeds.items()):
        cfg = cfg_with(f"eval.save_path={tmp_path}", "rollouts.num_generations_per_prompt=2",
                       "rollouts.max_rollout_turns=1", "eval.num_prompts=1",
                       "eval.seeds=[9,3]", f"eval.seed_index={j}", f"policy.generation.seed={seed}",
                       "eval.shard=0/1", "eval.ks=[1,2,3,4]")
        write_job(tmp_path, cfg, seed, "0-of-1", lines, 1, 2)
    metrics = merge_run(tmp_path).summary.metrics
    for k, (maj, majority, cons, _) in EXAMPLE_BY_HAND.items():
        assert metrics[f"majority@{k}"] == pytest.approx(float(Fraction(majority)), rel=1e-12)
        assert metrics[f"cons@{k}"] == pytest.approx(float(Fraction(cons)), rel=1e-12)
        assert metrics[f"maj@{k}"] == pytest.approx(float(Fraction(maj)), rel=1e-12)

