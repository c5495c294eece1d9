"""The per-task reward profile (summary.json `profile`, report section, reward_profile.png) and difficulty.jsonl.

The expected numbers are computed here from the hand-built lines (numpy percentiles, combinatorics and brute
force over k-subsets), not with the code under test; the latencies come from a hand-written timings.jsonl
(stale, null, missing and torn entries included). Then an eval runs end to end (native with a scripted policy,
nemo_gym against the fake agents) and writes the profile, the PNG and the difficulty file with the latency each
rollout recorded in timings.jsonl, while completions.jsonl stays free of timings: two runs write the same bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from test_eval_records import BEFORE, record

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.environments.interfaces import Observation
from nemo_rl_ext.environments.registry import register_environment
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval_async
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.profile import DIFFICULTY_BINS, untimed_bytes, without_timings
from nemo_rl_ext.evals.report import markdown_report, write_report
from nemo_rl_ext.evals.store import CompletionStore, EvalPaths, dumps
from nemo_rl_ext.evals.summary import EvalSummary, summarize
from nemo_rl_ext.evals.timings import TIMINGS_FILE, append_timings, read_timings
from nemo_rl_ext.testing import RolloutStep, ScriptedEnvironment, ScriptedGeneration, UnusedPolicy

REPO = Path(__file__).resolve().parents[3]
THRESHOLD = 0.5
KS = (1, 2, 3, 4)
PNG = b"\x89PNG\r\n\x1a\n"

# ---- hand-built lines: two agents, known rewards, tokens, latencies, turns, errors, truncations ------------

# (prompt, agent) -> samples; a sample is (reward, answer, turns, assistant token counts, truncated, latency)
# or "error"; latency None is a sample without a timing (see write_timings for the ways it can lack one)
SAMPLES: dict[tuple[int, str], list[Any]] = {
    (0, "alpha"): [(1.0, "4", 1, [5], False, 0.5), (0.0, "5", 1, [7], False, 1.5),
                   (0.6, "4", 2, [3, 4], True, 2.0), "error"],
    (1, "beta"): [(0.2, "a", 1, [10], False, 0.1), (0.8, "b", 3, [2, 2, 2], False, None),
                  (0.4, None, 1, [12], True, 0.3)],
    (2, "alpha"): [(0.0, "x", 1, [8], True, 4.0), (0.0, "y", 1, [6], False, 3.0),
                   (0.0, "x", 1, [9], False, 1.0), (0.0, None, 2, [4, 1], False, None)],
    (3, "beta"): ["error", "error", "error"],
    (4, "alpha"): [(1.0, "7", 1, [20], False, 0.25), (0.5, "7", 1, [30], False, 0.75),
                   (1.0, "7", 1, [40], False, None), "error"],
}


def line_json(prompt: int, agent: str, sample: int, spec: Any) -> dict[str, Any]:
    base = {"prompt_idx": prompt, "sample_idx": sample, "agent": agent}
    user = {"role": "user", "content": "q", "num_tokens": 11}
    if spec == "error":
        return {**base, "reward": 0.0, "answer": None, "stop_reason": "error", "truncated": False, "num_turns": 0,
                "error": "TimeoutError: late", "metadata": {}, "env_extras": {}, "message_log": [user]}
    reward, answer, turns, gen, truncated, _ = spec
    log = [user]
    for i, n in enumerate(gen):  # a tool message between turns: not generated, not counted
        log += [{"role": "tool", "content": "t", "num_tokens": 50}] if i else []
        log += [{"role": "assistant", "content": "a", "num_tokens": n}]
    out = {**base, "reward": reward, "answer": answer, "stop_reason": "truncated" if truncated else "natural",
           "truncated": truncated, "num_turns": turns, "error": None, "metadata": {}, "env_extras": {},
           "message_log": log}
    return out


def write_timings(folder: Path) -> None:
    """timings.jsonl for SAMPLES: an error's entry (9 s: errors are not profiled), a stale entry that a later one
    replaces, latency None as a null entry, as a stale value replaced by null, and as no entry at all; then a
    torn last line (a killed run)."""
    entries = [{"prompt_idx": 0, "sample_idx": 0, "latency_s": 7.0}]  # replaced below (the latest wins)
    for (p, _), xs in SAMPLES.items():
        for s, x in enumerate(xs):
            latency = 9.0 if x == "error" else x[5]
            if (p, s) == (4, 2):
                entries += [{"prompt_idx": p, "sample_idx": s, "latency_s": 5.0}]  # then null: left out
            if latency is not None or (p, s) != (2, 3):  # (2, 3): no entry at all
                entries.append({"prompt_idx": p, "sample_idx": s, "latency_s": latency})
    data = b"".join(orjson.dumps(e) + b"\n" for e in entries)
    (folder / TIMINGS_FILE).write_bytes(data + b'{"prompt_idx":0,"sample_idx":1,"laten')


def write_lines(path: Path) -> None:
    rows = [line_json(p, a, s, x) for (p, a), xs in SAMPLES.items() for s, x in enumerate(xs)]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    write_timings(path.parent)


def cfg_for(save: Path, dataset: Path | None = None, num_generations_per_prompt: Any = 4,
            **ev: Any) -> EvalConfig:
    return EvalConfig.model_validate({
        "eval": {"dataset_path": str(dataset or REPO / "examples/data/arithmetic.jsonl"),
                 "save_path": str(save), "ks": list(KS),
                 "reward_threshold": THRESHOLD, "max_error_rate": 1.0, **ev},
        "rollouts": {"mode": "native", "max_rollout_turns": 1, "env": {"name": "profile_test_env"},
                     "num_generations_per_prompt": num_generations_per_prompt},
        "policy": {"model_name": "unused", "generation": {"max_new_tokens": 8, "temperature": 1.0, "seed": 0}},
    })


def summarize_file(tmp_path: Path) -> tuple[EvalSummary, CompletionStore]:
    write_lines(tmp_path / "completions.jsonl")
    store = CompletionStore(tmp_path / "completions.jsonl")
    datums = [DatumSpec(p, (), a) for p, a in SAMPLES]
    expected = {p: len(xs) for (p, _), xs in SAMPLES.items()}
    return summarize(cfg_for(tmp_path), datums, expected, store), store


# ---- the expected values, by hand ---------------------------------------------------------------------------


def brute_maj(answers: list[str | None], correct: list[bool], k: int) -> float:
    """maj@k by enumerating every k-subset: ties share the credit; credit = fraction of that answer correct."""
    credit = {a: sum(c for b, c in zip(answers, correct, strict=True) if b == a) / answers.count(a) for a in set(answers)}
    scores = []
    for subset in itertools.combinations(range(len(answers)), k):
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        if not votes:
            scores.append(0.0)
            continue
        top = max(votes.values())
        modes = [a for a, v in votes.items() if v == top]
        scores.append(sum(credit[a] for a in modes) / len(modes))
    return float(np.mean(scores))


def expected_profile(agent: str | None) -> dict[str, Any]:
    groups = [xs for (_, a), xs in SAMPLES.items() if agent is None or a == agent]
    samples = [x for xs in groups for x in xs]
    scored = [x for x in samples if x != "error"]
    latencies = [x[5] for x in scored if x[5] is not None]
    tokens = [sum(x[3]) for x in scored]
    out: dict[str, Any] = {
        "num_prompts": len(groups), "num_samples": len(samples), "num_errors": len(samples) - len(scored),
        "error_rate": (len(samples) - len(scored)) / len(samples),
        "truncation_rate": sum(x[4] for x in scored) / len(scored), "mean_turns": float(np.mean([x[2] for x in scored])),
        "tokens": (len(tokens), np.mean(tokens), np.percentile(tokens, 50), np.percentile(tokens, 95)),
        "latency": (len(latencies), np.mean(latencies), np.percentile(latencies, 50), np.percentile(latencies, 95)),
    }
    per_prompt = [[x for x in xs if x != "error"] for xs in groups]
    per_prompt = [p for p in per_prompt if p]
    out["mean_reward"] = float(np.mean([np.mean([x[0] for x in p]) for p in per_prompt]))
    out["pass"], out["maj"] = {}, {}
    for k in KS:
        eligible = [p for p in per_prompt if len(p) >= k]
        if not eligible:
            continue
        out["pass"][k] = float(np.mean([
            1 - math.comb(len(p) - c, k) / math.comb(len(p), k)
            for p in eligible for c in [sum(x[0] >= THRESHOLD for x in p)]
        ]))
        out["maj"][k] = float(np.mean([brute_maj([x[1] for x in p], [x[0] >= THRESHOLD for x in p], k)
                                       for p in eligible]))
    hist = dict.fromkeys(DIFFICULTY_BINS, 0)
    for p in per_prompt:
        f = sum(x[0] >= THRESHOLD for x in p) / len(p)
        label = "0" if f == 0 else "1" if f == 1 else next(
            b for b, lo, hi in zip(DIFFICULTY_BINS[1:-1], (0, .2, .4, .6, .8), (.2, .4, .6, .8, 1), strict=True)
            if lo <= f < hi)
        hist[label] += 1
    out["difficulty"], out["unscored"] = hist, len(groups) - len(per_prompt)
    return out


def check_task(got: Any, want: dict[str, Any]) -> None:
    approx = pytest.approx
    assert (got.num_prompts, got.num_samples, got.num_errors) == (want["num_prompts"], want["num_samples"],
                                                                   want["num_errors"])
    assert got.error_rate == approx(want["error_rate"]) and got.truncation_rate == approx(want["truncation_rate"])
    assert got.mean_turns == approx(want["mean_turns"]) and got.mean_reward == approx(want["mean_reward"])
    assert dict(got.pass_at_k) == approx(want["pass"]) and dict(got.maj_at_k) == approx(want["maj"])
    t, lat = got.generated_tokens, got.latency_s
    assert (t.num_samples, t.mean, t.p50, t.p95) == approx(want["tokens"])
    assert (lat.num_samples, lat.mean, lat.p50, lat.p95) == approx(want["latency"])
    assert dict(got.difficulty) == want["difficulty"] and got.num_prompts_unscored == want["unscored"]


# ---- tests ---------------------------------------------------------------------------------------------------


def test_the_profile_matches_values_computed_by_hand(tmp_path: Path) -> None:
    summary, _ = summarize_file(tmp_path)
    profile = summary.profile
    assert profile is not None and list(profile.tasks) == ["alpha", "beta"]
    check_task(profile.overall, expected_profile(None))
    check_task(profile.tasks["alpha"], expected_profile("alpha"))
    check_task(profile.tasks["beta"], expected_profile("beta"))
    # spot checks of the hand computation itself (the numbers the table above was designed to give)
    alpha = profile.tasks["alpha"]
    assert alpha.latency_s.num_samples == 8 and alpha.latency_s.p50 == pytest.approx(1.25)  # median of 8 values
    assert alpha.generated_tokens.mean == pytest.approx((5 + 7 + 7 + 8 + 6 + 9 + 5 + 20 + 30 + 40) / 10)
    assert alpha.error_rate == pytest.approx(2 / 12) and profile.tasks["beta"].num_prompts_unscored == 1
    assert dict(alpha.difficulty) == {"0": 1, "(0, 0.2)": 0, "[0.2, 0.4)": 0, "[0.4, 0.6)": 0, "[0.6, 0.8)": 1,
                                      "[0.8, 1)": 0, "1": 1}
    # the profile's @k values are the summary table's
    assert alpha.pass_at_k[2] == summary.metrics["agent/alpha/pass@2"]
    assert 4 in alpha.maj_at_k and 4 not in profile.tasks["beta"].maj_at_k  # no beta prompt has 4 answers


def test_summary_json_appends_the_profile_and_reads_back(tmp_path: Path) -> None:
    summary, _ = summarize_file(tmp_path)
    obj = summary.to_json()
    assert list(obj)[-6:] == ["metrics", "num_data_errors", "data_error_rows", "num_prompts_too_long",
                              "longest_prompt_too_long", "profile"]  # older consumers read the rest as before
    assert list(obj["profile"]) == ["overall", "tasks"] and list(obj["profile"]["tasks"]) == ["alpha", "beta"]
    alpha = summary.profile.tasks["alpha"]
    assert obj["profile"]["tasks"]["alpha"]["pass_at_k"] == {str(k): alpha.pass_at_k[k] for k in KS}
    text = dumps(obj, indent=True)
    back = EvalSummary.from_json(json.loads(text))
    assert back == summary and dumps(back.to_json(), indent=True) == text
    assert back.profile.tasks["beta"].latency_s.p95 == summary.profile.tasks["beta"].latency_s.p95
    assert back.profile.prompts is None  # the per-prompt rows live in difficulty.jsonl only
    # an older summary.json (no profile) still reads
    older = {k: v for k, v in obj.items() if k != "profile"}
    assert EvalSummary.from_json(older).profile is None and "profile" not in EvalSummary.from_json(older).to_json()
    # the timings are the only keys that differ between otherwise identical runs
    stripped = without_timings(obj)
    assert "latency_s" not in stripped["profile"]["overall"] and "generated_tokens" in stripped["profile"]["overall"]


def test_report_png_and_difficulty_file(tmp_path: Path) -> None:
    summary, _ = summarize_file(tmp_path)
    write_report(summary, EvalPaths(tmp_path))
    assert (tmp_path / "reward_profile.png").read_bytes()[:8] == PNG
    report = (tmp_path / "report.md").read_text()
    assert "## Reward profile" in report and "![reward profile per task](reward_profile.png)" in report
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in report.splitlines()
            if r.startswith("| ")}
    want = {name: expected_profile(a) for name, a in (("all", None), ("alpha", "alpha"), ("beta", "beta"))}
    assert rows["rollout latency s (p50 / p95)"] == [f"{w['latency'][2]:.3f} / {w['latency'][3]:.3f}"
                                                     for w in want.values()]
    assert rows["samples with latency"] == [str(w["latency"][0]) for w in want.values()]
    assert rows["error rate"] == [f"{w['error_rate']:.3f}" for w in want.values()]
    assert rows["solved 1"] == [str(w["difficulty"]["1"]) for w in want.values()]
    assert rows["every sample an error"] == ["1", "0", "1"]
    # difficulty.jsonl: one line per prompt, in prompt order, the documented keys
    lines = [json.loads(x) for x in (tmp_path / "difficulty.jsonl").read_text().splitlines()]
    assert lines == [
        {"prompt_idx": 0, "agent": "alpha", "num_samples": 3, "num_solved": 2, "solved_fraction": 2 / 3,
         "num_errors": 1},
        {"prompt_idx": 1, "agent": "beta", "num_samples": 3, "num_solved": 1, "solved_fraction": 1 / 3,
         "num_errors": 0},
        {"prompt_idx": 2, "agent": "alpha", "num_samples": 4, "num_solved": 0, "solved_fraction": 0.0,
         "num_errors": 0},
        {"prompt_idx": 3, "agent": "beta", "num_samples": 0, "num_solved": 0, "solved_fraction": None,
         "num_errors": 3},
        {"prompt_idx": 4, "agent": "alpha", "num_samples": 3, "num_solved": 3, "solved_fraction": 1.0,
         "num_errors": 1},
    ]
    # a summary read back from summary.json (no per-prompt rows) reports without touching the file
    before = (tmp_path / "difficulty.jsonl").read_bytes()
    write_report(EvalSummary.from_json(json.loads(dumps(summary.to_json()))), EvalPaths(tmp_path))
    assert (tmp_path / "difficulty.jsonl").read_bytes() == before


def test_a_folder_without_timings_summarizes_without_latency(tmp_path: Path) -> None:
    write_lines(tmp_path / "completions.jsonl")
    (tmp_path / TIMINGS_FILE).unlink()  # written before timings were recorded
    store = CompletionStore(tmp_path / "completions.jsonl")
    datums = [DatumSpec(p, (), a) for p, a in SAMPLES]
    summary = summarize(cfg_for(tmp_path), datums, {p: len(xs) for (p, _), xs in SAMPLES.items()}, store)
    lat = summary.profile.overall.latency_s
    assert (lat.num_samples, lat.mean, lat.p50, lat.p95) == (0, None, None, None)
    check_task(summary.profile.tasks["alpha"], {**expected_profile("alpha"), "latency": (0, None, None, None)})
    report = markdown_report(summary, "pass_at_k.png")
    assert "| rollout latency s (p50 / p95) | - / - | - / - | - / - |" in report
    write_report(summary, EvalPaths(tmp_path))
    assert (tmp_path / "reward_profile.png").read_bytes()[:8] == PNG


def test_timings_read_latest_wins_torn_last_line_ignored_bad_lines_named(tmp_path: Path) -> None:
    write_timings(tmp_path)
    got = read_timings(tmp_path)
    assert got[(0, 0)] == 0.5 and got[(0, 3)] == 9.0  # the stale 7.0 replaced; errors have entries too
    assert (1, 1) not in got and (2, 3) not in got and (4, 2) not in got  # null, none, stale value then null
    assert (0, 1) in got and got[(0, 1)] == 1.5  # the torn line (for the same pair) is ignored
    assert read_timings(tmp_path / "nowhere") == {}
    (tmp_path / TIMINGS_FILE).write_bytes(
        b'{"prompt_idx":0,"sample_idx":0,"latency_s":1}\nnot json\n{"prompt_idx":"0","sample_idx":1,'
        b'"latency_s":"slow"}\n{"prompt_idx":0}\n[1]\n{"prompt_idx":0,"sample_idx":0,"latency_s":2}\n'
    )
    with pytest.raises(ConfigError) as err:
        read_timings(tmp_path)
    msg = str(err.value)
    assert f"{tmp_path / TIMINGS_FILE}: 4 unreadable line(s)" in msg and "line 2: not JSON" in msg
    assert "line 3: wrong type: prompt_idx='0', latency_s='slow'" in msg
    assert "line 4: missing key(s): sample_idx, latency_s" in msg and "line 5: not an object: [1]" in msg


def test_append_timings_skips_written_samples_and_cuts_a_torn_line(tmp_path: Path) -> None:
    rec = record()  # two completions of one prompt (test_eval_records)
    timed = dataclasses.replace(rec, completions=[dataclasses.replace(c, latency_s=0.25 * (i + 1))
                                                  for i, c in enumerate(rec.completions)])
    # a timed completion's line is byte for byte the line written before timings existed
    assert dumps(CompletionLine.from_completion(timed, 0, timed.completions[0], False).to_json()) == BEFORE[0]
    p = rec.prompt_idx
    assert append_timings(tmp_path, timed, skip={0}) == 1  # sample 0 already had a result: not written
    assert append_timings(tmp_path, timed, skip={0, 1}) == 0
    path = tmp_path / TIMINGS_FILE
    assert path.read_bytes() == b'{"prompt_idx":%d,"sample_idx":1,"latency_s":0.5}\n' % p
    path.write_bytes(path.read_bytes() + b'{"prompt_idx":%d,"samp' % p)  # killed mid-write
    assert append_timings(tmp_path, rec) == 2  # not measured: null entries
    assert path.read_bytes().splitlines() == [
        b'{"prompt_idx":%d,"sample_idx":1,"latency_s":0.5}' % p,
        b'{"prompt_idx":%d,"sample_idx":0,"latency_s":null}' % p,
        b'{"prompt_idx":%d,"sample_idx":1,"latency_s":null}' % p,
    ]
    assert read_timings(tmp_path) == {}  # the latest entry of each pair is null


# ---- end to end ---------------------------------------------------------------------------------------------


def _reward(step: RolloutStep) -> float:
    return 1.0 if len(step.reply) % 2 == 0 else 0.25


@register_environment("profile_test_env")
class ProfileTestEnv(ScriptedEnvironment):
    """One step; reward 1 for an even-length reply, else 0.25; each step takes 20 ms."""

    def __init__(self) -> None:
        super().__init__(turns=1, observation=Observation("environment", ""), reward=_reward,
                         answer=lambda s: str(len(s.reply) % 2), delay_s=0.02)


DELAY_S = 0.05
"""The scripted policy's delay per call: every native rollout (one turn + one step) takes at least this + 20 ms."""


