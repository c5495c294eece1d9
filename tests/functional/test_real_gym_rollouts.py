"""Real NeMo Gym 0.7.0 servers (simple_agent + example_single_tool_call + vllm_model with token ids)
calling our policy server, through RolloutManager(use_nemo_gym=True).

Every test runs twice: with the tiny model's tokenizer and chat template, and with SmolLM2's real ones
(whose template reads `message['content']` and fails on None). Over SmolLM2 the policy is scripted (fixed
texts as the tokenizer's ids), so it costs no generation time; the real-model test runs with the tiny model.

Needs the Gym venv; the fixture builds it with scripts/setup_nemo_gym.sh (about 2.5 min the first time,
then instant). Everything listens on 127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from nemo_rl_ext.data.records import Completion, DatumSpec, StopReason
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.models.generation.hf_backend import HfGeneration
from nemo_rl_ext.models.smollm2 import smollm2_path
from nemo_rl_ext.testing import ScriptedCall, ScriptedGeneration

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "tests" / "functional" / "gym_configs" / "two_agents.yaml"
ROWS = REPO / "tests" / "data" / "gym" / "collector-input.jsonl"
COUNTS = {"agent_alpha": 3, "agent_beta": 1}
MAX_MODEL_LEN = 2048
TOKENIZERS = ["tiny", "smollm2"]
"""Whose tokenizer and chat template the policy uses: the tiny test model's, or SmolLM2-135M-Instruct's."""

pytestmark = [pytest.mark.gym, pytest.mark.timeout(900), pytest.mark.asyncio(loop_scope="module")]


class RecordingPolicy(ScriptedGeneration):
    """Delegates to a real backend, or to a script of texts (real tokenizer ids); records every call.

    A scripted text that is an Exception instance is raised (the policy server answers 400 with it)."""

    def __init__(self, tokenizer, backend: HfGeneration | None = None, max_model_len: int = MAX_MODEL_LEN) -> None:
        super().__init__(tokenizer, None, backend=backend, max_model_len=max_model_len, finish_reason=FinishReason.EOS,
                         logprobs=lambda prompt, ids, config: [-0.25 - 0.01 * i for i in range(len(ids))],
                         cut_at_max_new_tokens=False)  # scripted texts run past the real model's 24 tokens
        self.script = None

    @property
    def script(self) -> list[str | Exception] | Callable[[str], list[str | Exception]] | None:
        """Texts by turn, or a function of the decoded prompt that gives them; None: the real backend."""
        return self._script

    @script.setter
    def script(self, script: list[str | Exception] | Callable[[str], list[str | Exception]] | None) -> None:
        self._script = script
        if callable(script):
            self.replies = lambda r: (texts := script(r.prompt_text))[min(r.turn, len(texts) - 1)]
        else:
            self.replies = script


def gym_rows() -> list[DatumSpec]:
    rows = [json.loads(line) for line in ROWS.read_text().splitlines() if line.strip()]
    datums = []
    for idx, row in enumerate(rows):
        agent = "agent_alpha" if idx % 2 == 0 else "agent_beta"
        row = {**row, "agent_ref": {"name": agent}}
        datums.append(DatumSpec(idx=idx, message_log=(), task_name="nemo_gym", extra_env_info=row, agent_name=agent))
    return datums


def earned_reward(completion: Completion) -> float:
    """What Gym's example_single_tool_call verifier must give: 1.0 when the model called get_weather (the
    agent then ran the tool: a tool message with the resources server's weather), else 0.0."""
    ran = any(m.role == "tool" and "The weather in" in m.content and "is cold" in m.content
              for m in completion.message_log)
    return 1.0 if ran else 0.0


