"""The eval driver end to end on the tiny model: single_turn, multi_turn, the CLI, resume after interruption."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from script_main import script_main

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.environments.interfaces import Observation
from nemo_rl_ext.environments.registry import register_environment
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.evals.profile import untimed_bytes, without_timings
from nemo_rl_ext.testing import RolloutStep, ScriptedEnvironment

REPO = Path(__file__).resolve().parents[2]
ARITHMETIC = REPO / "examples" / "data" / "arithmetic.jsonl"

# ---- test environments -----------------------------------------------------------------------------


def parity_answer(text: str) -> str:
    """The test environments' 'answer': the length of the reply mod 3 (varied for a random model)."""
    return str(len(text) % 3)


def _parity_reward(step: RolloutStep) -> float:
    return 1.0 if parity_answer(step.reply) == "0" else 0.0


@register_environment("eval_test_parity")
class ParityEnv(ScriptedEnvironment):
    """Single step: answer = len(reply) % 3, reward 1 when the answer is "0"."""

    def __init__(self) -> None:
        super().__init__(turns=1, observation=Observation("environment", ""), reward=_parity_reward,
                         answer=lambda s: parity_answer(s.reply))


def _two_step_answer(step: RolloutStep) -> str | None:
    return parity_answer(step.reply) if step.turn >= 2 else None


@register_environment("eval_test_two_step")
class TwoStepEnv(ScriptedEnvironment):
    """Answers the first reply with a tool message; scores the second like ParityEnv and terminates."""

    def __init__(self) -> None:
        super().__init__(turns=2, observation=Observation("tool", "result: 42"), answer=_two_step_answer,
                         reward=lambda s: 1.0 if _two_step_answer(s) == "0" else 0.0)


# ---- helpers ----------------------------------------------------------------------------------------


def make_cfg(
    tiny_model_dir: Path, save_path: Path, policy: Mapping[str, Any] | None = None,
    rollouts: Mapping[str, Any] | None = None, **ev: Any
) -> EvalConfig:
    data = {
        "eval": {
            "dataset_path": str(ARITHMETIC),
            "save_path": str(save_path),
            "num_prompts": 6,
            "ks": [1, 2, 4],
            **ev,
        },
        "rollouts": {
            "mode": "native",
            "max_rollout_turns": 1,
            "num_generations_per_prompt": 4,
            "max_seq_len": 256,
            "env": {"name": "eval_test_parity"},
            **(rollouts or {}),
        },
        "policy": {
            "model_name": str(tiny_model_dir),
            "max_model_len": 512,
            "generation": {"max_new_tokens": 8, "temperature": 1.0, "seed": 0, **(policy or {})},
        },
    }
    return EvalConfig.model_validate(data)


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def sorted_lines(path: Path) -> list[dict[str, Any]]:
    return sorted(read_lines(path), key=lambda x: (x["prompt_idx"], x["sample_idx"]))


def untimed(path: Path) -> bytes:
    """summary.json's bytes without the profile's timings."""
    return untimed_bytes(path.read_bytes(), indent=True)


SUMMARY_KEYS = {
    "rollout_mode",
    "model",
    "dataset_path",
    "num_prompts",
    "num_completions",
    "ks",
    "reward_threshold",
    "agents",
    "stop_reasons",
    "status",
    "num_errors",
    "error_rate",
    "max_error_rate",
    "error_samples",
    "truncation_rate",
    "mean_turns",
    "metrics",
    "num_data_errors",
    "data_error_rows",
    "num_prompts_too_long",
    "longest_prompt_too_long",
    "profile",
}
LINE_KEYS = {
    "prompt_idx",
    "sample_idx",
    "agent",
    "reward",
    "answer",
    "stop_reason",
    "truncated",
    "num_turns",
    "error",
    "metadata",
    "env_extras",
    "message_log",
}


