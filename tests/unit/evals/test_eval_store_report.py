"""The eval's completion store (torn lines, bad lines, resume checks) and its report (table, Markdown, PNG)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.metrics import PromptSamples, aggregate_eval_metrics
from nemo_rl_ext.evals.report import format_metric_table, markdown_report, plot_pass_at_k
from nemo_rl_ext.evals.store import CompletionStore, check_dataset, check_resumable, row_digests
from nemo_rl_ext.evals.summary import EvalSummary


def row_json(p: int, s: int, error: str | None = None, reward: float = 1.0) -> dict:
    return {
        "prompt_idx": p,
        "sample_idx": s,
        "agent": "a",
        "reward": 0.0 if error else reward,
        "answer": None,
        "stop_reason": "error" if error else "natural",
        "truncated": False,
        "num_turns": 1,
        "error": error,
    }


def row(p: int, s: int, error: str | None = None, reward: float = 1.0) -> CompletionLine:
    return CompletionLine.from_json(row_json(p, s, error, reward))


def line(p: int, s: int, error: str | None = None, reward: float = 1.0) -> str:
    return json.dumps(row_json(p, s, error, reward)) + "\n"


def test_store_cuts_a_torn_last_line_and_indexes_samples(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(line(0, 0) + line(0, 1) + line(1, 0) + '{"prompt_idx": 1, "sam')
    store = CompletionStore(path)
    assert store.torn_bytes == len('{"prompt_idx": 1, "sam')
    assert path.read_text() == line(0, 0) + line(0, 1) + line(1, 0)
    assert store.done(0, 4) == {0, 1} and store.done(1, 4) == {0} and store.done(2, 4) == set()
    assert store.done(0, 1) == {0}  # only the samples the prompt gets now
    assert store.append([row(1, 1, reward=0.5)]) == 1
    assert CompletionStore(path).done(1, 2) == {0, 1} and CompletionStore(path).torn_bytes == 0


def test_a_store_opened_without_repair_cuts_its_torn_line_only_when_told(tmp_path: Path) -> None:
    """A resume checks its folder first (repair=False) and cuts the torn line once every check passed; an
    append never lands after a torn line, and a garbage line refuses the file without cutting anything."""
    path = tmp_path / "c.jsonl"
    torn = '{"prompt_idx": 1, "sam'
    path.write_text(line(0, 0) + torn)
    store = CompletionStore(path, repair=False)
    assert store.torn_bytes == len(torn) and path.read_text() == line(0, 0) + torn and store.done(0, 1) == {0}
    store.cut_torn_line()
    assert path.read_text() == line(0, 0)
    store.cut_torn_line()  # once only: nothing more goes
    assert path.read_text() == line(0, 0)
    path.write_text(line(0, 0) + torn)
    CompletionStore(path, repair=False).append([row(1, 0)])
    again = CompletionStore(path, repair=False)
    assert path.read_text().startswith(line(0, 0)) and again.torn_bytes == 0 and again.done(1, 1) == {0}
    path.write_text("not json\n" + torn)
    with pytest.raises(ConfigError, match="unreadable"):
        CompletionStore(path)
    assert path.read_text() == "not json\n" + torn


def test_store_ignores_duplicates_and_rejects_unreadable_lines(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text(line(0, 0) + line(0, 0))
    assert CompletionStore(path).duplicates == 1
    bad_type = json.dumps({**row_json(0, 2), "prompt_idx": "0"})
    path.write_text(line(0, 0) + "not json\n" + '{"sample_idx": 1}\n' + line(0, 1) + bad_type + "\n")
    with pytest.raises(ConfigError, match=r"3 unreadable line\(s\)") as info:
        CompletionStore(path)
    msg = str(info.value)
    assert str(path) in msg and "line 2: not JSON" in msg and "line 4" not in msg
    assert (
        "line 3: missing key(s) ['prompt_idx', 'agent'" in msg and "line 5: wrong type: prompt_idx='0'" in msg
    )


def test_error_lines_are_recorded_but_not_results(tmp_path: Path) -> None:
    """An error line leaves its pair to do; the next line supersedes it; a result is final."""
    path = tmp_path / "c.jsonl"
    path.write_text(line(0, 0) + line(0, 1, "TimeoutError: timed out") + line(1, 0, "boom"))
    store = CompletionStore(path)
    assert store.done(0, 2) == {0} and store.failed(0, 2) == {1} and store.failed(1, 1) == {0}
    assert store.error_lines == 2 and store.line(0, 1)["error"] == "TimeoutError: timed out"
    store.append([row(0, 1, reward=0.5), row(1, 0, "boom again")])  # a retry: one fixed, one failed again
    for s in (store, CompletionStore(path)):  # the same in memory and read back
        assert s.done(0, 2) == {0, 1} and s.failed(0, 2) == set() and s.line(0, 1)["reward"] == 0.5
        assert s.failed(1, 1) == {0} and s.line(1, 0)["error"] == "boom again" and s.error_lines == 3
    store.append([row(0, 1, "late error"), row(0, 1, reward=0.0)])  # after a result: ignored
    again = CompletionStore(path)
    assert again.line(0, 1)["reward"] == 0.5 and again.duplicates == 2 and again.failed(0, 2) == set()
    assert len(path.read_text().splitlines()) == 7  # append-only: every attempt is still on disk


def test_dataset_fingerprint_refuses_changed_rows_and_extends(tmp_path: Path) -> None:
    fp = tmp_path / "dataset_fingerprint.json"
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(5)]
    check_dataset(fp, "d.jsonl", row_digests(rows[:3]), resuming=False)
    assert json.loads(fp.read_text())["num_rows"] == 3
    # key order and formatting don't matter; content does
    assert row_digests([{"answer": "0", "question": "q0"}]) == row_digests(rows[:1])
    check_dataset(fp, "d.jsonl", row_digests(rows), resuming=True)  # more prompts: extends the record
    assert json.loads(fp.read_text())["row_sha256"] == row_digests(rows)
    check_dataset(fp, "d.jsonl", row_digests(rows[:2]), resuming=True)  # fewer: keeps the tail
    assert json.loads(fp.read_text())["num_rows"] == 5
    swapped = [rows[0], rows[3], rows[2], rows[1], rows[4]]
    with pytest.raises(ConfigError) as info:
        check_dataset(fp, "data/d.jsonl", row_digests(swapped), resuming=True)
    msg = str(info.value)
    assert msg.startswith("data/d.jsonl changed since the completions in") and "2 of the 5 rows" in msg
    assert "rows 1, 3" in msg
    assert json.loads(fp.read_text())["row_sha256"] == row_digests(rows)  # a refused resume changes nothing
    check_dataset(fp, "d.jsonl", row_digests(swapped), resuming=False)  # no completions yet: a fresh start
    assert json.loads(fp.read_text())["row_sha256"] == row_digests(swapped)


def test_check_resumable_names_changed_keys(tmp_path: Path) -> None:
    saved = tmp_path / "config.yaml"
    saved.write_text("eval:\n  num_prompts: 4\n  ks: [1, 2]\npolicy:\n  generation:\n    temperature: 1.0\n")
    check_resumable(
        saved, {"eval": {"num_prompts": 8, "ks": [1, 2]}, "policy": {"generation": {"temperature": 1.0}}}
    )
    with pytest.raises(ConfigError) as info:
        check_resumable(
            saved, {"eval": {"num_prompts": 4, "ks": [1, 4]}, "policy": {"generation": {"temperature": 0.5}}}
        )
    msg = str(info.value)
    assert "eval.ks: [1, 2] -> [1, 4]" in msg and "policy.generation.temperature: 1.0 -> 0.5" in msg
    assert "num_prompts" not in msg


def summary() -> EvalSummary:
    return EvalSummary.from_json(summary_json())


def summary_json() -> dict:
    prompts = [
        PromptSamples("alpha", (1.0, 0.0, 1.0, 1.0), ("3", "4", "3", "3")),
        PromptSamples("alpha", (0.0, 0.0, 0.0, 1.0), ("1", "2", None, "5")),
        PromptSamples("beta", (0.0, 1.0), ("7", "8")),
    ]
    return {
        "rollout_mode": "single_turn",
        "model": "tiny",
        "dataset_path": "d.jsonl",
        "num_prompts": 3,
        "num_completions": 10,
        "ks": [1, 2, 4],
        "reward_threshold": 1.0,
        "agents": ["alpha", "beta"],
        "stop_reasons": {"natural": 9, "truncated": 1},
        "status": "ok",
        "num_errors": 0,
        "error_rate": 0.0,
        "max_error_rate": 0.0,
        "error_samples": [],
        "truncation_rate": 0.1,
        "mean_turns": 1.0,
        "metrics": aggregate_eval_metrics(prompts, [1, 2, 4]),
    }


def test_metric_table_has_a_column_per_agent_and_skips_missing_ks() -> None:
    table = format_metric_table(summary())
    header, _, *rows = table.splitlines()
    assert header.split() == ["metric", "all", "alpha", "beta"]
    pass4 = next(r for r in rows if r.startswith("pass@4"))
    assert pass4.rstrip().endswith("-")  # beta has 2 samples: no pass@4
    mean_row = next(r for r in rows if r.startswith("mean_reward")).split()
    assert mean_row == ["mean_reward", "0.500", "±", "0.144", "0.500", "±", "0.250", "0.500", "±", "0.000"]
    assert "stop reasons: natural: 9, truncated: 1" in table


def test_table_and_markdown_show_errors_left() -> None:
    errored_json = summary_json()
    prompts = [
        PromptSamples("alpha", (1.0, 0.0, 1.0), ("3", "4", "3"), num_errors=1),
        PromptSamples("beta", (0.0, 1.0), ("7", "8")),
    ]
    errored_json.update(
        status="errors_left",
        num_errors=1,
        error_rate=1 / 6,
        num_completions=6,
        stop_reasons={"error": 1, "natural": 5},
        error_samples=[
            {"prompt_idx": 0, "sample_idx": 3, "agent": "alpha", "error": "GymError: server died"}
        ],
        metrics=aggregate_eval_metrics(prompts, [1, 2, 4]),
    )
    errored = EvalSummary.from_json(errored_json)
    table = format_metric_table(errored)
    errors_row = next(r for r in table.splitlines() if r.startswith("errors (not scored)")).split()
    assert errors_row[-3:] == ["1", "1", "0"]  # all, alpha, beta
    assert "1 error sample(s) left (16.7% of 6; more than eval.max_error_rate=0 allows" in table
    assert "prompt 0 sample 3 (alpha): GymError: server died" in table
    md = markdown_report(errored, "pass_at_k.png")
    assert "- status: `errors_left`" in md and "| errors (not scored) | 1 | 1 | 0 |" in md
    assert "- prompt 0 sample 3 (alpha): GymError: server died" in md
    assert "error sample" not in format_metric_table(summary()) and "status: `ok`" in markdown_report(
        summary(), "p"
    )


def test_markdown_and_png(tmp_path: Path) -> None:
    md = markdown_report(summary(), "pass_at_k.png")
    assert "| metric | all | alpha | beta |" in md and "![pass@k against k](pass_at_k.png)" in md
    plot_pass_at_k(summary(), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_a_png_without_any_pass_at_k_draws_no_legend(tmp_path: Path) -> None:
    empty = summary_json()
    empty.update(metrics=aggregate_eval_metrics([PromptSamples("alpha", (), (), num_errors=2)], [1, 2, 4]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend" fails this
        plot_pass_at_k(EvalSummary.from_json(empty), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_shipped_gym_rows_become_datums() -> None:
    from nemo_rl_ext.data.datasets import gym_datums, load_jsonl

    path = Path(__file__).resolve().parents[3] / "examples" / "data" / "gym_arithmetic.jsonl"
    rows = load_jsonl(path, required=("responses_create_params", "agent_ref"))
    datums = gym_datums(rows)
    assert len(datums) == 16 and {d.agent for d in datums} == {"agent_alpha", "agent_beta"}
    first = datums[0]
    assert first.idx == 0 and first.message_log == () and first.task_name == "nemo_gym"
    assert first.extra_env_info == rows[0] and first.extra_env_info["expected_answer"] == "31"
    assert [m["role"] for m in first.extra_env_info["responses_create_params"]["input"]] == [
        "developer",
        "user",
    ]
    with pytest.raises(
        ValueError, match=r"2 Gym row\(s\) lack responses_create_params or agent_ref.name: rows \[0, 1\]"
    ):
        gym_datums([{"agent_ref": {}}, {"agent_ref": "x"}, rows[0]])