def assert_generated_by_us(completion: Completion, calls: list[ScriptedCall]) -> None:
    """Every assistant turn is exactly a call our server made, and later prompts extend earlier ones."""
    context: list[int] = []
    previous: list[int] | None = None
    for message in completion.message_log:
        if message.role == "assistant":
            matches = [c.output for c in calls
                       if c.output is not None and c.prompt_token_ids == context and c.output.output_ids == message.token_ids]
            assert matches, "an assistant turn that our policy server did not generate"
            assert message.generation_logprobs == pytest.approx(matches[0].logprobs, rel=1e-6, abs=1e-6)
            if previous is not None:
                assert context[: len(previous)] == previous
            previous = context + list(message.token_ids)
        context = context + list(message.token_ids)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=TOKENIZERS)
async def gym_manager(request, gym_venv, tiny_model_and_tokenizer, tmp_path_factory):
    if request.param == "tiny":
        model, tokenizer = tiny_model_and_tokenizer
        policy = RecordingPolicy(tokenizer, HfGeneration(model, tokenizer, max_model_len=MAX_MODEL_LEN))
    else:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_path())  # the tokenizer only: no weights loaded
        policy = RecordingPolicy(tokenizer)
    policy.name = request.param
    manager = RolloutManager(
        tokenizer=tokenizer,
        task_to_env=None,
        num_generations_per_prompt=COUNTS,
        max_seq_len=MAX_MODEL_LEN,
        policy_generation=policy,
        generation_config=GenerationConfig(max_new_tokens=24, temperature=1.0, seed=7),
        use_nemo_gym=True,
        gym_config={
            "launch": {"gym_venv": str(gym_venv), "config_paths": [str(CONFIG)], "mode": "direct",
                       "work_dir": str(tmp_path_factory.mktemp("gym")), "startup_timeout_s": 180},
            "row_timeout_s": 120,
            "max_attempts": 2,
        },
    )
    yield manager, policy
    impl = manager.impl
    launcher_pids = [p.pid for p in impl._launcher._procs.values()] if impl._launcher else []
    agent_urls = dict(impl._client._agent_urls) if impl._client else {}
    await manager.shutdown()
    policy.shutdown()
    for pid in launcher_pids:  # every Gym process is gone
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    for url in agent_urls.values():
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)


async def test_real_gym_with_the_tiny_model(gym_manager):
    manager, policy = gym_manager
    if policy.name != "tiny":
        pytest.skip("real-model generation runs with the tiny model; the SmolLM2 variants are scripted")
    policy.script = None
    policy.calls.clear()
    datums = gym_rows()
    records, metrics = await manager.run_rollouts(datums, progress=False)
    assert [len(r.completions) for r in records] == [COUNTS[d.agent] for d in datums]
    for record in records:
        for c in record.completions:
            assert c.stop_reason is not StopReason.ERROR, c.error
            assert c.num_turns >= 1
            assert c.reward == earned_reward(c), [m.content for m in c.message_log]
            assert_generated_by_us(c, policy.calls)
    assert metrics["rollout/errors"] == 0


