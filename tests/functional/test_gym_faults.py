"""Real NeMo Gym 0.7.0 servers that die mid-run: the rows that need them fail within seconds, naming the
server, instead of waiting out row_timeout_s x max_attempts (Gym's agents retry a refused connection to
a dead server forever)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from gym_processes import gone, gym_servers_under

from nemo_rl_ext.data.records import DATA_ERROR, ERROR_KIND, PROMPT_TOO_LONG, DatumSpec, StopReason
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.testing import ScriptedGeneration, ScriptedRequest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "gym" / "arithmetic_agents.yaml"
ROWS = REPO / "examples" / "data" / "gym_arithmetic.jsonl"

pytestmark = [pytest.mark.gym, pytest.mark.timeout(600)]


def slow_arithmetic_policy(tokenizer, delay_s: float, max_model_len: int = 2048) -> ScriptedGeneration:
    """Answers "What is a + b?" right after `delay_s` (so rows are pending when a server is killed)."""

    def answer(request: ScriptedRequest) -> str:
        a, op, b = re.findall(r"What is (\d+) ([-+*]) (\d+)\?", request.prompt_text)[-1]
        return f"{int(a) + int(b) if op == '+' else -1}<|im_end|>"

    return ScriptedGeneration(tokenizer, answer, delay_s=delay_s, max_model_len=max_model_len)


def datums(n: int) -> list[DatumSpec]:
    import json

    rows = [json.loads(line) for line in ROWS.read_text().splitlines()[:n]]
    return [DatumSpec(idx=i, message_log=(), task_name="nemo_gym", extra_env_info=r, agent_name=r["agent_ref"]["name"])
            for i, r in enumerate(rows)]


@pytest.mark.parametrize(
    ("victim", "sig", "within_s", "probe_timeout_s"),
    [
        ("arithmetic_equivalence", signal.SIGKILL, 10, 5.0),  # the resources server: its process exits
        ("policy_model", signal.SIGKILL, 10, 5.0),  # Gym's model server in front of our policy server
        # hung: alive, but its health checks time out; 3 probes x (a 2 s deadline + 1 s) is ~9 s (the default
        # 5 s deadline, ~18 s, is what the test would wait out: the counting of failed probes is the same)
        ("arithmetic_equivalence", signal.SIGSTOP, 25, 2.0),
    ],
    ids=["resources-killed", "model-killed", "resources-hung"],
)
async def test_a_dead_gym_server_fails_the_pending_rows_within_seconds(
    gym_venv, tiny_model_and_tokenizer, tmp_path, victim, sig, within_s, probe_timeout_s
):
    _, tokenizer = tiny_model_and_tokenizer
    policy = slow_arithmetic_policy(tokenizer, delay_s=4.0)
    manager = RolloutManager(
        tokenizer=tokenizer,
        task_to_env=None,
        num_generations_per_prompt={"agent_alpha": 2, "_default": 1},
        max_seq_len=1024,
        policy_generation=policy,
        generation_config=GenerationConfig(max_new_tokens=16, temperature=1.0, seed=0),
        use_nemo_gym=True,
        gym_config={
            "launch": {"gym_venv": str(gym_venv), "config_paths": [str(CONFIG)], "mode": "direct",
                       "work_dir": str(tmp_path / "gym"), "startup_timeout_s": 240},
            "row_timeout_s": 300,  # what the shipped eval config uses: today a dead server costs 3 x 300 s
            "health_check_timeout_s": probe_timeout_s,
        },
    )
    try:
        first = datums(2)
        healthy, _ = await asyncio.wait_for(manager.run_rollouts(first, progress=False), 240)
        assert all(c.stop_reason is not StopReason.ERROR for r in healthy for c in r.completions)
        servers = gym_servers_under(os.getpid())
        assert set(servers) == {"arithmetic_equivalence", "agent_alpha", "agent_beta", "policy_model"}

        rows = datums(6)[2:]
        calls = policy.num_calls
        pending = asyncio.ensure_future(manager.run_rollouts(rows, progress=False))
        while policy.num_calls < calls + len(rows):  # every row is inside Gym, waiting for the policy
            await asyncio.sleep(0.05)
        os.kill(servers[victim].pid, sig)
        killed = time.perf_counter()
        records, metrics = await asyncio.wait_for(pending, 120)
        noticed = time.perf_counter() - killed
        print(f"\n{victim} {signal.Signals(sig).name}: {metrics['rollout/errors']:.0f} row(s) failed "
              f"{noticed:.2f} s later")
        assert noticed < within_s, f"{noticed:.1f} s to notice the dead {victim}"
        url = f"http://127.0.0.1:{servers[victim].ports[0]}"
        for record in records:
            for c in record.completions:
                assert c.stop_reason is StopReason.ERROR
                assert f"'{victim}' at {url} is down" in c.error and "not retried" in c.error, c.error
        assert metrics["rollout/errors"] == sum(len(r.completions) for r in records) > 0
    finally:
        servers = gym_servers_under(os.getpid())
        for server in servers.values():
            os.kill(server.pid, signal.SIGCONT)
        await manager.shutdown()
    assert all(gone(s.pid) for s in servers.values())
    for server in servers.values():
        for port in server.ports:
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


async def test_real_gym_prompts_too_long_malformed_rows_and_a_dead_server_after_collection(
    gym_venv, tiny_model_and_tokenizer, tmp_path
):
    """One Gym launch, three faults of issue 24 against real NeMo Gym 0.7.0 servers:

    - a prompt longer than the policy's context: our policy server answers Gym's model call 400 ("maximum context
      length"), Gym ends the rollout with its content:null placeholder; the completion is marked too long, with
      the length our server refused;
    - a row whose `responses_create_params.input` is a number (sent past the pre-flight check): Gym answers 422,
      a data error, not an infrastructure failure;
    - the resources server killed after collection: Gym's `/aggregate_metrics` for the agent is skipped at once
      naming it, instead of waiting row_timeout_s (300 s) on an agent that retries the dead server forever."""
    _, tokenizer = tiny_model_and_tokenizer
    policy = slow_arithmetic_policy(tokenizer, delay_s=0.0, max_model_len=256)
    manager = RolloutManager(
        tokenizer=tokenizer,
        task_to_env=None,
        num_generations_per_prompt=2,
        max_seq_len=256,
        policy_generation=policy,
        generation_config=GenerationConfig(max_new_tokens=16, temperature=1.0, seed=0),
        use_nemo_gym=True,
        gym_config={
            "launch": {"gym_venv": str(gym_venv), "config_paths": [str(CONFIG)], "mode": "direct",
                       "work_dir": str(tmp_path / "gym"), "startup_timeout_s": 240},
            "row_timeout_s": 300,
        },
    )
    try:
        short, long_row, bad_row = datums(1)[0], datums(1)[0], datums(1)[0]
        params = long_row.extra_env_info["responses_create_params"]
        question = "What is 1 + 1? " + "Think it over once more. " * 80
        long_row = DatumSpec(1, (), "nemo_gym", {**long_row.extra_env_info, "responses_create_params": {
            **params, "input": [params["input"][0], {"role": "user", "content": question}]}}, agent_name="agent_alpha")
        bad_row = DatumSpec(2, (), "nemo_gym", {**bad_row.extra_env_info, "responses_create_params": {"input": 5}},
                            agent_name="agent_alpha")
        records, metrics = await asyncio.wait_for(manager.run_rollouts([short, long_row, bad_row], progress=False),
                                                  240)
        ok, too_long, refused = records
        assert all(c.stop_reason is StopReason.NATURAL for c in ok.completions)
        longest = manager.impl._server.refused_prompts.longest
        assert longest is not None and longest > 256
        for c in too_long.completions:
            assert (c.stop_reason, c.num_turns, c.truncated, c.error) == (StopReason.TRUNCATED, 0, True, None)
            assert c.env_extras[PROMPT_TOO_LONG] == {"prompt_tokens": longest, "limit": 256}
        assert metrics["rollout/prompts_too_long"] == 1.0
        for c in refused.completions:
            assert c.stop_reason is StopReason.ERROR and c.env_extras[ERROR_KIND] == DATA_ERROR, c.error
            assert c.env_extras["gym_error"]["status_code"] == 422 and c.error.startswith("data error")

        servers = gym_servers_under(os.getpid())
        os.kill(servers["arithmetic_equivalence"].pid, signal.SIGKILL)
        results = [c.env_extras["gym_result"] for c in ok.completions]
        start = time.perf_counter()
        aggregate = await asyncio.wait_for(manager.aggregate_metrics({"agent_alpha": results}), 60)
        took = time.perf_counter() - start
        print(f"\naggregate with the resources server dead: {took:.2f} s: {aggregate['agent_alpha']}")
        assert took < 10
        assert "'arithmetic_equivalence'" in aggregate["agent_alpha"]["error"]
        assert "is down" in aggregate["agent_alpha"]["error"] and "not retried" not in aggregate["agent_alpha"]["error"]
    finally:
        await manager.shutdown()