LINE_KEYS = ["prompt_idx", "sample_idx", "agent", "reward", "answer", "stop_reason", "truncated", "num_turns", "error",
             "metadata", "env_extras", "message_log"]
"""A completions.jsonl line's keys, in order, exactly as before timings were measured."""


def eval_rows(tmp_path: Path) -> Path:
    data = tmp_path / "rows.jsonl"
    rows = [json.loads(x) for x in (REPO / "examples/data/arithmetic.jsonl").read_text().splitlines()[:5]]
    data.write_text("".join(json.dumps({**r, "agent_name": "odd" if i % 2 else "even"}) + "\n"
                            for i, r in enumerate(rows)))
    return data


def reply(request) -> str:  # the length varies with the prompt and the seed: a mix of rewards
    return "x" * (1 + request.config.seed % 3)


def timing_lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (out / TIMINGS_FILE).read_text().splitlines()]


async def test_native_eval_writes_the_profile_png_and_difficulty_file(tiny_model_and_tokenizer, tmp_path) -> None:
    _, tok = tiny_model_and_tokenizer
    data = eval_rows(tmp_path)
    cfg = cfg_for(tmp_path / "out", data, num_generations_per_prompt={"odd": 2, "_default": 3}, ks=[1, 2])
    result = await run_eval_async(cfg, generation=ScriptedGeneration(tok, reply, delay_s=DELAY_S), progress=False)
    assert result.complete
    out = tmp_path / "out"
    lines = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 3 + 2 * 2 and all(list(x) == LINE_KEYS for x in lines)  # no timing in a line
    timings = timing_lines(out)  # one entry per written completion, in the order of the lines
    assert [(t["prompt_idx"], t["sample_idx"]) for t in timings] == [(x["prompt_idx"], x["sample_idx"]) for x in lines]
    assert all(list(t) == ["prompt_idx", "sample_idx", "latency_s"] for t in timings)
    assert all(DELAY_S <= t["latency_s"] < 60 for t in timings)
    latency = {(t["prompt_idx"], t["sample_idx"]): t["latency_s"] for t in timings}
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary)[-1] == "profile" and summary == result.summary
    # native mode: the manager sends no rows and has no aggregate of its own, so no Gym file and no gym_metrics
    assert not (out / "gym_rows.jsonl").exists() and not (out / "gym_aggregate_metrics.json").exists()
    assert "gym_metrics" not in summary
    [run] = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert list(run) == ["groups_generated", "completions_written", "errors_written", "retried", "skipped_completions",
                         "wall_time_s", "rollout_metrics"]
    assert (run["groups_generated"], run["completions_written"], run["skipped_completions"]) == (5, 13, 0)
    for agent in ("even", "odd"):
        mine = [x for x in lines if x["agent"] == agent]
        task = summary["profile"]["tasks"][agent]
        lat = [latency[x["prompt_idx"], x["sample_idx"]] for x in mine]
        gen = [sum(m["num_tokens"] for m in x["message_log"] if m["role"] == "assistant") for x in mine]
        assert task["latency_s"] == pytest.approx({"num_samples": len(mine), "mean": np.mean(lat),
                                                   "p50": np.percentile(lat, 50), "p95": np.percentile(lat, 95)})
        assert task["generated_tokens"]["p95"] == pytest.approx(np.percentile(gen, 95))
        assert task["num_samples"] == len(mine) and task["mean_turns"] == 1.0
    assert (out / "reward_profile.png").read_bytes()[:8] == PNG
    assert "## Reward profile" in (out / "report.md").read_text()
    difficulty = [json.loads(x) for x in (out / "difficulty.jsonl").read_text().splitlines()]
    assert [d["prompt_idx"] for d in difficulty] == [0, 1, 2, 3, 4]
    for d in difficulty:
        mine = [x for x in lines if x["prompt_idx"] == d["prompt_idx"]]
        solved = sum(x["reward"] >= THRESHOLD for x in mine)
        assert d == {"prompt_idx": d["prompt_idx"], "agent": mine[0]["agent"], "num_samples": len(mine),
                     "num_solved": solved, "solved_fraction": solved / len(mine), "num_errors": 0}
    assert 0 < sum(d["num_solved"] for d in difficulty) < len(lines), "want a mix of rewards"

    # a second run (its own timings) writes the same completions bytes, and summary bytes but the latencies
    again = await run_eval_async(cfg_for(tmp_path / "again", data,
                                         num_generations_per_prompt={"odd": 2, "_default": 3}, ks=[1, 2]),
                                 generation=ScriptedGeneration(tok, reply, delay_s=DELAY_S), progress=False)
    assert again.complete
    two = tmp_path / "again"
    assert sorted((two / "completions.jsonl").read_bytes().splitlines()) == sorted(
        (out / "completions.jsonl").read_bytes().splitlines())
    assert untimed_bytes((two / "summary.json").read_bytes(), indent=True) == untimed_bytes(
        (out / "summary.json").read_bytes(), indent=True)
    assert b'"latency_s"' in (two / "summary.json").read_bytes()  # the timings are still reported there
    assert (two / "difficulty.jsonl").read_bytes() == (out / "difficulty.jsonl").read_bytes()


