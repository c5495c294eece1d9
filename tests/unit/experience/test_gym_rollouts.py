"""NeMo-Gym-backed rollouts against fake agent servers (`nemo_rl_ext.testing.FakeAgents`, the `agents` fixture
of tests/conftest.py) over a real socket."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, Request

from nemo_rl_ext.data.records import DatumSpec, StopReason
from nemo_rl_ext.experience.fault_policy import FaultPolicy, RolloutError
from nemo_rl_ext.experience.gym_results import GymResultError, result_to_completion
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.gym.client import (
    GymClient,
    GymError,
    agent_urls_from_server_instances,
    innermost_gym_error,
)
from nemo_rl_ext.gym.config import GymConfig
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.serving.threaded_server import ThreadedServer
from nemo_rl_ext.testing import FakeAgents, UnusedPolicy
from nemo_rl_ext.testing.gym_agents import GEN_1, GEN_2, PROMPT, TOOL, gym_result

NESTED_ERROR_BODY = (Path(__file__).parents[2] / "data" / "gym" / "nested-error-body.txt").read_text()
"""A 500 body of Gym 0.7.0's /run, captured in tests/functional/test_real_gym_rollouts.py."""
NESTED_CAUSE = "the backend refused the request: token id 123456 is outside the vocabulary (scripted)"


def gym_datum(idx: int, agent: str, text: str = "what's the weather?") -> DatumSpec:
    row = {
        "responses_create_params": {"input": [{"role": "user", "content": text}], "metadata": {"k": "v"}},
        "agent_ref": {"name": agent},
        "extra_field": idx,
    }
    return DatumSpec(idx=idx, message_log=(), task_name="nemo_gym", extra_env_info=row, agent_name=agent)


def gym_manager(tokenizer, agents: FakeAgents | None, counts, fault_policy=None, **gym) -> RolloutManager:
    """Gym rollouts of `agents` (None: say where in `gym`, e.g. head_server_url) with a policy they never call."""
    gym_config = {
        **({"agent_urls": agents.agent_urls()} if agents is not None else {}),
        "serve_policy": False,
        "max_attempts": 3,
        "retry_backoff_s": 0.01,
        **gym,
    }
    return RolloutManager(
        tokenizer=tokenizer,
        task_to_env=None,
        num_generations_per_prompt=counts,
        max_seq_len=1024,
        policy_generation=UnusedPolicy(),
        generation_config=GenerationConfig(max_new_tokens=77, temperature=0.9, top_p=0.95, seed=3),
        use_nemo_gym=True,
        fault_policy=fault_policy,
        gym_config=gym_config,
    )


