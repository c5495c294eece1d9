"""The eval's typed records: a completions.jsonl line, the summary, and the metric registry.

The expected bytes below are what the eval wrote before these records existed (completion_line + dumps, at
commit 73af7e6): files stay byte-compatible in both directions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.records import Completion, Message, PromptGroupRecord, StopReason
from nemo_rl_ext.evals.lines import CompletionLine, LineMessage
from nemo_rl_ext.evals.metrics import (
    BUILTIN_METRICS,
    MetricDef,
    PromptSamples,
    aggregate_eval_metrics,
    metric_defs,
    register_metric,
    unregister_metric,
)
from nemo_rl_ext.evals.store import CompletionStore, dumps
from nemo_rl_ext.evals.summary import ErrorSample, EvalSummary, GymAgentMetrics

BEFORE = [  # (sample, save_token_ids) -> the line the old writer produced
    b'{"prompt_idx":7,"sample_idx":0,"agent":"math","reward":1.0,"answer":"4","stop_reason":"natural",'
    b'"truncated":false,"num_turns":1,"error":null,"metadata":{"id":"q7"},"env_extras":{"vote_key":"4",'
    b'"tags":["a"]},"message_log":[{"role":"user","content":"2+2?","num_tokens":2},{"role":"assistant",'
    b'"content":"4","num_tokens":1}]}',
    b'{"prompt_idx":7,"sample_idx":0,"agent":"math","reward":1.0,"answer":"4","stop_reason":"natural",'
    b'"truncated":false,"num_turns":1,"error":null,"metadata":{"id":"q7"},"env_extras":{"vote_key":"4",'
    b'"tags":["a"]},"message_log":[{"role":"user","content":"2+2?","num_tokens":2,"token_ids":[1,2]},'
    b'{"role":"assistant","content":"4","num_tokens":1,"token_ids":[3]}]}',
    b'{"prompt_idx":7,"sample_idx":1,"agent":"math","reward":0.0,"answer":null,"stop_reason":"error",'
    b'"truncated":false,"num_turns":0,"error":"TimeoutError: late","metadata":{"id":"q7"},"env_extras":{},'
    b'"message_log":[{"role":"user","content":"2+2?","num_tokens":2}]}',
    b'{"prompt_idx":7,"sample_idx":1,"agent":"math","reward":0.0,"answer":null,"stop_reason":"error",'
    b'"truncated":false,"num_turns":0,"error":"TimeoutError: late","metadata":{"id":"q7"},"env_extras":{},'
    b'"message_log":[{"role":"user","content":"2+2?","num_tokens":2,"token_ids":[1,2]}]}',
]


def record() -> PromptGroupRecord:
    prompt = (Message("user", "2+2?", (1, 2)),)
    ok = Completion(
        (*prompt, Message("assistant", "4", (3,), (-0.1,))), 1, False, StopReason.NATURAL, 1, "math",
        {"answer": 4, "sample_idx": 1, "vote_key": "4", "tags": ("a",)},
    )
    failed = Completion(prompt, 0.0, False, StopReason.ERROR, 0, "math", {}, "TimeoutError: late")
    return PromptGroupRecord(7, prompt, {}, {"id": "q7"}, (ok, failed), {}, agent_name="math")


def test_a_line_is_written_and_read_exactly_as_before(tmp_path: Path) -> None:
    rec = record()
    lines = [
        CompletionLine.from_completion(rec, i, c, save) for i, c in enumerate(rec.completions) for save in (False, True)
    ]
    assert [dumps(x.to_json()) for x in lines] == BEFORE
    ok, ok_ids, err, _ = lines
    assert ok.answer == "4" and ok.reward == 1.0 and not ok.is_error and err.is_error
    assert ok.env_extras == {"vote_key": "4", "tags": ("a",)}  # answer and sample_idx are not extras
    assert ok_ids.message_log[1] == LineMessage("assistant", "4", 1, (3,)) and ok.message_log[1].token_ids is None
    # an old line reads into the same record and writes back to the same bytes
    for before in BEFORE:
        assert dumps(CompletionLine.from_json(json.loads(before)).to_json()) == before
    path = tmp_path / "completions.jsonl"
    path.write_bytes(b"".join(b + b"\n" for b in BEFORE))
    store = CompletionStore(path)
    assert store.line(7, 0).message_log[0].token_ids is None and store.line(7, 1).error == "TimeoutError: late"
    CompletionStore(tmp_path / "again.jsonl").append(lines)
    assert (tmp_path / "again.jsonl").read_bytes() == path.read_bytes()


def test_a_line_with_a_bad_message_log_is_named(tmp_path: Path) -> None:
    good = json.loads(BEFORE[1])
    path = tmp_path / "c.jsonl"
    bad_ids = {**good, "sample_idx": 2, "message_log": [{"role": "user", "content": "x", "num_tokens": 1,
                                                          "token_ids": ["1"]}]}
    no_role = {**good, "sample_idx": 3, "message_log": [{"content": "x", "num_tokens": 1}]}
    not_dict = {**good, "sample_idx": 4, "metadata": []}
    path.write_text("\n".join(json.dumps(x) for x in (good, bad_ids, no_role, not_dict)) + "\n")
    with pytest.raises(ConfigError, match=r"3 unreadable line\(s\)") as info:
        CompletionStore(path)
    msg = str(info.value)
    assert "line 2: message_log[0].token_ids is not a list of integers" in msg
    assert "line 3: message_log[0] needs a string role and an integer num_tokens" in msg
    assert "line 4: wrong type: metadata=[]" in msg and "line 1" not in msg


def summary() -> EvalSummary:
    prompts = [PromptSamples("a", (1.0, 0.0), ("4", "5"), num_errors=1)]
    return EvalSummary(
        rollout_mode="single_turn", model="tiny", dataset_path="d.jsonl", num_prompts=1, num_completions=3,
        ks=(1, 2), reward_threshold=1.0, agents=("a",), stop_reasons={"error": 1, "natural": 2},
        status="errors_allowed", num_errors=1, error_rate=1 / 3, max_error_rate=0.5,
        error_samples=(ErrorSample(0, 2, "a", "boom"),), truncation_rate=0.0, mean_turns=1.0,
        metrics=aggregate_eval_metrics(prompts, [1, 2]),
    )


def test_the_summary_has_the_summary_json_keys_in_order_and_reads_back() -> None:
    s = summary()
    keys = ["rollout_mode", "model", "dataset_path", "num_prompts", "num_completions", "ks", "reward_threshold",
            "agents", "stop_reasons", "status", "num_errors", "error_rate", "max_error_rate", "error_samples",
            "truncation_rate", "mean_turns", "metrics",
            "num_data_errors", "data_error_rows", "num_prompts_too_long", "longest_prompt_too_long"]
    assert list(s.to_json()) == keys
    assert s.to_json()["error_samples"] == [{"prompt_idx": 0, "sample_idx": 2, "agent": "a", "error": "boom"}]
    assert s["metrics"]["pass@2"] == 1.0 and s["ks"] == [1, 2]  # readable by its JSON keys
    gym = dataclasses.replace(s, gym_metrics={"agent": GymAgentMetrics({"mean/reward": 0.5}, {"x": 1}),
                                              "other": GymAgentMetrics(error="ConnectError: down")})
    assert list(gym.to_json()) == [*keys, "gym_metrics"]
    assert gym["gym_metrics"] == {"agent": {"agent_metrics": {"mean/reward": 0.5}, "key_metrics": {"x": 1}},
                                  "other": {"error": "ConnectError: down"}}  # summary.json's bytes as before
    for x in (s, gym):
        text = dumps(x.to_json(), indent=True)
        back = EvalSummary.from_json(json.loads(text))
        assert back == x and dumps(back.to_json(), indent=True) == text and back.error_samples == x.error_samples
    assert s == json.loads(dumps(s.to_json())) and s != gym  # equal to its summary.json, as callers compare


def test_the_registry_refuses_bad_names_and_keeps_built_ins() -> None:
    def constant(p: PromptSamples, correct: tuple[bool, ...], k: int | None) -> float:
        return 0.5

    assert [m.name for m in metric_defs()[: len(BUILTIN_METRICS)]] == ["mean_reward", "pass", "maj", "mean",
                                                                       "majority", "cons"]
    for name in ("pass", "num_prompts", "metrics", "latency_s", "pass@k", "a/b", ""):  # profile fields too
        with pytest.raises(ValueError, match="taken|identifier"):
            register_metric(MetricDef(name, constant))
    with pytest.raises(ValueError, match="not a registered"):
        unregister_metric("pass")
    metric = register_metric(MetricDef("half", constant, per_k=False))
    try:
        out = aggregate_eval_metrics([PromptSamples("a", (1.0,), ("1",))], [1])
        assert list(out)[3:6] == ["mean_reward", "mean_reward/stderr", "half"] and out["half"] == 0.5
    finally:
        unregister_metric(metric.name)
    assert "half" not in aggregate_eval_metrics([PromptSamples("a", (1.0,), ("1",))], [1])


def test_a_failing_metric_says_which_metric_and_agent() -> None:
    def broken(p: PromptSamples, correct: tuple[bool, ...], k: int | None) -> float:
        raise ZeroDivisionError("oops")

    register_metric(MetricDef("broken", broken))
    try:
        with pytest.raises(ZeroDivisionError, match="oops") as info:
            aggregate_eval_metrics([PromptSamples("alpha", (1.0,), ("1",))], [1])
        assert "while computing metric broken@1 for a prompt of agent 'alpha'" in info.value.__notes__
    finally:
        unregister_metric("broken")


def test_no_metric_can_take_the_name_of_a_profile_field() -> None:
    """A registered scalar metric `<name>` lands in each task's profile under its name; a name equal to one of
    `TaskProfile`'s own fields would be read back as that field and the metric lost."""
    import dataclasses

    from nemo_rl_ext.evals import metrics
    from nemo_rl_ext.evals.profile import TaskProfile

    assert {f.name for f in dataclasses.fields(TaskProfile)} <= metrics._RESERVED
