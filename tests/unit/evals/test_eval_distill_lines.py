"""On-policy distillation in the eval: each completion line's KL sum and token count, and the summary's
`distill/reverse_kl` as their sum over sum (exact across shards, seeds and resumes; never a mean of means)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_eval_shards import N_PROMPTS, N_SAMPLES, line, run_cfg, write_store

from nemo_rl_ext.data.records import Completion, Message, StopReason
from nemo_rl_ext.evals.lines import CompletionLine, distill_sums
from nemo_rl_ext.evals.merge import merge_run
from nemo_rl_ext.evals.report import format_metric_table, markdown_report
from nemo_rl_ext.evals.shards import ShardSpec
from nemo_rl_ext.evals.store import dumps


def scored(p: int, s: int) -> CompletionLine:
    """Prompt p's sample s: agent a (even p) or b (odd p), p + s + 1 scored tokens of KL term 0.1 * (p + 1)."""
    n = p + s + 1
    return line(None, p, s, agent="ab"[p % 2], distill={"reverse_kl_sum": 0.1 * (p + 1) * n, "scored_tokens": n})


def expected_kl(keep) -> float:
    pairs = [(p, s) for p in range(N_PROMPTS) for s in range(N_SAMPLES) if keep(p, s)]
    return math.fsum(0.1 * (p + 1) * (p + s + 1) for p, s in pairs) / sum(p + s + 1 for p, s in pairs)


def test_a_line_round_trips_its_sums_and_a_line_without_a_teacher_is_unchanged() -> None:
    x = scored(2, 1)
    assert CompletionLine.from_json(json.loads(dumps(x.to_json()))) == x
    plain = line(None, 0, 0)
    assert "distill" not in plain.to_json()
    assert list(json.loads(dumps(x.to_json()))) == [*plain.to_json(), "distill"]


def test_distill_sums_of_a_completion_are_generation_minus_teacher_logprobs() -> None:
    assistant = Message("assistant", "x", (5, 6, 7), generation_logprobs=(-0.5, -1.0, -2.0),
                        teacher_logprobs=(-0.25, -1.5, -2.0))
    tool = Message("tool", "y", (8,))
    second = Message("assistant", "z", (9,), generation_logprobs=(-3.0,), teacher_logprobs=(-1.0,))
    done = Completion(message_log=(Message("user", "q", (1, 2)), assistant, tool, second), reward=1.0,
                      truncated=False, stop_reason=StopReason.NATURAL, num_turns=2, agent_name="a")
    # (-0.5 + 0.25) + (-1.0 + 1.5) + 0 + (-3.0 + 1.0) = -1.75 over 4 scored tokens (exact in binary)
    assert distill_sums(done) == {"reverse_kl_sum": -1.75, "scored_tokens": 4.0, "teacher_logprob_sum": -4.75}
    unscored = Completion(message_log=(Message("assistant", "x", (5,), generation_logprobs=(-0.5,)),),
                          reward=0.0, truncated=False, stop_reason=StopReason.NATURAL, num_turns=1, agent_name="a")
    assert distill_sums(unscored) == {}


def test_merged_shards_report_the_kl_as_sum_over_count_overall_and_per_agent(tmp_path: Path) -> None:
    root = tmp_path / "run"
    for i in range(2):
        spec = ShardSpec(i, 2)
        prompts = [p for p in range(N_PROMPTS) if spec.owns(p)]
        rows = [scored(p, s) for p in prompts for s in range(N_SAMPLES)]
        # an error completion carries no KL and does not count (a resume retries it)
        rows = [line(None, 0, 0, agent="a", stop_reason="error", error="TeacherError: down")
                if (r.prompt_idx, r.sample_idx) == (0, 0) else r for r in rows]
        write_store(root, run_cfg(root, f"eval.shard={spec.text}"), None, spec.name, prompts, lines=rows)
    summary = merge_run(root).summary
    keep = lambda p, s: (p, s) != (0, 0)  # noqa: E731
    tol = dict(rel=64 * 2.0**-52)  # a few dozen float additions of values of the same sign
    assert summary.metrics["distill/reverse_kl"] == pytest.approx(expected_kl(keep), **tol)
    assert summary.metrics["distill/reverse_kl/a"] == pytest.approx(
        expected_kl(lambda p, s: keep(p, s) and p % 2 == 0), **tol)
    assert summary.metrics["distill/reverse_kl/b"] == pytest.approx(expected_kl(lambda p, s: p % 2 == 1), **tol)
    assert summary.metrics["distill/scored_tokens"] == sum(
        p + s + 1 for p in range(N_PROMPTS) for s in range(N_SAMPLES) if keep(p, s))
    # not the mean of the two shards' means
    on_disk = json.loads((root / "summary.json").read_text())["metrics"]
    assert on_disk["distill/reverse_kl"] == summary.metrics["distill/reverse_kl"]
    note = format_metric_table(summary)
    assert f"student-teacher KL (distill/reverse_kl, per token): {expected_kl(keep):.4f}" in note
    assert "## Student-teacher KL" in markdown_report(summary, "p.png")


def test_a_summary_without_a_teacher_has_no_kl(tmp_path: Path) -> None:
    root = tmp_path / "run"
    write_store(root, run_cfg(root, "eval.shard=0/1"), None, "0-of-1", list(range(N_PROMPTS)))
    summary = merge_run(root).summary
    assert not [k for k in summary.metrics if k.startswith("distill/")]
    assert "student-teacher KL" not in format_metric_table(summary)
    assert "Student-teacher KL" not in markdown_report(summary, "p.png")


def test_the_eval_checks_its_teachers_before_any_model_loads(tmp_path: Path) -> None:
    from nemo_rl_ext.config import ConfigError, load_config
    from nemo_rl_ext.evals.config import EvalConfig, check_inputs

    data = Path(__file__).resolve().parents[3] / "examples" / "data" / "arithmetic.jsonl"
    cfg = load_config(None, [f"eval.dataset_path={data}", f"eval.save_path={tmp_path}", "policy.model_name=tiny",
                             "on_policy_distillation.enabled=true",
                             f"on_policy_distillation.teacher_model_by_agent_name={{other: {tmp_path / 'nope'}}}"],
                      EvalConfig)
    with pytest.raises(ConfigError) as info:
        check_inputs(cfg)
    msg = str(info.value)
    assert msg.startswith("2 problems with the eval's inputs"), msg
    assert "no teacher for agent(s) ['math']" in msg and str(tmp_path / "nope") in msg
