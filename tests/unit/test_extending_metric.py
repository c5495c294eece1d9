"""docs/extending.md's metric section works as written: its code block, run as is, adds a metric that the eval's
aggregation computes (checked against a brute-force count here) and the report's table shows."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from nemo_rl_ext.evals.metrics import PromptSamples, aggregate_eval_metrics, metric_defs, unregister_metric
from nemo_rl_ext.evals.report import format_metric_table, markdown_report
from nemo_rl_ext.evals.summary import EvalSummary

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
SECTION = "## 3. A metric"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


@contextmanager
def doc_snippet() -> Iterator[dict]:
    """The namespace of the doc's code block after running it; what it registered is removed afterwards."""
    blocks = python_blocks(DOC.read_text().split(SECTION, 1)[1])
    assert len(blocks) == 1, f"{DOC}'s metric section should hold one python block, found {len(blocks)}"
    before = {m.name for m in metric_defs()}
    namespace: dict = {"__name__": "extending_metric_doc"}
    try:
        exec(compile(blocks[0], str(DOC), "exec"), namespace)
        yield namespace
    finally:
        for name in {m.name for m in metric_defs()} - before:
            unregister_metric(name)


def all_correct_fraction(correct: list[bool], k: int) -> float:
    """Fraction of the k-subsets of the samples whose every sample is correct (brute force)."""
    subsets = list(itertools.combinations(correct, k))
    return sum(all(s) for s in subsets) / len(subsets)


PROMPTS = [
    PromptSamples("alpha", (1.0, 1.0, 0.0, 1.0), ("3", "3", "4", "3")),  # 3 of 4 correct
    PromptSamples("alpha", (1.0, 1.0, 1.0, 1.0), ("5", "5", "5", "5")),  # all correct
    PromptSamples("beta", (0.0, 1.0, 0.5), ("7", "8", "9"), num_errors=1),  # 1 of 3 correct (+1 error)
]


def test_the_documented_metric_is_aggregated_and_reported_and_can_be_removed() -> None:
    with doc_snippet() as namespace:
        assert namespace["PASS_ALL"] in metric_defs()
        check_pass_all()
    assert "pass_all" not in [m.name for m in metric_defs()]  # the registration left no trace
    assert not any(k.startswith("pass_all") for k in aggregate_eval_metrics(PROMPTS, [1]))


def check_pass_all() -> None:
    ks = [1, 2, 4]
    metrics = aggregate_eval_metrics(PROMPTS, ks)
    for prefix, prompts in (("", PROMPTS), ("agent/alpha/", PROMPTS[:2]), ("agent/beta/", PROMPTS[2:])):
        for k in ks:
            values = [all_correct_fraction([r >= 1.0 for r in p.rewards], k) for p in prompts if len(p.rewards) >= k]
            key = f"{prefix}pass_all@{k}"
            if not values:
                assert key not in metrics  # beta has 3 samples: no @4, as for pass@4
                continue
            assert metrics[key] == pytest.approx(sum(values) / len(values), abs=1e-12), key
            assert f"{key}/stderr" in metrics
    # by hand: alpha's prompts give 3/4 and 1 at k=1, 3/6 and 1 at k=2, 0 and 1 at k=4
    assert metrics["agent/alpha/pass_all@2"] == pytest.approx(0.75)
    assert metrics["agent/alpha/pass_all@4"] == pytest.approx(0.5)
    assert metrics["pass_all@4"] <= metrics["pass@4"]  # all correct is harder than one correct
    assert metrics["pass_all@1"] == pytest.approx(metrics["pass@1"], abs=1e-12)  # one sample: the same thing

    summary = EvalSummary(
        rollout_mode="single_turn", model="tiny", dataset_path="d.jsonl", num_prompts=3, num_completions=12,
        ks=tuple(ks), reward_threshold=1.0, agents=("alpha", "beta"), stop_reasons={"error": 1, "natural": 11},
        status="errors_allowed", num_errors=1, error_rate=1 / 12, max_error_rate=0.5,
        error_samples=(), truncation_rate=0.0, mean_turns=1.0, metrics=metrics,
    )
    rows = {r.split()[0]: r.split() for r in format_metric_table(summary).splitlines()[2:]}
    assert rows["pass_all@2"][:3] == ["pass_all@2", f"{metrics['pass_all@2']:.3f}", "±"]
    assert rows["pass_all@4"][-1] == "-"  # beta's column
    names = list(rows)
    assert names.index("mean@4") < names.index("pass_all@1") < names.index("pass_all@4")
    md = markdown_report(summary, "p.png")
    beta2 = f"{metrics['agent/beta/pass_all@2']:.3f} ± {metrics['agent/beta/pass_all@2/stderr']:.3f}"
    assert f"| pass_all@2 | {metrics['pass_all@2']:.3f} ± " in md and md.count(beta2) >= 1

