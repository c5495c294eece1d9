"""docs/extending.md's metric section works as written: its code block, run as is, adds a metric that the eval's
aggregation computes (checked against a brute-force count here), the report's table shows, and the per-task reward
profile carries (summary.json's `profile`, the report's profile table)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import orjson
import pytest

from nemo_rl_ext.config import load_config
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.metrics import PromptSamples, aggregate_eval_metrics, metric_defs, unregister_metric
from nemo_rl_ext.evals.report import format_metric_table, markdown_report
from nemo_rl_ext.evals.store import CompletionStore, dumps
from nemo_rl_ext.evals.summary import EvalSummary, summarize

DOC = Path(__file__).resolve().parents[3] / "docs" / "extending.md"
SECTION = "## 3. A metric"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


@contextmanager
def doc_snippet() -> Iterator[dict]:
    """The namespace of the doc's code block after running it; what it registered is removed afterwards."""
    blocks = python_blocks(DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0])  # up to the next section
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
        check_pass_all_in_the_profile()
    assert "pass_all" not in [m.name for m in metric_defs()]  # the registration left no trace
    assert not any(k.startswith("pass_all") for k in aggregate_eval_metrics(PROMPTS, [1]))
    profile = summary_of_lines()["profile"]["overall"]
    assert "pass_all_at_k" not in profile and list(profile)[4:7] == ["mean_reward", "pass_at_k", "maj_at_k"]


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



def summary_of_lines() -> EvalSummary:
    """The eval summary (profile included) of completion lines holding `PROMPTS`' samples, error lines included."""
    lines = []
    for p, prompt in enumerate(PROMPTS):
        for s, (r, a) in enumerate(zip(prompt.rewards, prompt.answers, strict=True)):
            lines.append(CompletionLine(prompt_idx=p, sample_idx=s, agent=prompt.agent_name, reward=r, answer=a,
                                        stop_reason="natural", truncated=False, num_turns=1))
        for s in range(len(prompt.rewards), len(prompt.rewards) + prompt.num_errors):
            lines.append(CompletionLine(prompt_idx=p, sample_idx=s, agent=prompt.agent_name, reward=0.0, answer=None,
                                        stop_reason="error", truncated=False, num_turns=0, error="down"))
    cfg = load_config(None, ["eval.dataset_path=d.jsonl", "eval.save_path=out",
                             "rollouts.num_generations_per_prompt=4", "rollouts.max_rollout_turns=1",
                             "eval.ks=[1,2,4]", "eval.reward_threshold=1.0", "eval.max_error_rate=1"], EvalConfig)
    expected = {p: len(x.rewards) + x.num_errors for p, x in enumerate(PROMPTS)}
    datums = [DatumSpec(idx=p, message_log=(), task_name="") for p in expected]
    return summarize(cfg, datums, expected, CompletionStore.of_lines(lines), timings={})


def check_pass_all_in_the_profile() -> None:
    summary = summary_of_lines()
    profile = summary.profile
    assert profile is not None
    for task, prompts in (("alpha", PROMPTS[:2]), ("beta", PROMPTS[2:])):
        want = {}
        for k in (1, 2, 4):
            values = [all_correct_fraction([r >= 1.0 for r in p.rewards], k) for p in prompts if len(p.rewards) >= k]
            if values:
                want[k] = sum(values) / len(values)
        assert dict(profile.tasks[task].per_k("pass_all")) == pytest.approx(want, abs=1e-12), task
    assert list(profile.tasks["beta"].per_k("pass_all")) == [1, 2]  # beta has 3 samples: no k=4, as for pass@4
    assert profile.overall.per_k("pass_all")[4] == pytest.approx(0.5)  # alpha's prompts: 0 and 1
    obj = summary.to_json()["profile"]["tasks"]["alpha"]
    keys = list(obj)
    assert keys.index("maj_at_k") + 1 == keys.index("pass_all_at_k") < keys.index("truncation_rate")
    assert obj["pass_all_at_k"] == {str(k): v for k, v in profile.tasks["alpha"].per_k("pass_all").items()}
    assert "mean_at_k" not in obj  # mean@k equals mean_reward: not in the profile
    back = EvalSummary.from_json(orjson.loads(dumps(summary.to_json(), indent=True)))
    assert back.profile is not None and back.profile.tasks["beta"].per_k("pass_all") == profile.tasks["beta"].per_k(
        "pass_all") and back == summary
    md = markdown_report(summary, "p.png").split("## Reward profile")[1]
    alpha2 = profile.tasks["alpha"].per_k("pass_all")[2]
    assert f"| pass_all@2 | {profile.overall.per_k('pass_all')[2]:.3f} | {alpha2:.3f} | " in md
    assert "| pass_all@4 | 0.500 | 0.500 | - |" in md  # beta's column: no k=4
