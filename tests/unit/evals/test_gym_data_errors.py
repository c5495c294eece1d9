"""Malformed Gym rows are data errors, not infrastructure: the pre-flight check names every row whose
`responses_create_params` Gym would refuse, and a row Gym still refuses (an HTTP 4xx) is recorded as a data
error that a resume does not retry and that makes the eval CLI exit 2 naming the rows (fake agents:
`nemo_rl_ext.testing.FakeAgents`)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import orjson
import pytest
from test_gym_collection import row
from test_gym_rollouts import gym_datum, gym_manager

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.records import DATA_ERROR, ERROR_KIND, StopReason
from nemo_rl_ext.evals.config import EvalConfig, input_problems
from nemo_rl_ext.evals.driver import run_eval_async
from nemo_rl_ext.evals.report import format_metric_table
from nemo_rl_ext.gym.client import GymRowError
from nemo_rl_ext.gym.rows import responses_params_problems
from nemo_rl_ext.testing import FakeAgents, UnusedPolicy

REPO = Path(__file__).resolve().parents[3]


def run_eval_cli():
    """examples/run_eval.py as a module (its `exit_status` decides the CLI's exit code)."""
    spec = importlib.util.spec_from_file_location("run_eval_cli", REPO / "examples" / "run_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eval_config(tmp_path: Path, rows: list, agents_urls: dict[str, str] | None = None) -> EvalConfig:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return EvalConfig.model_validate({
        "eval": {"dataset_path": str(data), "save_path": str(tmp_path / "out")},
        "rollouts": {"mode": "nemo_gym", "num_generations_per_prompt": 2,
                     "gym": {"agent_urls": agents_urls or {"agent_alpha": "http://127.0.0.1:9"},
                             "serve_policy": False}},
        "policy": {"generation": {"top_k": None, "temperature": 1.0, "seed": 5, "max_new_tokens": 9}},
    })


def test_every_malformed_row_is_named_before_anything_starts(tmp_path):
    good = row("What is 1 + 1?", "agent_alpha")
    rows = ["hello", {**good, "responses_create_params": {}}, {**good, "responses_create_params": {"input": 5}},
            good, {**good, "responses_create_params": {"input": [{"role": "user", "content": "x"}], "tools": {},
                                                        "temperature": "hot"}}]
    problems = input_problems(eval_config(tmp_path, rows))
    text = "\n".join(problems)
    assert "4 bad row(s)" in text, text
    assert "line 1: expected an object, got str" in text
    assert "line 2: responses_create_params.input is missing" in text
    assert "line 3: responses_create_params.input must be a string or a list of message/item objects, got 5" in text
    assert "line 4" not in text
    assert "line 5: responses_create_params.tools must be a list of tool objects, got {}" in text
    assert "responses_create_params.temperature must be a number, got 'hot'" in text


def test_the_row_check_knows_the_responses_api_shapes():
    ok = [
        {"input": "a plain string"},
        {"input": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                   {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c1"},
                   {"type": "function_call_output", "call_id": "c1", "output": "42"},
                   {"type": "reasoning", "summary": []}],
         "tools": [{"type": "function", "name": "f", "parameters": {}}], "tool_choice": "auto",
         "temperature": 1, "top_p": 0.9, "max_output_tokens": 64, "parallel_tool_calls": False,
         "metadata": {"extra_body": "{}"}, "some_future_field": object()},
    ]
    for params in ok:
        assert responses_params_problems(params) == [], params
    bad = {
        "[]": ([], "responses_create_params must be an object"),
        "no input": ({"tools": []}, "input is missing"),
        "number input": ({"input": 5}, "input must be a string or a list"),
        "item not an object": ({"input": ["hi"]}, "input[0] must be a message or item object, got 'hi'"),
        "bad role": ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role must be one of"),
        "bad content": ({"input": [{"role": "user", "content": 7}]}, "input[0].content must be a string or a list"),
        "untyped part": ({"input": [{"role": "user", "content": ["x"]}]}, "input[0].content[0] must be an object"),
        # real Gym 0.7.0 answered this one 422 (seen through the eval CLI: a data error, exit 2)
        "unknown part": ({"input": [{"role": "user", "content": [{"type": "bogus_part"}]}]},
                         "input[0].content[0] must be an object with a 'type' in ['input_text'"),
        "part text": ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]},
                      "input[0].content[0].text must be a string, got 3"),
        "no role or type": ({"input": [{"text": "x"}]}, "input[0] needs a 'role'"),
        "call arguments": ({"input": [{"type": "function_call", "name": "f", "arguments": {}, "call_id": "c"}]},
                           "input[0].arguments of a function_call item must be a string"),
        "tools a dict": ({"input": "x", "tools": {"type": "function"}}, "tools must be a list"),
        "untyped tool": ({"input": "x", "tools": [{"name": "f"}]}, "tools[0] must be an object with a string 'type'"),
        "bool temperature": ({"input": "x", "temperature": True}, "temperature must be a number, got True"),
        "float max tokens": ({"input": "x", "max_output_tokens": 1.5}, "max_output_tokens must be an integer"),
    }
    for name, (params, needle) in bad.items():
        problems = responses_params_problems(params)
        assert len(problems) == 1 and needle in problems[0], (name, problems)


def test_which_gym_answers_are_data_errors():
    def error(code):
        return GymRowError("x", status_code=code)

    assert [error(c).is_data_error for c in (400, 413, 422)] == [True, True, True]
    # a wrong route, a timeout, a rate limit, a server error, no answer at all: not the row's fault
    assert [error(c).is_data_error for c in (404, 408, 429, 500, 503, None)] == [False] * 6