async def test_rows_per_agent_and_result_conversion(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    mgr = gym_manager(tok, agents, {"agent_alpha": 3, "agent_beta": 1})
    data = [gym_datum(0, "agent_alpha"), gym_datum(1, "agent_beta"), gym_datum(2, "agent_alpha")]
    records, metrics = await mgr.run_rollouts(data, progress=False)
    await mgr.shutdown()
    assert [len(r.completions) for r in records] == [3, 1, 3]
    assert [r.agent_name for r in records] == ["agent_alpha", "agent_beta", "agent_alpha"]
    # the rows: sampling parameters from the generation config, a distinct seed per sample
    alpha0 = [r for r in agents.rows if r["_ng_task_index"] == 0]
    assert sorted(r["_ng_rollout_index"] for r in alpha0) == [0, 1, 2]
    for r in alpha0:
        params = r["responses_create_params"]
        assert (params["temperature"], params["top_p"], params["max_output_tokens"]) == (0.9, 0.95, 77)
        assert params["metadata"]["k"] == "v" and r["agent"] == "agent_alpha" and r["extra_field"] == 0
    seeds = {json.loads(r["responses_create_params"]["metadata"]["extra_body"])["seed"] for r in alpha0}
    assert len(seeds) == 3
    # the completions: token ids and logprobs from the output items, tool turn between the calls
    c = records[0].completions[0]
    assert [m.role for m in c.message_log] == ["user", "assistant", "tool", "assistant"]
    assert [list(m.token_ids) for m in c.message_log] == [PROMPT, GEN_1, TOOL, GEN_2]
    assert c.message_log[1].generation_logprobs == (-0.1, -0.2, -0.3)
    assert c.message_log[3].generation_logprobs == (-0.4, -0.5, -0.6)
    assert c.reward == 1.0 and c.num_turns == 2 and c.stop_reason is StopReason.NATURAL
    assert c.env_extras["gym_result"]["num_tool_calls"] == 1
    assert records[1].completions[0].reward == 0.5
    assert records[0].prompt[0].token_ids == tuple(PROMPT)
    assert metrics["agent/agent_alpha/num_samples"] == 6 and metrics["agent/agent_beta/num_samples"] == 1
    assert records[0].rollout_metrics["agent/agent_alpha/gym/num_tool_calls/mean"] == 1.0
    assert records[0].rollout_metrics["rollout/tokens/generated/mean"] == len(GEN_1) + len(GEN_2)


def test_result_conversion_edge_cases(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    truncated = result_to_completion(gym_result(0.0, status="incomplete"), "a", tok)
    assert truncated.truncated and truncated.stop_reason is StopReason.TRUNCATED
    with pytest.raises(GymResultError, match="do not start with the previous prompt"):
        result_to_completion(gym_result(1.0, second_prompt=[9] + GEN_1), "a", tok)
    failed = result_to_completion({**gym_result(1.0), "failure_kind": "model_error", "failure_reason": "boom"},
                                  "a", tok)
    assert failed.stop_reason is StopReason.ERROR and failed.error == "model_error: boom" and failed.reward == 0
    # a model server that does not return token ids (return_token_id_information off): nothing to train on
    text = [{"type": "output_text", "text": "42"}]
    no_ids = {"response": {"status": "completed", "output": [{"type": "message", "role": "assistant",
                                                              "content": text}]}, "reward": 1.0}
    no_ids = result_to_completion(no_ids, "a", tok)
    assert no_ids.stop_reason is StopReason.ERROR and "no output item with token ids" in no_ids.error


def refused_call(reward: float, earlier_output: list) -> dict:
    """A Gym result whose last model call our server refused for context length: Gym put an empty assistant
    message without token ids after the earlier items, ended the rollout incomplete, and scored it."""
    empty = {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
             "content": [{"type": "output_text", "text": "", "annotations": []}]}
    return {"response": {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
                         "output": [*earlier_output, empty]},
            "reward": reward, "failure_kind": None, "failure_reason": None}


def test_a_call_refused_for_context_length_is_a_truncated_completion(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    # refused at the first call: nothing was generated, Gym's reward (0 here) is kept
    first = result_to_completion(refused_call(0.0, []), "a", tok)
    assert (first.stop_reason, first.truncated, first.error, first.num_turns) == (StopReason.TRUNCATED, True, None, 0)
    assert first.message_log == () and first.reward == 0.0
    # refused at the second call, after a tool call that Gym's verifier rewards: the reward is Gym's
    before = gym_result(1.0)["response"]["output"][:2]  # function_call (with ids), function_call_output
    second = result_to_completion(refused_call(1.0, before), "a", tok)
    assert (second.stop_reason, second.truncated, second.error, second.num_turns) == (
        StopReason.TRUNCATED, True, None, 1)
    assert [list(m.token_ids) for m in second.message_log] == [PROMPT, GEN_1]
    assert second.reward == 1.0


def test_only_the_last_item_of_a_model_call_carries_token_ids(tiny_model_and_tokenizer):
    """Gym 0.7.0 puts the token bundle on the last output item of a model call only (a message followed by
    its function_call: on the function_call); the message before it is part of the same generation, and
    the ids between two calls are the tool output's, whatever the next call's first item is."""
    _, tok = tiny_model_and_tokenizer

    def said(text: str) -> dict:  # an assistant message of a call that also called a tool: no ids
        return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}

    def called(prompt: list[int], generated: list[int]) -> dict:
        return {"type": "function_call", "name": "get_weather", "arguments": "{}", "call_id": "c",
                "prompt_token_ids": prompt, "generation_token_ids": generated,
                "generation_log_probs": [-0.5] * len(generated)}

    tool_output = {"type": "function_call_output", "call_id": "c", "output": "cold"}
    gen_3, tool_2, final = [51, 52], [61, 62], [71, 2]
    second = PROMPT + GEN_1 + TOOL
    third = second + gen_3 + tool_2
    answer = {**said("42"), "prompt_token_ids": third, "generation_token_ids": final,
              "generation_log_probs": [-0.1, -0.2]}
    result = gym_result(1.0)
    result["response"]["output"] = [
        said("Let me check."), called(PROMPT, GEN_1), tool_output,  # call 1: message + function_call
        said("Once more."), called(second, gen_3), tool_output,  # call 2: the same, after a tool output
        answer,
    ]
    c = result_to_completion(result, "a", tok)
    assert [m.role for m in c.message_log] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [list(m.token_ids) for m in c.message_log] == [PROMPT, GEN_1, TOOL, gen_3, tool_2, final]
    assert c.num_turns == 3 and c.stop_reason is StopReason.NATURAL and c.reward == 1.0


async def test_failed_rows_are_retried(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    mgr = gym_manager(tok, agents, 2)
    record = await mgr.run_rollout(gym_datum(0, "agent_alpha", text="fail 2"))
    assert [c.reward for c in record.completions] == [1.0, 1.0]
    assert sum(agents.failures.values()) == 4  # two failures per sample, then success
    mgr = gym_manager(tok, agents, 1, max_attempts=2)
    record = await mgr.run_rollout(gym_datum(1, "agent_alpha", text="fail 5"))
    c = record.completions[0]
    assert c.stop_reason is StopReason.ERROR
    assert "row 1, sample 0" in c.error and "after 2 attempt(s)" in c.error and "HTTP 500" in c.error
    assert f"{agents.url}/agent_alpha/run" in c.error
    assert record.rollout_metrics["rollout/errors"] == 1.0


def test_the_innermost_cause_of_a_nested_gym_error():
    assert NESTED_CAUSE not in NESTED_ERROR_BODY[:300]  # what the error kept before: no cause in sight
    cause, servers = innermost_gym_error(NESTED_ERROR_BODY)
    assert cause == NESTED_CAUSE
    assert servers == ("SimpleAgent___agent_beta", "SimpleAgent___agent_beta", "VLLMModel___policy_model")
    assert innermost_gym_error('{"detail": "Not Found"}') == ("Not Found", ())
    assert innermost_gym_error('{"detail": [{"loc": ["body"], "msg": "Field required"}]}')[0] == (
        '[{"loc": ["body"], "msg": "Field required"}]')
    assert innermost_gym_error("<html>bad gateway</html>") == ("<html>bad gateway</html>", ())
    assert innermost_gym_error('"RuntimeError(\'boom\')"') == ("RuntimeError('boom')", ())
    # a bytes literal that does not parse: the text of the last layer that could be read
    broken = "Hit an exception in SimpleAgent___a calling an inner server: b'\\xZZ'"
    assert innermost_gym_error(json.dumps(broken)) == (broken, ("SimpleAgent___a",))
    cut = "Hit an exception in SimpleAgent___a calling an inner server: b'{\"error"  # cut off: no closing quote
    assert innermost_gym_error(json.dumps(cut)) == (cut, ())
    assert innermost_gym_error("") == ("", ())


async def test_a_nested_gym_error_names_its_cause_and_keeps_the_body(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    agents.error_bodies["nested"] = NESTED_ERROR_BODY
    record = await gym_manager(tok, agents, 1, max_attempts=2).run_rollout(gym_datum(3, "agent_beta", "nested"))
    c = record.completions[0]
    assert c.stop_reason is StopReason.ERROR
    assert c.error.startswith(f"GymRowError: row 3, sample 0 (agent 'agent_beta'): HTTP 500: {NESTED_CAUSE} (via "
                              "SimpleAgent___agent_beta -> SimpleAgent___agent_beta -> VLLMModel___policy_model)")
    assert c.env_extras["gym_error"] == {
        "status_code": 500, "cause": NESTED_CAUSE, "body": NESTED_ERROR_BODY,
        "servers": ["SimpleAgent___agent_beta", "SimpleAgent___agent_beta", "VLLMModel___policy_model"]}


async def test_row_timeout_gives_an_error_completion(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    mgr = gym_manager(tok, agents, {"agent_alpha": 1, "agent_beta": 1}, row_timeout_s=0.5, max_attempts=1)
    start = time.perf_counter()
    hung, fine = await asyncio.gather(
        mgr.run_rollout(gym_datum(0, "agent_alpha", text="hang")), mgr.run_rollout(gym_datum(1, "agent_beta"))
    )
    assert time.perf_counter() - start < 5
    assert hung.completions[0].stop_reason is StopReason.ERROR and "Timeout" in hung.completions[0].error
    assert fine.completions[0].stop_reason is StopReason.NATURAL


async def test_prefix_violation_is_an_error_completion_or_raises(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    record = await gym_manager(tok, agents, 1).run_rollout(gym_datum(0, "agent_alpha", text="badprefix"))
    assert "re-tokenized" in record.completions[0].error
    strict = gym_manager(tok, agents, 1, fault_policy=FaultPolicy(on_error="raise"))
    with pytest.raises(RolloutError, match="row 0, sample 0"):
        await strict.run_rollout(gym_datum(0, "agent_alpha", text="badprefix"))


async def test_bad_rows_and_servers_name_the_row_or_server(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    mgr = gym_manager(tok, agents, 1)
    no_params = DatumSpec(idx=4, message_log=(), task_name="nemo_gym", agent_name="agent_alpha",
                          extra_env_info={"agent_ref": {"name": "agent_alpha"}})
    with pytest.raises(ValueError, match=r"row 4: missing 'responses_create_params'"):
        await mgr.run_rollout(no_params)
    with pytest.raises(ValueError, match=r"row 5: unknown Gym agent 'agent_gamma'; known agents: "
                                         r"\['agent_alpha', 'agent_beta'\]"):
        await gym_manager(tok, agents, {"_default": 1}).run_rollout(gym_datum(5, "agent_gamma"))
    assert agents.rows == []
    down = gym_manager(tok, agents, 1, agent_urls={"agent_alpha": "http://127.0.0.1:9"}, max_attempts=2)
    record = await asyncio.wait_for(down.run_rollout(gym_datum(6, "agent_alpha")), 20)
    error = record.completions[0].error
    assert "http://127.0.0.1:9/run" in error and "ConnectError" in error


def test_gym_owned_settings_are_rejected_together(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    with pytest.raises(ValueError) as err:
        RolloutManager(
            tok, None, 2, 1024, max_rollout_turns=3, policy_generation=UnusedPolicy(), use_nemo_gym=True,
            generation_config=GenerationConfig(stop_strings=("x",), stop_token_ids=(2,), top_k=5),
            gym_config={"agent_urls": {"a": "http://127.0.0.1:1"}, "serve_policy": False},
        )
    message = str(err.value)
    for part in ("max_rollout_turns must be None", "stop_strings", "stop_token_ids", "top_k must be None"):
        assert part in message


async def test_head_server_discovery_and_aggregate_metrics(agents):
    client = GymClient(head_server_url=agents.url, max_attempts=1)
    try:
        urls = await client.agent_urls()
        assert urls == {"agent_alpha": f"{agents.url}/agent_alpha", "agent_beta": f"{agents.url}/agent_beta"}
        result = await client.run({"responses_create_params": {"input": [{"role": "user", "content": "hi"}]},
                                   "agent_ref": {"name": "agent_beta"}})
        assert result["reward"] == 0.5
        metrics = await client.aggregate_metrics("agent_beta", [result, {**result, "reward": 1.0}])
        assert metrics["agent_metrics"]["mean/reward"] == 0.75
        with pytest.raises(GymError, match="unknown Gym agent 'nope'"):
            await client.run({"responses_create_params": {}, "agent_ref": {"name": "nope"}})
    finally:
        await client.aclose()
    down = GymClient(head_server_url="http://127.0.0.1:9")
    with pytest.raises(GymError, match=r"head server http://127.0.0.1:9 unusable"):
        await down.agent_urls()
    await down.aclose()


def test_server_instances_parsing():
    instances = [
        {"config_path": "agent_alpha", "server_type": "responses_api_agents", "url": "http://127.0.0.1:5/"},
        {"config_path": "policy_model", "server_type": "responses_api_models", "url": "http://127.0.0.1:6"},
    ]
    assert agent_urls_from_server_instances(instances) == {"agent_alpha": "http://127.0.0.1:5"}


# ---- a dead Gym server is noticed within seconds (health checks while rows are pending) -------------


class FakeGymStack:
    """A head server with one agent (`agent_alpha`) whose `/run` calls a separate resources server.

    Like Gym's agents, the agent retries a refused connection to the resources server forever, so a dead
    resources server makes `/run` hang rather than fail.
    """

    def __init__(self, verify_s: float = 0.5) -> None:
        import httpx

        self.runs = 0
        resources, agents = FastAPI(), FastAPI()

        @resources.get("/health")
        @agents.get("/health")
        async def health():
            return {"status": "ok"}

        @resources.post("/verify")
        async def verify():
            await asyncio.sleep(verify_s)
            return {"reward": 1.0}

        @agents.post("/agent_alpha/run")
        async def run(request: Request):
            await request.json()
            self.runs += 1
            async with httpx.AsyncClient(timeout=60) as http:
                while True:
                    try:
                        reward = (await http.post(f"{self.resources.url}/verify")).json()["reward"]
                        return gym_result(reward)
                    except httpx.TransportError:
                        await asyncio.sleep(0.1)

        @agents.post("/agent_alpha/aggregate_metrics")
        async def aggregate(request: Request):  # like Gym's: asks the resources server, retrying forever
            await request.json()
            async with httpx.AsyncClient(timeout=60) as http:
                while True:
                    try:
                        await http.post(f"{self.resources.url}/verify")
                        return {"agent_metrics": {"mean/reward": 1.0}, "key_metrics": {}}
                    except httpx.TransportError:
                        await asyncio.sleep(0.1)

        @agents.get("/server_instances")
        async def instances():
            return [
                {"config_path": "agent_alpha", "server_type": "responses_api_agents",
                 "url": f"{self.agents.url}/agent_alpha"},
                {"config_path": "fake_resources", "server_type": "resources_servers", "url": self.resources.url},
            ]

        @agents.get("/global_config_dict_yaml")
        async def config():
            # what Gym's head server answers: a JSON string holding YAML (unresolved interpolations and all)
            return (
                "agent_alpha:\n  responses_api_agents:\n    simple_agent:\n      entrypoint: app.py\n"
                "      resources_server: {type: resources_servers, name: fake_resources}\n"
                "      model_server: {type: responses_api_models, name: policy_model}\n"
                "fake_resources:\n  resources_servers:\n    equivalence_rule: {host: 127.0.0.1, port: 1}\n"
                "policy_model:\n  responses_api_models:\n    vllm_model: {base_url: '${policy_base_url}'}\n"
            )

        self.resources = ThreadedServer(resources, name="fake resources server", graceful_shutdown_s=0.1)
        self.agents = ThreadedServer(agents, name="fake agent server", graceful_shutdown_s=0.1)


@pytest.fixture
def stack():
    fake = FakeGymStack()
    with fake.resources, fake.agents:
        yield fake


async def test_a_dead_resources_server_fails_its_pending_rows_within_seconds(tiny_model_and_tokenizer, stack):
    _, tok = tiny_model_and_tokenizer
    # default health checks: every 1 s, down after 3 failed probes
    mgr = gym_manager(tok, None, 4, head_server_url=stack.agents.url, row_timeout_s=60)
    try:
        healthy = await asyncio.wait_for(mgr.run_rollout(gym_datum(0, "agent_alpha")), 30)
        assert [c.reward for c in healthy.completions] == [1.0] * 4

        pending = asyncio.ensure_future(mgr.run_rollout(gym_datum(1, "agent_alpha")))
        while stack.runs < 8:  # all four rows are inside the agent, waiting for /verify
            await asyncio.sleep(0.01)
        resources_url = stack.resources.url
        await asyncio.to_thread(stack.resources.stop)  # the resources server dies mid-run
        killed = time.perf_counter()
        record = await asyncio.wait_for(pending, 30)  # today: 3 attempts x row_timeout_s (60 s) each
        noticed = time.perf_counter() - killed
        assert noticed < 6, f"took {noticed:.1f} s to notice the dead resources server"
        for c in record.completions:
            assert c.stop_reason is StopReason.ERROR
            assert "GymServerDownError" in c.error and "not retried" in c.error
            assert f"Gym resources server 'fake_resources' at {resources_url} is down" in c.error, c.error
        assert record.rollout_metrics["rollout/errors"] == 4.0

        # a row that needs the dead server fails at once, without reaching the agent
        runs, start = stack.runs, time.perf_counter()
        record = await asyncio.wait_for(mgr.run_rollout(gym_datum(2, "agent_alpha")), 30)
        assert stack.runs == runs and time.perf_counter() - start < 2
        assert all("'fake_resources'" in c.error for c in record.completions)
    finally:
        await mgr.shutdown()


async def test_gyms_aggregate_skips_a_server_known_dead_and_has_its_own_deadline(
        tiny_model_and_tokenizer, stack, agents):
    """After collection the driver asks each agent for Gym's aggregate: a server the monitor knows is dead is not
    called at all (the agent would wait on it forever), and a slow aggregate stops at gym.aggregate_timeout_s
    rather than row_timeout_s."""
    _, tok = tiny_model_and_tokenizer
    mgr = gym_manager(tok, None, 2, head_server_url=stack.agents.url, row_timeout_s=60)
    try:
        healthy = await asyncio.wait_for(mgr.run_rollout(gym_datum(0, "agent_alpha")), 30)
        results = [c.env_extras["gym_result"] for c in healthy.completions]
        assert await asyncio.wait_for(mgr.aggregate_metrics({"agent_alpha": results}), 30) == {
            "agent_alpha": {"agent_metrics": {"mean/reward": 1.0}, "key_metrics": {}, "group_level_metrics": None}}
        resources_url = stack.resources.url
        pending = asyncio.ensure_future(mgr.run_rollout(gym_datum(1, "agent_alpha")))
        while stack.runs < 4:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(stack.resources.stop)  # dies mid-run: the rows fail, the monitor knows
        await asyncio.wait_for(pending, 30)
        start = time.perf_counter()
        # today: the agent waits on the dead server for the full row_timeout_s (60 s here; 300 s shipped)
        metrics = await asyncio.wait_for(mgr.aggregate_metrics({"agent_alpha": results}), 30)
        assert time.perf_counter() - start < 1
        error = metrics["agent_alpha"]["error"]
        assert "GymServerDownError" in error and "skipped" in error, error
        assert f"Gym resources server 'fake_resources' at {resources_url} is down" in error
    finally:
        await mgr.shutdown()

    slow = gym_manager(tok, agents, 1, row_timeout_s=60, aggregate_timeout_s=0.5)
    agents.aggregate_delay_s = 20
    try:
        record = await slow.run_rollout(gym_datum(0, "agent_alpha"))
        start = time.perf_counter()
        metrics = await asyncio.wait_for(
            slow.aggregate_metrics({"agent_alpha": [record.completions[0].env_extras["gym_result"]]}), 15)
        assert time.perf_counter() - start < 5
        assert "did not answer within gym.aggregate_timeout_s=0.5" in metrics["agent_alpha"]["error"]
    finally:
        await slow.shutdown()
    assert GymConfig.model_validate({"agent_urls": {"a": "http://x"}, "policy_port": 1}).aggregate_timeout_s == 30


async def test_a_dead_agent_server_is_named(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    mgr = gym_manager(tok, agents, 1, max_attempts=3, retry_backoff_s=1.0)
    url = agents.url
    await asyncio.to_thread(agents.server.stop)
    start = time.perf_counter()
    record = await asyncio.wait_for(mgr.run_rollout(gym_datum(0, "agent_alpha")), 30)
    await mgr.shutdown()
    assert time.perf_counter() - start < 6
    assert f"Gym agent server 'agent_alpha' at {url}/agent_alpha is down" in record.completions[0].error


async def test_an_exited_server_process_is_down_at_once():
    from nemo_rl_ext.gym.health import GymServer, HealthMonitor, servers_from_config

    cfg = {
        "agent_alpha": {"responses_api_agents": {"simple_agent": {
            "host": "127.0.0.1", "port": 5, "resources_server": {"type": "resources_servers", "name": "res"},
            "model_server": {"type": "responses_api_models", "name": "policy_model"}}}},
        "res": {"resources_servers": {"equivalence_rule": {"host": "127.0.0.1", "port": 6}}},
        "policy_model": {"responses_api_models": {"vllm_model": {"host": "127.0.0.1", "port": 7}}},
        "policy_base_url": "http://127.0.0.1:8/v1",
    }
    exit_codes = {"res": None}
    servers = servers_from_config(cfg, returncodes={"res": lambda: exit_codes["res"]})
    assert servers["agent_alpha"].depends_on == ("res", "policy_model")
    assert servers["res"] == GymServer("res", "resources_servers", "http://127.0.0.1:6")
    monitor = HealthMonitor(servers, interval_s=60)
    names = monitor.closure("agent_alpha")
    assert set(names) == {"agent_alpha", "res", "policy_model"}
    assert monitor.down_reason(names) is None
    exit_codes["res"] = -9
    assert monitor.down_reason(names) == (
        "Gym resources server 'res' at http://127.0.0.1:6 is down (its process exited with code -9)"
    )
    await asyncio.wait_for(monitor.wait_down(names), 1)
    await monitor.aclose()
