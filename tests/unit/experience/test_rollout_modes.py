"""Rollout modes by name (`experience.rollout_modes`): a third mode is one `register_rollout_mode` call, selected by
`rollouts.mode` through the front door; unknown names list the registered ones; NeMo-RL's `use_nemo_gym` maps
to a name; per-call sample counts travel as an explicit `RolloutCall`."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from test_gym_rollouts import gym_datum, gym_manager
from test_native_rollouts import TOOL_SCRIPT, EchoEnv, ScriptedPolicy, datum

from nemo_rl_ext.data.generation_counts import GenerationCounts
from nemo_rl_ext.data.records import Completion, DatumSpec, PromptGroupRecord, StopReason
from nemo_rl_ext.experience import rollout_modes
from nemo_rl_ext.experience.build import build_rollouts
from nemo_rl_ext.experience.config import RolloutsConfig
from nemo_rl_ext.experience.gym_rollouts import AsyncNemoGymRolloutImpl
from nemo_rl_ext.experience.native_rollouts import AsyncRolloutImpl
from nemo_rl_ext.experience.rollout_impl import NO_CALL, RolloutCall, RolloutImpl, RolloutSetup
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.experience.rollout_modes import available_rollout_modes, register_rollout_mode
from nemo_rl_ext.models.generation import GenerationConfig


class ToyRollouts(RolloutImpl):
    """A third mode: every completion echoes the prompt's index as its reward, with no generation at all."""

    def __init__(self, setup: RolloutSetup) -> None:
        self.setup = setup
        self._counts = GenerationCounts.parse(setup.num_generations_per_prompt)

    @classmethod
    def from_setup(cls, setup: RolloutSetup) -> ToyRollouts:
        return cls(setup)

    @property
    def counts(self) -> GenerationCounts:
        return self._counts

    async def run_rollout(self, input_sample: DatumSpec, *, call: RolloutCall = NO_CALL) -> PromptGroupRecord:
        n = call.counts_or(self._counts).for_agent(input_sample.agent)
        done = Completion(input_sample.message_log, float(input_sample.idx), False, StopReason.NATURAL, 0,
                          input_sample.agent, {"toy": True})
        return PromptGroupRecord(input_sample.idx, input_sample.message_log, input_sample.extra_env_info,
                                 input_sample.metadata, (done,) * n, {}, agent_name=input_sample.agent)


@pytest.fixture
def registry(monkeypatch):
    """Registrations made in the test are dropped after it."""
    monkeypatch.setattr(rollout_modes, "_MODES", dict(rollout_modes._MODES))


async def test_a_third_mode_is_one_call_and_rollouts_mode_selects_it(tiny_model_and_tokenizer, registry):
    _, tok = tiny_model_and_tokenizer
    with pytest.raises(ValidationError, match=r"unknown rollout mode 'toy'; registered modes: native, nemo_gym"):
        RolloutsConfig(mode="toy")
    register_rollout_mode("toy", ToyRollouts)
    assert available_rollout_modes() == ("native", "nemo_gym", "toy")
    cfg = RolloutsConfig(mode="toy", num_generations_per_prompt=3)
    rows = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    policy = ScriptedPolicy(tok, TOOL_SCRIPT)
    datums, manager = build_rollouts(cfg, tok, policy, rows, generation_config=GenerationConfig(),
                                     task_to_env={"math": EchoEnv()})
    assert manager.mode == "toy" and isinstance(manager.impl, ToyRollouts) and not manager.use_nemo_gym
    records, metrics = await manager.run_rollouts(datums, progress=False)
    assert [[c.reward for c in r.completions] for r in records] == [[0.0] * 3, [1.0] * 3]
    assert metrics["rollout/num_prompts"] == 2.0 and policy.num_calls == 0
    # the hooks a toy mode has nothing to do in: the ABC's defaults
    assert manager.request_rows(datums) is None and manager.task_to_env is None
    assert await manager.aggregate_metrics({"math": [{}]}) is None and manager.records_token_versions
    with pytest.raises(ValueError, match="ToyRollouts sends no request rows to pin"):
        manager.pin_rows({0: [{}]})
    await manager.shutdown()  # the ABC's default: nothing to stop