async def test_real_gym_two_turn_tool_rollouts(gym_manager):
    manager, policy = gym_manager
    tool_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "sf"}}\n</tool_call><|im_end|>'
    # questions about sf get a get_weather call, then an answer; the others an answer without a tool call
    policy.script = lambda prompt: (
        [tool_call, "It is cold in sf.<|im_end|>"] if " sf" in prompt.rsplit("<|im_start|>user", 1)[-1]
        else ["No idea.<|im_end|>"]
    )
    policy.calls.clear()
    datums = gym_rows()
    records, metrics = await manager.run_rollouts(datums, progress=False)
    sizes = {d.agent: len(r.completions) for d, r in zip(datums, records, strict=True)}
    assert sizes == COUNTS
    assert {r.agent_name for r in records} == {"agent_alpha", "agent_beta"}
    # rows 0-2 ask about sf, rows 3-4 not; rows alternate agent_alpha (3 samples) and agent_beta (1 sample)
    calls_tool = [True, True, True, False, False]
    for record, tool in zip(records, calls_tool, strict=True):
        for c in record.completions:
            assert c.stop_reason is StopReason.NATURAL, c.error
            if tool:
                assert c.num_turns == 2
                assert [m.role for m in c.message_log] == ["user", "assistant", "tool", "assistant"]
                assert "cold" in c.message_log[2].content  # the resources server's tool output, as tokens
            else:
                assert c.num_turns == 1 and [m.role for m in c.message_log] == ["user", "assistant"]
            # example_single_tool_call rewards a get_weather call and nothing else
            assert c.reward == (1.0 if tool else 0.0)
            assert_generated_by_us(c, policy.calls)
    assert metrics["agent/agent_alpha/num_samples"] == 3 * len([d for d in datums if d.agent == "agent_alpha"])
    # rewarded: rows 0, 2 (alpha, 3 each) and row 1 (beta, 1) = 7 of 3 + 1 + 3 + 1 + 3 = 11
    assert metrics["rollout/reward/mean"] == pytest.approx(7 / 11)
    assert metrics["agent/agent_alpha/reward/mean"] == pytest.approx(6 / 9)  # rows 0, 2 of 0, 2, 4
    assert metrics["agent/agent_beta/reward/mean"] == pytest.approx(1 / 2)  # row 1 of 1, 3


def tool_call(city: str) -> str:
    """A tool-call-only generation (the server answers it with content null and one tool call)."""
    return "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": city}}) + "\n</tool_call><|im_end|>"


def question_row(idx: int, question: str, agent: str = "agent_beta") -> DatumSpec:
    """Row 0 of the collector input with another user question."""
    row = json.loads(ROWS.read_text().splitlines()[0])
    params = row["responses_create_params"]
    params = {**params, "input": [params["input"][0], {"role": "user", "content": question}]}
    row = {**row, "responses_create_params": params, "agent_ref": {"name": agent}}
    return DatumSpec(idx=idx, message_log=(), task_name="nemo_gym", extra_env_info=row, agent_name=agent)


async def test_real_gym_tool_call_only_turns_over_three_model_calls(gym_manager):
    """Three calls that only call tools, a call with text before its tool call, then an answer. Gym sends
    each earlier call back as an assistant message (content null for the tool-only ones) with its token ids;
    the later prompts render them through the chat template. Of the items of one call, only the last
    carries the token ids."""
    manager, policy = gym_manager
    cities = ["sf", "nyc", "la", "sf"]
    texts = [*(tool_call(c) for c in cities[:3]), "Once more." + tool_call(cities[3]), "Cold in all.<|im_end|>"]
    policy.script = lambda prompt: (
        texts if " sf" in prompt.split("<|im_start|>user", 1)[-1].split("<|im_end|>", 1)[0]
        else ["No idea.<|im_end|>"]
    )
    policy.calls.clear()
    datums = gym_rows()
    records, metrics = await manager.run_rollouts(datums, progress=False)
    assert metrics["rollout/errors"] == 0, [c.error for r in records for c in r.completions]
    calls_tool = [True, True, True, False, False]  # rows 0-2 ask about sf
    for record, tool in zip(records, calls_tool, strict=True):
        for c in record.completions:
            assert c.stop_reason is StopReason.NATURAL, c.error
            if tool:
                assert c.num_turns == 5
                assert [m.role for m in c.message_log] == ["user"] + ["assistant", "tool"] * 4 + ["assistant"]
                tools = [m.content for m in c.message_log if m.role == "tool"]
                assert [f"The weather in {city} is cold" in t for t, city in zip(tools, cities, strict=True)] == [
                    True] * 4
                assert c.message_log[-1].content == "Cold in all."
                output = c.env_extras["gym_result"]["response"]["output"]
                assert [(item["type"], item.get("prompt_token_ids") is not None) for item in output] == [
                    *[("function_call", True), ("function_call_output", False)] * 3,
                    ("message", False), ("function_call", True), ("function_call_output", False),  # one call
                    ("message", True)]
            else:
                assert c.num_turns == 1
            assert c.reward == (1.0 if tool else 0.0)  # Gym's verifier: a get_weather call was made
            assert_generated_by_us(c, policy.calls)
    assert max(len(prompt) for prompt in policy.prompts) < MAX_MODEL_LEN


