"""A prompt that alone leaves no room to generate is counted and said once, not passed off as a model that
answers nothing: `num_prompts_too_long` in the eval's summary, table and report, one warning per run naming the
longest prompt and the settings to raise, and `rollout/prompts_too_long` in the step metrics (native rollouts,
and Gym rollouts whose first model call the policy server refused for context length)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import orjson
from test_gym_rollouts import gym_datum, gym_manager

from nemo_rl_ext.data.records import PROMPT_TOO_LONG, StopReason
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval_async
from nemo_rl_ext.evals.report import format_metric_table
from nemo_rl_ext.experience.gym_results import result_to_completion
from nemo_rl_ext.experience.prompt_length import PromptLengthWarning
from nemo_rl_ext.experience.rollout_manager import batch_metrics
from nemo_rl_ext.serving.api_errors import ApiError
from nemo_rl_ext.serving.policy_server import PolicyService
from nemo_rl_ext.testing import ScriptedGeneration
from nemo_rl_ext.testing.gym_agents import refused_result

REPO = Path(__file__).resolve().parents[3]
MAX_MODEL_LEN = 96
LONG_QUESTION = "What is 1 + 1? " + "Think about it carefully. " * 60


def warnings_about_length(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "prompt(s) too long" in r.getMessage()]


async def test_a_native_eval_counts_and_names_prompts_too_long(tiny_model_and_tokenizer, tmp_path, caplog):
    _, tok = tiny_model_and_tokenizer
    rows = [json.loads(x) for x in (REPO / "examples/data/arithmetic.jsonl").read_text().splitlines()[:2]]
    rows.insert(1, {"question": LONG_QUESTION, "answer": "2"})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = EvalConfig.model_validate({
        "eval": {"dataset_path": str(data), "save_path": str(tmp_path / "out")},
        "rollouts": {"mode": "native", "max_rollout_turns": 1, "num_generations_per_prompt": 2},
        "policy": {"model_name": "unused", "generation": {"max_new_tokens": 8, "temperature": 1.0, "seed": 0}},
    })
    policy = ScriptedGeneration(tok, "\\boxed{2}", max_model_len=MAX_MODEL_LEN)
    with caplog.at_level(logging.WARNING):
        result = await run_eval_async(cfg, generation=policy, progress=False)
    summary = result.summary
    lines = [orjson.loads(x) for x in (tmp_path / "out" / "completions.jsonl").read_bytes().splitlines()]
    long_lines = [x for x in lines if x["prompt_idx"] == 1]
    prompt_tokens = sum(m["num_tokens"] for m in long_lines[0]["message_log"])
    assert prompt_tokens > MAX_MODEL_LEN
    for x in long_lines:  # how a prompt too long ends: truncated at 0 turns, now marked
        assert (x["stop_reason"], x["num_turns"], x["truncated"]) == ("truncated", 0, True)
        assert x["env_extras"][PROMPT_TOO_LONG] == {"prompt_tokens": prompt_tokens, "limit": MAX_MODEL_LEN}
    assert not any(PROMPT_TOO_LONG in x["env_extras"] for x in lines if x["prompt_idx"] != 1)
    assert policy.num_calls == 4  # only the two short prompts reached the engine

    assert summary.num_prompts_too_long == 1 and summary.longest_prompt_too_long == prompt_tokens
    on_disk = orjson.loads((tmp_path / "out" / "summary.json").read_bytes())
    assert on_disk["num_prompts_too_long"] == 1 and on_disk["longest_prompt_too_long"] == prompt_tokens
    table = format_metric_table(summary)
    assert any(line.split() == ["prompts", "too", "long", "(no", "room", "to", "generate)", "1"]
               for line in table.splitlines()), table
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| prompts too long (no room to generate) | 1 |" in report
    assert "1 of 3 prompt(s) too long" in report and "policy.max_model_len" in report

    said = warnings_about_length(caplog)
    assert len(said) == 1, said
    assert f"the longest is {prompt_tokens} tokens" in said[0]
    assert "policy.max_model_len and rollouts.max_seq_len" in said[0]


def test_the_warning_is_logged_once_per_run(caplog):
    warn = PromptLengthWarning()
    with caplog.at_level(logging.WARNING):
        warn(0, 10, None)  # nothing to say
        warn(2, 10, 3000)
        warn(5, 10, 4000)  # a later step with more: still the one warning
    said = warnings_about_length(caplog)
    assert len(said) == 1 and said[0].startswith("2 of 10 prompt(s) too long") and "3000 tokens" in said[0]


async def test_a_gym_prompt_refused_at_the_first_call_is_counted(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    # Gym's answer when the policy server refused the first call: nothing generated, the response incomplete
    first = result_to_completion(refused_result(), "a", tok)
    assert (first.stop_reason, first.num_turns) == (StopReason.TRUNCATED, 0)
    assert first.env_extras[PROMPT_TOO_LONG] == {"prompt_tokens": None, "limit": None}

    mgr = gym_manager(tok, agents, 2)
    try:
        too_long = await mgr.run_rollout(gym_datum(0, "agent_alpha", text="too long"))
        fine = await mgr.run_rollout(gym_datum(1, "agent_alpha"))
    finally:
        await mgr.shutdown()
    # serve_policy off: no server of ours to ask for the length; the limit is the policy's
    assert [c.env_extras[PROMPT_TOO_LONG] for c in too_long.completions] == [
        {"prompt_tokens": None, "limit": 1024}] * 2
    assert not any(PROMPT_TOO_LONG in c.env_extras for c in fine.completions)
    metrics = batch_metrics([too_long, fine], 1.0)
    assert metrics["rollout/prompts_too_long"] == 1.0 and metrics["rollout/num_prompts"] == 2.0
    assert batch_metrics([fine], 1.0)["rollout/prompts_too_long"] == 0.0


async def test_the_policy_server_records_the_prompts_it_refuses_for_context_length(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    service = PolicyService(ScriptedGeneration(tok, "ok", max_model_len=MAX_MODEL_LEN), tok)
    lengths = []
    for words in (200, 120):
        body = {"model": "policy", "messages": [{"role": "user", "content": "word " * words}]}
        lengths.append(service.tokenize(body)["count"])
        try:
            await service.chat_completion(body)
        except ApiError as err:
            assert err.status_code == 400 and "maximum context length" in err.message
        else:
            raise AssertionError("a prompt longer than max_model_len was served")
    short = await service.chat_completion({"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
    assert short["object"] == "chat.completion"  # a prompt with room is served as before
    assert min(lengths) >= MAX_MODEL_LEN
    assert (service.refused_prompts.count, service.refused_prompts.longest) == (2, max(lengths))


def test_a_reply_without_token_ids_is_not_taken_for_a_refused_prompt(tiny_model_and_tokenizer):
    """A model server that returns no token ids (return_token_id_information off) and hit max_output_tokens
    also leaves an incomplete result without ids; only Gym's empty stand-in for a refused call counts."""
    _, tok = tiny_model_and_tokenizer
    result = refused_result()
    result["response"]["output"][0]["content"] = [{"type": "output_text", "text": "The answer is", "annotations": []}]
    assert PROMPT_TOO_LONG not in result_to_completion(result, "a", tok).env_extras
    null = refused_result()
    null["response"]["output"][0]["content"] = None  # Gym sends content null too
    assert PROMPT_TOO_LONG in result_to_completion(null, "a", tok).env_extras