def metrics_by_hand(lines: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, float]:
    """The summary's metrics recomputed from completions.jsonl without the code under test.

    Per prompt (n samples, c with reward >= 1): pass@k = 1 - C(n-c, k) / C(n, k); maj@k = the mean, over
    every k-subset (enumerated), of the credit of the most frequent answer (an answer's credit: the
    fraction of its samples that are correct; a tie of t answers gives each 1/t; no answer at all: 0);
    mean@k = mean reward; majority@k (NeMo-Skills') = the first k samples' most frequent (answer, correct) pairs,
    their mean correctness (no answer casts no vote; none at all: 0); cons@k (NeMo-RL's) = the mean, over every
    k-subset, of the correctness of the first sample of the group that gave the subset's
    `Counter(...).most_common(1)` answer (None votes too). Then means over the prompts with n >= k, overall and per agent, with
    stderr = sample std / sqrt(number of prompts) (0 for one prompt). Error lines are not samples: they
    only count in num_errors, and a prompt they leave with fewer than k samples counts in num_prompts_short@k.
    """
    prompts: dict[int, list[Mapping[str, Any]]] = {}
    for x in lines:
        prompts.setdefault(x["prompt_idx"], []).append(x)
    per_prompt = []
    for all_samples in prompts.values():
        samples = sorted((x for x in all_samples if x["stop_reason"] != "error"), key=lambda x: x["sample_idx"])
        errors = len(all_samples) - len(samples)
        rewards = [x["reward"] for x in samples]
        answers = [None if x["stop_reason"] == "error" or x["answer"] is None else str(x["answer"]) for x in samples]
        correct = [r >= 1.0 for r in rewards]
        n, c = len(samples), sum(correct)
        credit = {a: statistics.mean(ok for b, ok in zip(answers, correct, strict=True) if b == a) for a in set(answers)}
        values = {"mean_reward": statistics.mean(rewards), "errors": errors}
        for k in ks:
            if k > n:
                if k <= n + errors:
                    values[f"short@{k}"] = 1
                continue
            scores = []
            for subset in itertools.combinations(range(n), k):
                votes = Counter(answers[i] for i in subset if answers[i] is not None)
                top = max(votes.values(), default=0)
                modes = [a for a, v in votes.items() if v == top]
                scores.append(sum(credit[a] for a in modes) / len(modes) if modes else 0.0)
            values[f"pass@{k}"] = 1 - math.comb(n - c, k) / math.comb(n, k)
            values[f"maj@{k}"] = statistics.mean(scores)
            values[f"mean@{k}"] = statistics.mean(rewards)
            first_k = Counter((a, ok) for a, ok in zip(answers[:k], correct[:k], strict=True) if a is not None)
            top_k = max(first_k.values(), default=0)
            tied = [ok for (_, ok), v in first_k.items() if v == top_k]
            values[f"majority@{k}"] = statistics.mean(tied) if tied else 0.0
            values[f"cons@{k}"] = statistics.mean(
                correct[answers.index(Counter(answers[i] for i in subset).most_common(1)[0][0])]
                for subset in itertools.combinations(range(n), k)
            )
        per_prompt.append((all_samples[0]["agent"], n, values))

    def aggregate(rows: list[tuple[str, int, dict[str, float]]], prefix: str) -> dict[str, float]:
        def mean_and_stderr(xs: list[float]) -> tuple[float, float]:
            return statistics.mean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)

        out = {f"{prefix}num_prompts": len(rows), f"{prefix}num_samples": sum(n for _, n, _ in rows)}
        out[f"{prefix}num_errors"] = sum(v["errors"] for _, _, v in rows)
        out[f"{prefix}mean_reward"], out[f"{prefix}mean_reward/stderr"] = mean_and_stderr(
            [v["mean_reward"] for _, _, v in rows]
        )
        for k in ks:
            eligible = [v for _, n, v in rows if n >= k]
            out[f"{prefix}num_prompts@{k}"] = len(eligible)
            out[f"{prefix}num_prompts_short@{k}"] = sum(f"short@{k}" in v for _, _, v in rows)
            for name in ("pass", "maj", "mean", "majority", "cons") if eligible else ():
                key = f"{name}@{k}"
                out[f"{prefix}{key}"], out[f"{prefix}{key}/stderr"] = mean_and_stderr([v[key] for v in eligible])
        return out

    expected = aggregate(per_prompt, "")
    for agent in {a for a, _, _ in per_prompt}:
        expected.update(aggregate([row for row in per_prompt if row[0] == agent], f"agent/{agent}/"))
    return expected


def check_outputs(result, num_prompts: int, num_samples: int) -> list[dict[str, Any]]:
    paths = result.paths
    for p in (
        paths.config,
        paths.completions,
        paths.summary,
        paths.runs,
        paths.plot,
        paths.report,
        paths.dataset,
    ):
        assert p.exists(), p
    assert paths.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| metric |" in paths.report.read_text() and "pass_at_k.png" in paths.report.read_text()
    summary = json.loads(paths.summary.read_text())
    assert summary == result.summary and set(summary) == SUMMARY_KEYS
    assert summary["num_prompts"] == num_prompts and summary["num_completions"] == num_samples
    assert summary["status"] == "ok" and summary["num_errors"] == 0 and summary["error_samples"] == []
    lines = read_lines(paths.completions)
    assert len(lines) == num_samples and all(set(x) == LINE_KEYS for x in lines)
    assert len({(x["prompt_idx"], x["sample_idx"]) for x in lines}) == num_samples
    return lines