@pytest.mark.filterwarnings("ignore:num_generations_per_prompt has keys that match no row")
async def test_real_gym_rows_over_the_context_length_end_truncated(gym_manager):
    """A prompt over max_model_len is refused with vLLM's wording; Gym ends the rollout (an empty assistant
    message without token ids, status incomplete) and scores it; we keep it as a truncated completion with
    Gym's reward: refused at the first call (nothing generated), or at the second, after a tool call whose
    output (the city, twice) fills the context."""
    manager, policy = gym_manager
    tok = policy.tokenizer
    city = "sf" + " sf" * (MAX_MODEL_LEN // 3 // len(tok(" sf", add_special_tokens=False)["input_ids"]))
    city_len = len(tok(city, add_special_tokens=False)["input_ids"])
    policy.script = [tool_call(city), "unreachable<|im_end|>"]
    policy.calls.clear()
    datums = [question_row(0, "what's it like in sf? " + "very " * MAX_MODEL_LEN),
              question_row(1, "what's it like in the long city?")]
    records, metrics = await manager.run_rollouts(datums, progress=False)
    assert metrics["rollout/errors"] == 0, [c.error for r in records for c in r.completions]
    (first,), (second,) = (r.completions for r in records)
    for c in (first, second):
        assert c.stop_reason is StopReason.TRUNCATED and c.truncated and c.error is None
        result = c.env_extras["gym_result"]
        assert result["response"]["status"] == "incomplete"
        last = result["response"]["output"][-1]
        assert last["type"] == "message" and last.get("prompt_token_ids") is None  # the refused call
        assert c.reward == result["reward"]  # Gym's reward, kept
    assert first.num_turns == 0 and first.message_log == () and first.reward == 0.0
    assert second.num_turns == 1 and [m.role for m in second.message_log] == ["user", "assistant"]
    assert second.reward == 1.0  # the get_weather call was made before the context filled up
    assert_generated_by_us(second, policy.calls)
    assert len(policy.calls) == 1  # the only call that fitted; the long row never reached the policy
    fitted = len(policy.calls[0].prompt_token_ids) + len(policy.calls[0].output.output_ids)
    assert fitted < MAX_MODEL_LEN < fitted + 2 * city_len


@pytest.mark.filterwarnings("ignore:num_generations_per_prompt has keys that match no row")
async def test_real_gym_errors_keep_their_innermost_cause(gym_manager):
    """Our 400 (not a context-length one) makes Gym's /run answer 500 with the cause nested two servers
    deep; the error completion names the cause and keeps the whole body."""
    manager, policy = gym_manager
    policy.script = [ValueError("token id 123456 is outside the vocabulary (scripted)")]
    records, metrics = await manager.run_rollouts([question_row(0, "what's it like in sf?")], progress=False)
    (c,) = records[0].completions
    assert c.stop_reason is StopReason.ERROR and metrics["rollout/errors"] == 1
    assert "HTTP 500: the backend refused the request: token id 123456 is outside the vocabulary" in c.error
    assert "via SimpleAgent___agent_beta -> " in c.error
    gym_error = c.env_extras["gym_error"]
    assert gym_error["status_code"] == 500 and gym_error["servers"][0] == "SimpleAgent___agent_beta"
    assert gym_error["cause"].startswith("the backend refused the request: token id 123456")
    assert gym_error["body"].startswith('"Hit an exception in SimpleAgent___agent_beta calling an inner server')


@pytest.mark.asyncio(loop_scope="module")
async def test_gym_venv_python_is_313(gym_venv):
    version = subprocess.run([str(gym_venv / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, env=os.environ).stdout
    assert "(3, 13)" in version