async def test_a_row_gym_refuses_is_a_data_error_completion(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    mgr = gym_manager(tok, agents, 2, max_attempts=3)
    record = await mgr.run_rollout(gym_datum(0, "agent_alpha", text="invalid"))
    await mgr.shutdown()
    assert len(agents.rows) == 2  # refused once per sample: a 4xx is not retried
    for c in record.completions:
        assert c.stop_reason is StopReason.ERROR and c.error.startswith("data error (Gym refused the row")
        assert "HTTP 422" in c.error and "Input should be a valid string" in c.error
        assert c.env_extras[ERROR_KIND] == DATA_ERROR and c.env_extras["gym_error"]["status_code"] == 422
    # an infrastructure failure is not marked
    down = gym_manager(tok, None, 1, agent_urls={"agent_alpha": "http://127.0.0.1:9"}, max_attempts=1)
    failed = (await down.run_rollout(gym_datum(1, "agent_alpha"))).completions[0]
    await down.shutdown()
    assert failed.stop_reason is StopReason.ERROR and ERROR_KIND not in failed.env_extras


async def test_the_eval_does_not_retry_data_errors_and_the_cli_exits_2_naming_the_rows(
        tiny_model_and_tokenizer, agents: FakeAgents, tmp_path, capsys):
    _, tok = tiny_model_and_tokenizer
    policy = UnusedPolicy(tok)
    rows = [row("fine", "agent_alpha"), row("invalid", "agent_alpha"), row("fine too", "agent_alpha")]
    cfg = eval_config(tmp_path, rows, agents.agent_urls())
    result = await run_eval_async(cfg, generation=policy, progress=False)
    summary = result.summary
    assert result.complete and summary.num_errors == 2 and summary.num_data_errors == 2
    assert summary.data_error_rows == (1,)
    assert summary.status == "errors_allowed"  # data errors are not judged as infrastructure failures
    lines = [orjson.loads(x) for x in (tmp_path / "out" / "completions.jsonl").read_bytes().splitlines()]
    refused = [x for x in lines if x["prompt_idx"] == 1]
    assert [x["env_extras"][ERROR_KIND] for x in refused] == [DATA_ERROR] * 2
    on_disk = orjson.loads((tmp_path / "out" / "summary.json").read_bytes())
    assert on_disk["num_data_errors"] == 2 and on_disk["data_error_rows"] == [1]
    table = format_metric_table(summary)
    assert "2 sample(s) are data errors: NeMo Gym refused dataset row(s) 1 of" in table
    assert "infrastructure" not in table.split("data errors")[0]  # no infrastructure errors to speak of

    cli = run_eval_cli()
    assert cli.exit_status(summary, "see above") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 2 sample(s) are data errors: NeMo Gym refused dataset row(s) 1 of")
    assert "rows.jsonl" in err

    # a resume with the rows unchanged sends nothing again and writes nothing: the refusal is final
    sent = len(agents.rows)
    again = await run_eval_async(cfg, generation=policy, progress=False)
    assert again.complete and again.retried == 0 and again.completions_written == 0 and again.groups_generated == 0
    assert len(agents.rows) == sent
    assert again.summary.num_data_errors == 2 and cli.exit_status(again.summary, "see above") == 2

    # an infrastructure error alone still exits 3 (more than max_error_rate), as before
    infra = type(summary).from_json({**summary.to_json(), "num_data_errors": 0, "data_error_rows": [],
                                     "status": "errors_left"})
    assert cli.exit_status(infra, "see above") == 3


async def test_a_refused_row_that_was_fixed_is_rolled_out_again_on_resume(
        tiny_model_and_tokenizer, agents: FakeAgents, tmp_path):
    _, tok = tiny_model_and_tokenizer
    policy = UnusedPolicy(tok)
    rows = [row("fine", "agent_alpha"), row("invalid", "agent_alpha")]
    cfg = eval_config(tmp_path, rows, agents.agent_urls())
    first = await run_eval_async(cfg, generation=policy, progress=False)
    assert first.summary.num_data_errors == 2 and first.summary.data_error_rows == (1,)
    data = Path(cfg.eval.dataset_path)

    # another row changed too (one with results): refused as a changed dataset, nothing sent or written
    before, sent = (tmp_path / "out" / "completions.jsonl").read_bytes(), len(agents.rows)
    data.write_text("".join(json.dumps(r) + "\n" for r in [row("changed", "agent_alpha"), row("fixed", "agent_alpha")]))
    with pytest.raises(ConfigError, match=r"1 of the 2 rows they cover differ \(rows 0\)"):
        await run_eval_async(cfg, generation=policy, progress=False)
    assert (tmp_path / "out" / "completions.jsonl").read_bytes() == before and len(agents.rows) == sent

    # only the refused row fixed: the resume rolls its 2 samples out again, from the fixed row
    data.write_text("".join(json.dumps(r) + "\n" for r in [rows[0], row("fixed", "agent_alpha")]))
    again = await run_eval_async(cfg, generation=policy, progress=False)
    assert len(agents.rows) == sent + 2
    assert all("fixed" in json.dumps(r) for r in agents.rows[sent:])
    assert again.summary.num_data_errors == 0 and again.summary.num_errors == 0
    assert again.summary.num_completions == 4 and again.complete and again.summary.status == "ok"
    pinned = (tmp_path / "out" / "gym_rows.jsonl").read_text()
    assert "fixed" in pinned and "invalid" not in pinned  # the rows file now sends the fixed row