# ---- end to end -------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_single_turn_math_end_to_end(tiny_model_dir, generation, tmp_path) -> None:
    cfg = make_cfg(tiny_model_dir, tmp_path / "math", rollouts={"env": {"name": "math"}}, num_prompts=4)
    result = run_eval(cfg, generation=generation, progress=False)
    assert result.complete and result.groups_generated == 4 and result.skipped_completions == 0
    lines = check_outputs(result, 4, 16)
    for x in lines:
        assert x["agent"] == "math" and x["num_turns"] == 1
        assert [m["role"] for m in x["message_log"]] == ["user", "assistant"]
        assert all(m["num_tokens"] > 0 and "token_ids" not in m for m in x["message_log"])
        assert x["env_extras"]["env_metadata"]["ground_truth"]
    metrics = result.summary["metrics"]
    assert metrics == pytest.approx(metrics_by_hand(lines, [1, 2, 4]), abs=1e-12)
    assert metrics["num_samples"] == 16 and "agent/math/pass@4" in metrics


@pytest.mark.timeout(60)
def test_single_turn_metrics_come_from_the_completions(tiny_model_dir, generation, tmp_path) -> None:
    result = run_eval(make_cfg(tiny_model_dir, tmp_path / "parity"), generation=generation, progress=False)
    lines = check_outputs(result, 6, 24)
    for x in lines:
        reply = x["message_log"][-1]["content"]
        assert x["answer"] == parity_answer(reply) and x["reward"] == (1.0 if x["answer"] == "0" else 0.0)
    rewards = [x["reward"] for x in lines]
    assert 0 < sum(rewards) < len(rewards), "want a mix of rewards for a meaningful check"
    assert result.summary["metrics"] == pytest.approx(metrics_by_hand(lines, [1, 2, 4]), abs=1e-12)
    assert result.summary["metrics"]["pass@4"] >= result.summary["metrics"]["pass@1"]


@pytest.mark.timeout(60)
def test_multi_turn_end_to_end_with_per_agent_counts(tiny_model_dir, generation, tmp_path) -> None:
    data = tmp_path / "agents.jsonl"
    rows = [json.loads(line) for line in ARITHMETIC.read_text().splitlines()[:6]]
    data.write_text(
        "".join(
            json.dumps({**r, "agent_name": "alpha" if i % 2 else "beta"}) + "\n" for i, r in enumerate(rows)
        )
    )
    cfg = make_cfg(
        tiny_model_dir,
        tmp_path / "multi",
        rollouts={"max_rollout_turns": 3, "env": {"name": "eval_test_two_step"},
                  "num_generations_per_prompt": {"alpha": 2, "_default": 3}},
        dataset_path=str(data),
        ks=None,
        save_token_ids=True,
    )
    result = run_eval(cfg, generation=generation, progress=False)
    lines = check_outputs(result, 6, 3 * 2 + 3 * 3)
    for x in lines:
        assert x["num_turns"] == 2 and x["stop_reason"] in ("natural", "truncated")  # max_new_tokens=8
        assert [m["role"] for m in x["message_log"]] == ["user", "assistant", "tool", "assistant"]
        assert all(len(m["token_ids"]) == m["num_tokens"] for m in x["message_log"])
        assert x["sample_idx"] < (2 if x["agent"] == "alpha" else 3)
    summary = result.summary
    assert summary["agents"] == ["alpha", "beta"] and summary["ks"] == [1, 2, 3]
    metrics = summary["metrics"]
    assert metrics["agent/alpha/num_samples"] == 6 and metrics["agent/beta/num_samples"] == 9
    assert metrics["agent/alpha/num_prompts@3"] == 0 and "agent/alpha/pass@3" not in metrics
    assert metrics["num_prompts@3"] == 3 and "pass@3" in metrics and "agent/beta/maj@3" in metrics


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "run_eval.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )


@pytest.mark.timeout(100)
def test_cli_multi_turn_tool_calculator(tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "cli"
    proc = run_cli(
        "--config",
        "examples/configs/evals/tool_eval.yaml",
        f"policy.model_name={tiny_model_dir}",
        f"eval.save_path={out}",
        "eval.num_prompts=3",
        "policy.generation.max_new_tokens=8",
        "policy.max_model_len=1024",
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pass@4" in proc.stdout and "maj@2" in proc.stdout and "tool_calculator" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rollout_mode"] == "multi_turn" and summary["num_completions"] == 12
    first = read_lines(out / "completions.jsonl")[0]
    assert first["message_log"][0]["role"] == "system" and "calculator" in first["message_log"][0]["content"]
    for name in ("config.yaml", "report.md", "pass_at_k.png", "runs.jsonl"):
        assert (out / name).exists()


@pytest.mark.timeout(30)
def test_cli_reports_every_config_problem(tmp_path, capsys) -> None:
    # the script's main in-process (script_main: a user error's message is the property; a run_eval.py process
    # spends seconds on imports first); test_cli_multi_turn_tool_calculator runs the script as a process
    proc = script_main(  # the eval config in NeMo-RL's spelling (eval.rollout_mode: single_turn)
        capsys,
        "run_eval.py",
        "--config",
        "tests/unit/older_spelling/eval.yaml",
        "eval.max_rollout_turns=4",
        "policy.generation.temperature=0",
        f"eval.save_path={tmp_path}",
    )
    assert proc.returncode == 2
    assert "2 problem(s)" in proc.stderr and "max_rollout_turns=4 would be ignored" in proc.stderr
    assert "temperature=0.0 is greedy decoding" in proc.stderr


# ---- resume -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clean_run(tiny_model_dir, generation, tmp_path_factory):
    """An uninterrupted run of 6 prompts x 4 samples, all prompts at once."""
    cfg = make_cfg(tiny_model_dir, tmp_path_factory.mktemp("clean") / "out")
    return run_eval(cfg, generation=generation, progress=False)


@pytest.mark.timeout(60)
def test_interrupted_and_resumed_run_equals_a_clean_run(
    tiny_model_dir, generation, clean_run, tmp_path
) -> None:
    cfg = make_cfg(tiny_model_dir, tmp_path / "out", max_concurrent_prompts=2)
    first = run_eval(cfg, generation=generation, progress=False, stop_after_groups=2)
    assert not first.complete and first.summary is None and not first.paths.summary.exists()
    assert first.groups_generated == 2 and len(read_lines(first.paths.completions)) == 8
    with open(first.paths.completions, "ab") as f:  # what a kill in the middle of a write leaves
        f.write(b'{"prompt_idx": 4, "sample_idx": 0, "agent": "eval_te')

    resumed = run_eval(cfg, generation=generation, progress=False)
    assert resumed.complete and resumed.skipped_completions == 8 and resumed.completions_written == 16
    assert resumed.groups_generated == 4
    assert untimed(resumed.paths.summary) == untimed(clean_run.paths.summary)
    assert sorted_lines(resumed.paths.completions) == sorted_lines(clean_run.paths.completions)
    assert len(read_lines(resumed.paths.runs)) == 2

    again = run_eval(cfg, generation=generation, progress=False)  # nothing left to do
    assert again.groups_generated == 0 and again.completions_written == 0 and again.skipped_completions == 24
    assert without_timings(again.summary.to_json()) == without_timings(clean_run.summary.to_json())


@pytest.mark.timeout(60)
def test_partially_present_groups_get_only_their_missing_samples(
    tiny_model_dir, generation, clean_run, tmp_path
) -> None:
    cfg = make_cfg(tiny_model_dir, tmp_path / "out")
    Path(cfg.eval.save_path).mkdir(parents=True)
    kept = [
        x
        for x in read_lines(clean_run.paths.completions)
        if not (x["prompt_idx"] == 3 and x["sample_idx"] in (0, 2)) and x["prompt_idx"] != 5
    ]
    (Path(cfg.eval.save_path) / "completions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in kept))

    resumed = run_eval(cfg, generation=generation, progress=False)
    assert resumed.completions_written == 2 + 4 and resumed.groups_generated == 2
    assert sorted_lines(resumed.paths.completions) == sorted_lines(clean_run.paths.completions)
    assert without_timings(resumed.summary.to_json()) == without_timings(clean_run.summary.to_json())


@pytest.mark.timeout(60)
def test_resume_refuses_a_changed_config_but_allows_more_prompts(
    tiny_model_dir, generation, clean_run, tmp_path
) -> None:
    out = Path(clean_run.paths.root)
    with pytest.raises(ConfigError) as info:
        run_eval(
            make_cfg(tiny_model_dir, out, policy={"temperature": 0.5}), generation=generation, progress=False
        )
    assert "policy.generation.temperature: 1.0 -> 0.5" in str(info.value)

    target = tmp_path / "more"
    target.mkdir()
    for name in ("config.yaml", "completions.jsonl", "dataset_fingerprint.json"):
        (target / name).write_bytes(
            (out / name).read_bytes().replace(str(out).encode(), str(target).encode())
        )
    more = run_eval(make_cfg(tiny_model_dir, target, num_prompts=8), generation=generation, progress=False)
    assert more.groups_generated == 2 and more.skipped_completions == 24 and more.summary["num_prompts"] == 8
    assert json.loads((target / "dataset_fingerprint.json").read_text())["num_rows"] == 8


@pytest.mark.timeout(60)
def test_resume_refuses_a_dataset_whose_rows_changed(tiny_model_dir, generation, tmp_path) -> None:
    data = tmp_path / "rows.jsonl"
    rows = ARITHMETIC.read_text().splitlines(keepends=True)[:8]
    data.write_text("".join(rows))
    cfg = make_cfg(tiny_model_dir, tmp_path / "out", dataset_path=str(data), max_concurrent_prompts=2)
    first = run_eval(cfg, generation=generation, progress=False, stop_after_groups=2)
    before = first.paths.completions.read_bytes()
    assert not first.complete and before.count(b"\n") == 8

    data.write_text("".join(reversed(rows)))  # same path, same rows, another order
    with pytest.raises(ConfigError) as info:
        run_eval(cfg, generation=generation, progress=False)
    msg = str(info.value)
    assert msg.startswith(f"{data} changed since the completions in {first.paths.root} were written")
    assert (
        "6 of the 6 rows they cover differ" in msg
        and "Restore the file, or use another eval.save_path" in msg
    )
    assert first.paths.completions.read_bytes() == before and not first.paths.summary.exists()

    data.write_text("".join(rows[:6]) + "\n")  # restored (a blank line at the end changes no row): resumes
    resumed = run_eval(cfg, generation=generation, progress=False)
    assert resumed.complete and resumed.skipped_completions == 8 and resumed.summary["num_prompts"] == 6


@pytest.mark.timeout(60)
def test_cli_garbage_line_in_completions_is_one_clean_message(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    good = json.dumps(
        {
            "prompt_idx": 0,
            "sample_idx": 0,
            "agent": "math",
            "reward": 1.0,
            "answer": "31",
            "stop_reason": "natural",
            "truncated": False,
            "num_turns": 1,
        }
    )
    (out / "completions.jsonl").write_text(f"{good}\nthis is not json\n{good}\n")
    proc = script_main(  # in-process, as in test_cli_reports_every_config_problem
        capsys,
        "run_eval.py",
        "--config",
        "examples/configs/evals/eval.yaml",
        f"policy.model_name={tiny_model_dir}",
        f"eval.save_path={out}",
        "--no-progress",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {out / 'completions.jsonl'}: 1 unreadable line(s)")
    assert "\n  line 2: not JSON" in proc.stderr and "\n  line 1:" not in proc.stderr
    assert "\n  line 3:" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 2


@pytest.mark.timeout(120)
def test_killed_cli_run_resumes_to_the_summary_of_a_clean_run(tiny_model_dir, generation, tmp_path) -> None:
    import signal
    import time

    from nemo_rl_ext.config import load_config

    def args(save_path: Path, one_at_a_time: bool = False) -> list[str]:
        return [
            "--config",
            "examples/configs/evals/eval.yaml",
            f"policy.model_name={tiny_model_dir}",
            f"eval.save_path={save_path}",
            "eval.num_prompts=24",
            "policy.generation.max_new_tokens=8",
            *(["eval.max_concurrent_prompts=1"] if one_at_a_time else []),
        ]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / "run_eval.py"), *args(killed, True), "--no-progress"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    completions = killed / "completions.jsonl"
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if completions.exists() and completions.read_bytes().count(b"\n") >= 8:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    on_disk = completions.read_bytes().count(b"\n")
    assert 8 <= on_disk < 96 and not (killed / "summary.json").exists()

    def cfg(save_path: Path) -> EvalConfig:
        return load_config(REPO / "examples/configs/evals/eval.yaml", args(save_path)[2:], EvalConfig)

    resumed = run_eval(cfg(killed), generation=generation, progress=False)  # all remaining prompts at once
    assert resumed.complete and resumed.skipped_completions == on_disk
    assert resumed.completions_written == 96 - on_disk
    clean = run_eval(cfg(tmp_path / "clean"), generation=generation, progress=False)
    assert untimed(killed / "summary.json") == untimed(clean.paths.summary)
    assert sorted_lines(completions) == sorted_lines(clean.paths.completions)
