"""run_eval reports named reward components: summary.json, the console table's line, report.md's section."""

from __future__ import annotations

import json

import pytest

from nemo_rl_ext.config import load_config
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.report import format_metric_table, markdown_report
from nemo_rl_ext.evals.store import CompletionStore
from nemo_rl_ext.evals.summary import EvalSummary, summarize


def line(p: int, s: int, components: dict | None, error: str | None = None) -> CompletionLine:
    return CompletionLine(prompt_idx=p, sample_idx=s, agent="fmt", reward=sum((components or {}).values()),
                          answer=None, stop_reason="error" if error else "natural", truncated=False, num_turns=1,
                          error=error, reward_components=components or {})


def summary_of(lines: list[CompletionLine]) -> EvalSummary:
    cfg = load_config(None, ["eval.dataset_path=x.jsonl", "eval.save_path=out", "policy.model_name=tiny",
                             "eval.ks=[1]"], EvalConfig)
    prompts = sorted({x.prompt_idx for x in lines})
    datums = [DatumSpec(idx=p, message_log=(), task_name="fmt") for p in prompts]
    expected = {p: sum(x.prompt_idx == p for x in lines) for p in prompts}
    return summarize(cfg, datums, expected, CompletionStore.of_lines(lines), timings={})


def test_components_are_summarised_over_the_scored_samples_and_reported() -> None:
    lines = [
        line(0, 0, {"correct": 1.0, "format": 0.5}), line(0, 1, {"correct": 0.0, "format": 1.0}),
        line(1, 0, {"correct": 1.0, "format": 0.0}), line(1, 1, None, error="GymError: down"),
    ]
    summary = summary_of(lines)
    # correct: 1, 0, 1 -> mean 2/3; format: 0.5, 1, 0 -> mean 0.5; the error line is not a sample
    assert summary.reward_components == {
        "correct": {"mean": pytest.approx(2 / 3, rel=1e-15), "min": 0.0, "max": 1.0, "num_samples": 3},
        "format": {"mean": 0.5, "min": 0.0, "max": 1.0, "num_samples": 3},
    }
    back = EvalSummary.from_json(json.loads(json.dumps(summary.to_json())))
    assert back.reward_components == summary.reward_components
    assert "reward components (mean): correct 0.6667, format 0.5000" in format_metric_table(summary)
    md = markdown_report(summary, "p.png")
    assert "## Reward components" in md
    assert "| `correct` | 0.6667 | 0 | 1 | 3 |" in md and "| `format` | 0.5000 | 0 | 1 | 3 |" in md


def test_a_summary_without_components_keeps_its_keys() -> None:
    summary = summary_of([line(0, 0, None), line(0, 1, None)])
    assert summary.reward_components is None and "reward_components" not in summary.to_json()
    assert "Reward components" not in markdown_report(summary, "p.png")
    assert "reward components" not in format_metric_table(summary)