@pytest.mark.usefixtures("no_report_plots")
async def test_retried_errors_get_a_timing_per_written_line(tiny_model_and_tokenizer, tmp_path) -> None:
    _, tok = tiny_model_and_tokenizer
    data = eval_rows(tmp_path)
    cfg = cfg_for(tmp_path / "out", data, num_generations_per_prompt=3, ks=[1, 3])
    broken = [True]

    def flaky(request) -> str:
        if broken[0] and request.config.seed % 4 == 0:
            raise RuntimeError("engine down")
        return reply(request)

    first = await run_eval_async(cfg, generation=ScriptedGeneration(tok, flaky, delay_s=DELAY_S), progress=False)
    assert 0 < first.errors_written < 15
    broken[0] = False
    second = await run_eval_async(cfg, generation=ScriptedGeneration(tok, flaky, delay_s=DELAY_S), progress=False)
    assert second.retried == first.errors_written and second.errors_written == 0
    out = tmp_path / "out"
    lines = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    timings = timing_lines(out)
    assert len(lines) == 15 + first.errors_written and all(list(x) == LINE_KEYS for x in lines)
    assert [(t["prompt_idx"], t["sample_idx"]) for t in timings] == [(x["prompt_idx"], x["sample_idx"]) for x in lines]
    # each pair's latency is that of its latest entry: the retry's, not the error's
    results = {(x["prompt_idx"], x["sample_idx"]): i for i, x in enumerate(lines) if x["stop_reason"] != "error"}
    lat = [timings[i]["latency_s"] for i in sorted(results.values())]
    profile = second.summary.profile.overall.latency_s
    assert profile.num_samples == 15 and profile.mean == pytest.approx(np.mean(lat))
    assert read_timings(out) == {key: timings[i]["latency_s"] for key, i in results.items()}