def test_unknown_and_conflicting_modes_are_one_clear_error(tiny_model_and_tokenizer, registry):
    _, tok = tiny_model_and_tokenizer
    common = dict(num_generations_per_prompt=1, max_seq_len=64, policy_generation=ScriptedPolicy(tok, TOOL_SCRIPT))
    with pytest.raises(ValueError, match=r"unknown rollout mode 'nope'; registered modes: native, nemo_gym$"):
        RolloutManager(tok, {"calc": EchoEnv()}, mode="nope", **common)
    with pytest.raises(ValueError, match=r"use_nemo_gym=True contradicts mode='native'"):
        RolloutManager(tok, {"calc": EchoEnv()}, use_nemo_gym=True, mode="native", **common)
    with pytest.raises(TypeError, match="needs a RolloutImpl subclass"):
        register_rollout_mode("bad", EchoEnv)
    with pytest.raises(ValueError, match="'native' is already registered to .*AsyncRolloutImpl"):
        register_rollout_mode("native", ToyRollouts)
    register_rollout_mode("native", AsyncRolloutImpl)  # the same class again: a no-op


def test_use_nemo_gym_is_the_nemo_gym_mode(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    gym = gym_manager(tok, agents, 2)  # RolloutManager(..., use_nemo_gym=True)
    assert gym.mode == "nemo_gym" and isinstance(gym.impl, AsyncNemoGymRolloutImpl)
    assert gym.task_to_env is None and not gym.records_token_versions
    native = RolloutManager(tok, {"calc": EchoEnv()}, 1, 64, policy_generation=ScriptedPolicy(tok, TOOL_SCRIPT))
    assert native.mode == "native" and native.task_to_env is not None and native.records_token_versions


async def test_per_call_counts_reach_only_their_own_call(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    manager = RolloutManager(tok, {"calc": EchoEnv()}, 2, 1024, 1, ScriptedPolicy(tok, TOOL_SCRIPT),
                             GenerationConfig(max_new_tokens=8, temperature=1.0, seed=0))
    data = [datum(tok, idx=i) for i in range(3)]
    (a, _), (b, _), (c, _) = await asyncio.gather(  # three calls at once on one manager
        manager.run_rollouts(data, progress=False, counts=3),
        manager.run_rollouts(data, progress=False),
        manager.run_rollouts(data, progress=False, counts={"_default": 1}),
    )
    assert [len(r.completions) for r in a] == [3, 3, 3]
    assert [len(r.completions) for r in b] == [2, 2, 2]
    assert [len(r.completions) for r in c] == [1, 1, 1]
    record = await manager.run_rollout(data[0], call=RolloutCall(counts=GenerationCounts.parse(4)))
    assert len(record.completions) == 4


async def test_gym_per_call_counts_and_an_override_that_cannot_take_them(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    manager = gym_manager(tok, agents, 2)
    try:
        records, _ = await manager.run_rollouts([gym_datum(0, "agent_alpha")], progress=False, counts=3)
        assert [len(r.completions) for r in records] == [3]
    finally:
        await manager.shutdown()

    class OneArgument(AsyncNemoGymRolloutImpl):
        def _build_inputs(self, input_sample):  # NeMo-RL's signature
            return super()._build_inputs(input_sample)

    impl = OneArgument(tok, None, 2, 1024, GenerationConfig(), gym_config={"agent_urls": agents.agent_urls(),
                                                                            "serve_policy": False})
    try:
        assert len((await impl.run_rollout(gym_datum(1, "agent_alpha"))).completions) == 2
        with pytest.raises(TypeError, match=r"OneArgument._build_inputs takes no `counts` keyword"):
            await impl.run_rollout(gym_datum(2, "agent_alpha"), call=RolloutCall(GenerationCounts.parse(3)))
    finally:
        await impl.shutdown()


async def test_the_documented_rollout_mode_runs_as_written(tiny_model_and_tokenizer, registry):
    """docs/extending.md's section 4, run as is: its mode is selected by rollouts.mode through the front door."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "extending.md").read_text()
    section = text.split("## 4. A rollout mode", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```python\n(.*?)^```$", section, flags=re.S | re.M)
    exec(compile(block, "docs/extending.md", "exec"), {"__name__": "extending_doc_mode"})
    _, tok = tiny_model_and_tokenizer
    cfg = RolloutsConfig(mode="index_reward", num_generations_per_prompt=2)
    rows = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    datums, manager = build_rollouts(cfg, tok, ScriptedPolicy(tok, TOOL_SCRIPT), rows,
                                     generation_config=GenerationConfig(), task_to_env={"math": EchoEnv()})
    records, _ = await manager.run_rollouts(datums, progress=False, counts=3)
    assert [[c.reward for c in r.completions] for r in records] == [[0.0] * 3, [1.0] * 3]