async def test_nemo_gym_eval_records_each_rows_run_time(tiny_model_and_tokenizer, agents, tmp_path) -> None:
    _, tok = tiny_model_and_tokenizer
    data = tmp_path / "rows.jsonl"
    rows = [{"responses_create_params": {"input": [{"role": "user", "content": text}]}, "agent_ref": {"name": a}}
            for text, a in (("sleep 0.3", "agent_alpha"), ("y", "agent_beta"))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = EvalConfig.model_validate({
        "eval": {"dataset_path": str(data), "save_path": str(tmp_path / "out")},
        "rollouts": {"mode": "nemo_gym", "num_generations_per_prompt": {"agent_alpha": 2, "agent_beta": 1},
                     "gym": {"agent_urls": agents.agent_urls(), "serve_policy": False}},
        "policy": {"generation": {"top_k": None, "temperature": 1.0, "seed": 5, "max_new_tokens": 9}},
    })
    policy = UnusedPolicy(tok)
    result = await run_eval_async(cfg, generation=policy, progress=False)
    assert result.complete
    lines = [json.loads(x) for x in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert all("latency_s" not in x for x in lines)
    timings = timing_lines(tmp_path / "out")
    assert sorted((t["prompt_idx"], t["sample_idx"]) for t in timings) == sorted(
        (x["prompt_idx"], x["sample_idx"]) for x in lines)
    agent = {x["prompt_idx"]: x["agent"] for x in lines}
    alpha = [t["latency_s"] for t in timings if agent[t["prompt_idx"]] == "agent_alpha"]
    beta = [t["latency_s"] for t in timings if agent[t["prompt_idx"]] == "agent_beta"]
    assert len(alpha) == 2 and len(beta) == 1 and all(0.3 <= t < 30 for t in alpha) and 0 < beta[0]
    tasks = result.summary.profile.tasks
    assert tasks["agent_alpha"].latency_s.num_samples == 2 and tasks["agent_alpha"].latency_s.p50 == pytest.approx(
        float(np.percentile(alpha, 50)))
    assert tasks["agent_beta"].mean_reward == 0.5 and tasks["agent_alpha"].pass_at_k == {1: 1.0, 2: 1.0}
    assert (tmp_path / "out" / "reward_profile.png").exists() and (tmp_path / "out" / "difficulty.jsonl").exists()
