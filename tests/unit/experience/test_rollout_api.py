"""NeMo-RL's documented `nemo_rl.experience.rollout_manager` API (as NeMo-RL documents it): names, signatures,
the hooks as real extension points (a subclass that overrides one changes what a rollout does), and
`PromptGroupRecord` built as in NeMo-RL.

The implementations are imported from the modules that define them, so each test here exercises its own
point (the import test checks the documented import path).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from test_gym_rollouts import gym_datum
from test_native_rollouts import TOOL_SCRIPT, EchoEnv, ScriptedPolicy, datum
from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.data.records import Completion, Message, PromptGroupRecord, StopReason
from nemo_rl_ext.environments.interfaces import Observation
from nemo_rl_ext.environments.tool_env import ToolCalculatorEnvironment
from nemo_rl_ext.experience.gym_rollouts import AsyncNemoGymRolloutImpl
from nemo_rl_ext.experience.native_rollouts import AsyncRolloutImpl
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.grpo.batch import build_training_batch
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.testing import FakeAgents, ScriptedEnvironment

CONFIG = GenerationConfig(max_new_tokens=64, seed=0)
GYM_CONFIG = GenerationConfig(max_new_tokens=77, temperature=0.9, top_p=0.95, seed=3)


def gym_settings(agents: FakeAgents) -> dict:
    return {
        "agent_urls": agents.agent_urls(),
        "serve_policy": False,
        "max_attempts": 1,
    }


def gym_impl(cls, tok, agents, counts=2, generation_config=GYM_CONFIG):
    return cls(tok, None, counts, 1024, generation_config, gym_config=gym_settings(agents))


def native_impl(cls, tok, policy, env, counts=2, **kwargs):
    return cls(tok, {"calc": env, "echo": env}, counts, 1024, policy, generation_config=CONFIG, **kwargs)


# ---- names and signatures -------------------------------------------------------------------------


def test_the_documented_names_import_from_the_rollout_manager_module():
    from nemo_rl_ext.experience import rollout_manager
    from nemo_rl_ext.experience.rollout_manager import (  # noqa: F401
        AsyncNemoGymRolloutImpl,
        AsyncRolloutImpl,
        PromptGroupRecord,
        RolloutManager,
        TokenizerType,
    )

    assert TokenizerType is PreTrainedTokenizerBase
    assert rollout_manager.AsyncRolloutImpl.__module__ == "nemo_rl_ext.experience.native_rollouts"
    assert rollout_manager.PromptGroupRecord.__module__ == "nemo_rl_ext.data.records"


def params(fn) -> list[tuple[str, object]]:
    """(name, default) of each parameter a caller passes (self, *, ** excluded), in order."""
    return [
        (p.name, p.default)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD
    ]


EMPTY = inspect.Parameter.empty


SIGNATURES = [
    (
        AsyncRolloutImpl,
        "__init__",
        [("tokenizer", EMPTY), ("task_to_env", EMPTY), ("num_generations_per_prompt", EMPTY),
         ("max_seq_len", EMPTY), ("policy_generation", EMPTY), ("max_rollout_turns", 999999)],
    ),
    (
        AsyncNemoGymRolloutImpl,
        "__init__",
        [("tokenizer", EMPTY), ("task_to_env", EMPTY), ("num_generations_per_prompt", EMPTY),
         ("max_seq_len", EMPTY), ("generation_config", EMPTY), ("max_rollout_turns", None)],
    ),
    (
        RolloutManager,
        "__init__",
        [("tokenizer", EMPTY), ("task_to_env", EMPTY), ("num_generations_per_prompt", EMPTY),
         ("max_seq_len", EMPTY), ("max_rollout_turns", None), ("policy_generation", None),
         ("generation_config", None), ("use_nemo_gym", False)],
    ),
    (RolloutManager, "run_rollout", [("input_sample", EMPTY)]),
    (RolloutManager, "set_weight_version", [("version", EMPTY)]),
    (AsyncRolloutImpl, "run_rollout", [("input_sample", EMPTY)]),
    (AsyncNemoGymRolloutImpl, "run_rollout", [("input_sample", EMPTY)]),
    (AsyncRolloutImpl, "_run_single_rollout", [("input_sample", EMPTY), ("traj_idx", EMPTY)]),
    (AsyncRolloutImpl, "_generate_response", [("message_log", EMPTY), ("stop_strings", EMPTY)]),
    (AsyncRolloutImpl, "_aggregate_rollout_metrics", [("completions", EMPTY), ("all_sample_metrics", EMPTY)]),
    (AsyncNemoGymRolloutImpl, "_validate_init_params", []),
    (AsyncNemoGymRolloutImpl, "_build_inputs", [("input_sample", EMPTY)]),
    (AsyncNemoGymRolloutImpl, "_run_rollouts", [("inputs", EMPTY), ("timer", None), ("timer_prefix", "nemo_gym")]),
    (AsyncNemoGymRolloutImpl, "_result_to_completion", [("result", EMPTY)]),
    (AsyncNemoGymRolloutImpl, "_compute_rollout_metrics", [("completions", EMPTY), ("agent_name", EMPTY)]),
]


@pytest.mark.parametrize(
    ("owner", "name", "expected"), SIGNATURES, ids=[f"{o.__name__}.{n}" for o, n, _ in SIGNATURES]
)
def test_documented_signatures(owner, name, expected):
    assert hasattr(owner, name), f"{owner.__name__} has no {name}"
    assert params(getattr(owner, name)) == expected


async def test_native_constructor_positionally_and_by_keyword_with_our_additions(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    env = ToolCalculatorEnvironment()
    positional = AsyncRolloutImpl(tok, {"calc": env}, {"agent_a": 3, "_default": 1}, 1024,
                                  ScriptedPolicy(tok, TOOL_SCRIPT), 2, generation_config=CONFIG)
    keywords = AsyncRolloutImpl(
        tokenizer=tok, task_to_env={"calc": env}, num_generations_per_prompt={"agent_a": 3, "_default": 1},
        max_seq_len=1024, policy_generation=ScriptedPolicy(tok, TOOL_SCRIPT), max_rollout_turns=2,
        generation_config=CONFIG, fault_policy=None,
    )
    for impl in (positional, keywords):
        record = await impl.run_rollout(input_sample=datum(tok, agent="agent_a"))
        assert len(record.completions) == 3  # the per-agent dict count
        assert {c.stop_reason for c in record.completions} == {StopReason.MAX_TURNS}  # max_rollout_turns=2
        assert [c.num_turns for c in record.completions] == [2, 2, 2]
    # NeMo-RL's default: (effectively) no turn limit
    unlimited = AsyncRolloutImpl(tok, {"calc": env}, 1, 1024, ScriptedPolicy(tok, TOOL_SCRIPT))
    assert unlimited.max_rollout_turns == 999999
    c = (await unlimited.run_rollout(datum(tok))).completions[0]
    assert c.num_turns == 3 and c.stop_reason is StopReason.NATURAL and c.reward == 1.0


async def test_gym_constructor_positionally_and_by_keyword_with_our_additions(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    counts = {"agent_alpha": 3, "_default": 1}
    positional = AsyncNemoGymRolloutImpl(tok, None, counts, 1024, GYM_CONFIG, None, gym_config=gym_settings(agents))
    keywords = AsyncNemoGymRolloutImpl(
        tokenizer=tok, task_to_env=None, num_generations_per_prompt=counts, max_seq_len=1024,
        generation_config=GYM_CONFIG, max_rollout_turns=None, policy_generation=None, fault_policy=None,
        gym_config=gym_settings(agents),
    )
    try:
        for impl in (positional, keywords):
            alpha = await impl.run_rollout(input_sample=gym_datum(0, "agent_alpha"))
            beta = await impl.run_rollout(gym_datum(1, "agent_beta"))
            assert [len(alpha.completions), len(beta.completions)] == [3, 1]
            assert [c.reward for c in alpha.completions + beta.completions] == [1.0, 1.0, 1.0, 0.5]
    finally:
        await positional.shutdown()
        await keywords.shutdown()


async def test_manager_takes_nemo_rls_positional_arguments_and_ours_by_keyword(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    native = RolloutManager(tok, {"calc": ToolCalculatorEnvironment()}, 2, 1024, 3, ScriptedPolicy(tok, TOOL_SCRIPT),
                            CONFIG, False, fault_policy=None)
    assert isinstance(native.impl, AsyncRolloutImpl) and native.impl.max_rollout_turns == 3
    record = await native.run_rollout(input_sample=datum(tok))
    assert [c.reward for c in record.completions] == [1.0, 1.0]
    gym = RolloutManager(tok, None, 2, 1024, None, None, GYM_CONFIG, True, gym_config=gym_settings(agents))
    assert isinstance(gym.impl, AsyncNemoGymRolloutImpl)
    try:
        assert len((await gym.run_rollout(input_sample=gym_datum(0, "agent_alpha"))).completions) == 2
    finally:
        await gym.shutdown()


def test_gym_needs_a_policy_only_when_it_serves_one(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    serving = {**gym_settings(agents), "serve_policy": True, "policy_port": 8999}
    with pytest.raises(ValueError, match="policy_generation is required"):
        AsyncNemoGymRolloutImpl(tok, None, 1, 1024, GYM_CONFIG, gym_config=serving)


def test_each_implementation_reports_every_bad_argument_at_once(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    with pytest.raises(ValueError) as err:
        AsyncNemoGymRolloutImpl(tok, None, {"a": 0}, 1, GenerationConfig(top_k=3), 2,
                                gym_config={"agent_urls": {"a": "http://127.0.0.1:1"}, "max_attempts": 0})
    message = str(err.value)
    for part in ("AsyncNemoGymRolloutImpl: ", "max_seq_len must be an int >= 2, got 1", "'a': 0",
                 "max_rollout_turns must be None", "top_k must be None", "gym_config.max_attempts", "(got 0)"):
        assert part in message, part
    with pytest.raises(ValueError) as err:
        AsyncRolloutImpl(tok, {}, 0, "long", None, 0)
    message = str(err.value)
    for part in ("AsyncRolloutImpl: ", "max_seq_len must be an int >= 2, got 'long'", ">= 1, got 0",
                 "max_rollout_turns must be None or an int >= 1, got 0", "policy_generation is required",
                 "task_to_env is required"):
        assert part in message, part


# ---- the native hooks -----------------------------------------------------------------------------


async def test_overriding_run_single_rollout_replaces_a_rollout(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    seen = []

    class OneCanned(AsyncRolloutImpl):
        async def _run_single_rollout(self, input_sample, traj_idx):
            seen.append((input_sample.idx, traj_idx))
            if traj_idx != 1:
                return await super()._run_single_rollout(input_sample, traj_idx)
            log = (*input_sample.message_log, Message("assistant", "canned", (5, 6), (-1.0, -1.0)))
            canned = Completion(log, 7.0, False, StopReason.NATURAL, 1, input_sample.agent, {"answer": "7"})
            return canned, {"prompt_messages": float(len(input_sample.message_log))}

    policy = ScriptedPolicy(tok, TOOL_SCRIPT)
    record = await native_impl(OneCanned, tok, policy, ToolCalculatorEnvironment(), counts=3).run_rollout(
        datum(tok, idx=4)
    )
    assert sorted(seen) == [(4, 0), (4, 1), (4, 2)]
    assert [c.reward for c in record.completions] == [1.0, 7.0, 1.0]
    assert record.completions[1].message_log[-1].content == "canned"
    assert record.rollout_metrics["rollout/reward/max"] == 7.0
    assert record.rollout_metrics["rollout/tokens/generated/mean"] == pytest.approx(
        sum(sum(len(m.token_ids) for m in c.message_log[1:] if m.role == "assistant") for c in record.completions) / 3
    )
    assert len(policy.calls) == 2 * 3  # two real rollouts of three turns; the canned one made no call


class StopEnv(ScriptedEnvironment):
    """Two steps: asks for stop strings ("STOP",) for the second turn; reward 1 at the end."""

    def __init__(self) -> None:
        super().__init__(turns=2, observation=Observation("user", "again"), next_stop_strings=("STOP",),
                         reward=lambda s: float(s.turn == 2))


async def test_overriding_generate_response_changes_every_turn(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    calls = []
    reply = tuple(tok("overridden<|im_end|>", add_special_tokens=False)["input_ids"])

    class Canned(AsyncRolloutImpl):
        async def _generate_response(self, message_log, stop_strings):  # NeMo-RL's exact signature and return
            calls.append((message_log, stop_strings))
            message = {"role": "assistant", "content": "overridden", "token_ids": torch.tensor(reply),
                       "generation_logprobs": torch.full((len(reply),), -0.5)}
            input_lengths = torch.tensor([sum(len(m.token_ids) for m in message_log)], dtype=torch.int32)
            return message, input_lengths, {"generation_time_s": 0.25}

    policy = ScriptedPolicy(tok, TOOL_SCRIPT)
    d = datum(tok, task="echo")
    record = await native_impl(Canned, tok, policy, StopEnv(), counts=2).run_rollout(d)
    assert policy.calls == []  # the engine was never asked: the hook is the one place a turn is generated
    for c in record.completions:
        assert [m.content for m in c.message_log if m.role == "assistant"] == ["overridden", "overridden"]
        assert [m.token_ids for m in c.message_log if m.role == "assistant"] == [reply, reply]
        assert [m.generation_logprobs for m in c.message_log if m.role == "assistant"] == [(-0.5,) * len(reply)] * 2
        assert c.reward == 1.0 and c.stop_reason is StopReason.NATURAL
    assert len(calls) == 4
    assert sorted(stop for _, stop in calls if stop) == [("STOP",), ("STOP",)]
    assert [stop for log, stop in calls if len(log) == len(d.message_log)] == [None, None]  # first turns
    for log, _ in calls:  # the rollout's messages so far, the prompt first
        assert log[: len(d.message_log)] == d.message_log
    assert record.rollout_metrics["rollout/generation_time_s/mean"] == pytest.approx(0.5)  # 2 turns x 0.25


async def test_the_default_generate_response_seeds_per_prompt_sample_and_turn(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    seeds = []

    class Seeds(ScriptedPolicy):
        async def generate_async(self, prompt_token_ids, config):
            seeds.append(config.seed)
            return await super().generate_async(prompt_token_ids, config)

    impl = native_impl(AsyncRolloutImpl, tok, Seeds(tok, TOOL_SCRIPT), ToolCalculatorEnvironment(), counts=2)
    await impl.run_rollout(datum(tok, idx=3))
    assert len(seeds) == 6 and len(set(seeds)) == 6
    # outside a rollout the hook uses the generation config as it is; it returns NeMo-RL's documented tuple
    log = datum(tok).message_log
    message, input_lengths, metrics = await impl._generate_response(log, None)
    assert seeds[-1] == CONFIG.seed and message.role == "assistant" and metrics["output_tokens"] > 0
    assert input_lengths.dtype == torch.int32 and input_lengths.tolist() == [sum(len(m.token_ids) for m in log)]


@pytest.mark.parametrize("hook", ["_generate_response", "_generate_turn"])
async def test_an_override_that_calls_the_default_keeps_the_rollouts_seeds(tiny_model_and_tokenizer, hook):
    """The default path passes the rollout to the turn; an overridden hook reaches it through the ContextVar: the
    requests' seeds (per prompt, sample and turn) are the same either way."""
    _, tok = tiny_model_and_tokenizer

    def seeds_of(cls) -> list:
        seeds = []

        class Seeds(ScriptedPolicy):
            async def generate_async(self, prompt_token_ids, config):
                seeds.append((tuple(prompt_token_ids), config.seed, config.session))
                return await super().generate_async(prompt_token_ids, config)

        impl = native_impl(cls, tok, Seeds(tok, TOOL_SCRIPT), ToolCalculatorEnvironment(), counts=2)
        return impl, seeds

    overridden_calls = []

    async def passthrough(self, message_log, stop_strings):
        overridden_calls.append(len(message_log))
        return await getattr(super(Wrapped, self), hook)(message_log, stop_strings)

    Wrapped = type("Wrapped", (AsyncRolloutImpl,), {hook: passthrough})
    default, default_seeds = seeds_of(AsyncRolloutImpl)
    wrapped, wrapped_seeds = seeds_of(Wrapped)
    await default.run_rollout(datum(tok, idx=3))
    await wrapped.run_rollout(datum(tok, idx=3))
    assert len(overridden_calls) == 6  # the override ran for every turn
    assert len(default_seeds) == 6 and len({seed for _, seed, _ in default_seeds}) == 6
    assert sorted(wrapped_seeds) == sorted(default_seeds)  # prompts, seeds and sessions alike
    assert {session for _, _, session in wrapped_seeds} == {(3, 0), (3, 1)}


async def test_overriding_aggregate_rollout_metrics_changes_the_records_metrics(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    received = []

    class Custom(AsyncRolloutImpl):
        def _aggregate_rollout_metrics(self, completions, all_sample_metrics):
            received.append((len(completions), [sorted(m) for m in all_sample_metrics]))
            return {"custom/best": max(c.reward for c in completions)}

    impl = native_impl(Custom, tok, ScriptedPolicy(tok, ["ok<|im_end|>"]), EchoEnv(), counts=3, max_rollout_turns=2)
    record = await impl.run_rollout(datum(tok, task="echo"))
    assert received == [(3, [["env_time_s", "generation_time_s", "prompt_messages"]] * 3)]
    assert set(record.rollout_metrics) == {"custom/best", "rollout/wall_time_s"}
    assert record.rollout_metrics["custom/best"] == pytest.approx(0.5)  # two EchoEnv steps of 0.25


# ---- the Gym hooks --------------------------------------------------------------------------------


def test_overriding_validate_init_params_changes_what_is_accepted(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    with_top_k = GYM_CONFIG.model_copy(update={"top_k": 5})
    with pytest.raises(ValueError, match="top_k must be None"):
        gym_impl(AsyncNemoGymRolloutImpl, tok, agents, generation_config=with_top_k)

    class TopKServer(AsyncNemoGymRolloutImpl):  # e.g. agents whose model server accepts top_k
        def _validate_init_params(self):
            try:
                super()._validate_init_params()
            except ValueError as err:
                rest = [p for p in str(err).split(": ", 1)[1].split("; ") if not p.startswith("top_k")]
                if rest:
                    raise ValueError("; ".join(rest)) from None

    assert gym_impl(TopKServer, tok, agents, generation_config=with_top_k).generation_config.top_k == 5

    class NeedsSeed(AsyncNemoGymRolloutImpl):
        def _validate_init_params(self):
            super()._validate_init_params()
            if self.generation_config.seed is None:
                raise ValueError("this deployment needs seeded rows")

    with pytest.raises(ValueError, match="needs seeded rows"):
        gym_impl(NeedsSeed, tok, agents, generation_config=GYM_CONFIG.model_copy(update={"seed": None}))


async def test_overriding_build_inputs_changes_the_rows_sent(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer

    class Tagged(AsyncNemoGymRolloutImpl):
        def _build_inputs(self, input_sample):
            rows = super()._build_inputs(input_sample)
            for r in rows:
                r["responses_create_params"]["temperature"] = 0.25
                r["tag"] = f"p{input_sample.idx}"
            return rows

    impl = gym_impl(Tagged, tok, agents, counts=3)
    try:
        await impl.run_rollout(gym_datum(2, "agent_beta"))
    finally:
        await impl.shutdown()
    assert [(r["tag"], r["responses_create_params"]["temperature"]) for r in agents.rows] == [("p2", 0.25)] * 3
    assert sorted(r["_ng_rollout_index"] for r in agents.rows) == [0, 1, 2]


async def test_a_prompts_rows_go_through_run_rollouts_as_one_batch(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    batches = []

    class Counting(AsyncNemoGymRolloutImpl):
        async def _run_rollouts(self, inputs, timer=None, timer_prefix="nemo_gym"):
            batches.append([(r["_ng_task_index"], r["_ng_rollout_index"]) for r in inputs])
            return await super()._run_rollouts(inputs, timer, timer_prefix)

    impl = gym_impl(Counting, tok, agents, counts={"agent_alpha": 4, "agent_beta": 2})
    try:
        records = [await impl.run_rollout(gym_datum(i, a)) for i, a in enumerate(["agent_alpha", "agent_beta"])]
    finally:
        await impl.shutdown()
    assert batches == [[(0, 0), (0, 1), (0, 2), (0, 3)], [(1, 0), (1, 1)]]
    assert [len(r.completions) for r in records] == [4, 2]
    assert records[0].rollout_metrics["rollout/gym/failed_rows"] == 0.0


async def test_overriding_run_rollouts_replaces_the_dispatch(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer

    class Offline(AsyncNemoGymRolloutImpl):  # e.g. replaying stored results instead of calling Gym
        async def _run_rollouts(self, inputs, timer=None, timer_prefix="nemo_gym"):
            results = [{"agent_ref": r["agent_ref"], "reward": 0.125 * r["_ng_rollout_index"],
                        "response": {"output": [{"type": "message", "prompt_token_ids": [1, 2],
                                                 "generation_token_ids": [3], "generation_log_probs": [-0.5]}]}}
                       for r in inputs]
            return [self._result_to_completion(r) for r in results], {"replayed": float(len(results))}

    impl = gym_impl(Offline, tok, agents, counts=3)
    try:
        record = await impl.run_rollout(gym_datum(0, "agent_alpha"))
    finally:
        await impl.shutdown()
    assert agents.rows == []  # Gym never saw a row
    assert [c.reward for c in record.completions] == [0.0, 0.125, 0.25]
    assert record.rollout_metrics["replayed"] == 3.0 and record.rollout_metrics["rollout/num_samples"] == 3.0


async def test_run_rollouts_times_the_dispatch_with_a_nemo_rl_style_timer(tiny_model_and_tokenizer, agents):
    import contextlib

    _, tok = tiny_model_and_tokenizer
    labels = []

    class Timer:
        @contextlib.contextmanager
        def time(self, label):
            labels.append(label)
            yield

    impl = gym_impl(AsyncNemoGymRolloutImpl, tok, agents, counts=2)
    try:
        rows = impl._build_inputs(gym_datum(0, "agent_alpha"))
        completions, metrics = await impl._run_rollouts(rows, Timer(), "grpo/rollouts")
    finally:
        await impl.shutdown()
    assert labels == ["grpo/rollouts/run_rollouts"] and [c.reward for c in completions] == [1.0, 1.0]
    assert metrics["rollout/wall_time_s"] > 0


async def test_overriding_result_to_completion_changes_the_completions(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    seen = []

    class Scaled(AsyncNemoGymRolloutImpl):
        def _result_to_completion(self, result):
            seen.append((result["agent_ref"]["name"], result["_ng_task_index"], result["_ng_rollout_index"]))
            completion = super()._result_to_completion(result)
            return dataclasses.replace(completion, reward=completion.reward * 10)

    impl = gym_impl(Scaled, tok, agents, counts=2)
    try:
        record = await impl.run_rollout(gym_datum(5, "agent_beta"))
    finally:
        await impl.shutdown()
    assert [c.reward for c in record.completions] == [5.0, 5.0]  # the fake agents give agent_beta 0.5
    assert sorted(seen) == [("agent_beta", 5, 0), ("agent_beta", 5, 1)]
    assert record.rollout_metrics["rollout/reward/mean"] == 5.0


async def test_overriding_compute_rollout_metrics_changes_the_records_metrics(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer

    class Custom(AsyncNemoGymRolloutImpl):
        def _compute_rollout_metrics(self, completions, agent_name):
            return {f"custom/{agent_name}/solved": float(sum(c.reward == 1.0 for c in completions))}

    impl = gym_impl(Custom, tok, agents, counts=3)
    try:
        record = await impl.run_rollout(gym_datum(0, "agent_alpha"))
    finally:
        await impl.shutdown()
    assert record.rollout_metrics["custom/agent_alpha/solved"] == 3.0
    assert "rollout/reward/mean" not in record.rollout_metrics
    assert set(record.rollout_metrics) == {"custom/agent_alpha/solved", "rollout/wall_time_s", "rollout/gym/failed_rows"}


async def test_the_default_gym_metrics_are_the_rollout_and_gym_result_metrics(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    impl = gym_impl(AsyncNemoGymRolloutImpl, tok, agents, counts=2)
    try:
        record = await impl.run_rollout(gym_datum(0, "agent_alpha"))
    finally:
        await impl.shutdown()
    metrics = record.rollout_metrics
    assert metrics["rollout/num_samples"] == 2 and metrics["agent/agent_alpha/reward/mean"] == 1.0
    assert metrics["agent/agent_alpha/gym/num_tool_calls/mean"] == 1.0 and metrics["rollout/gym/failed_rows"] == 0


# ---- PromptGroupRecord ----------------------------------------------------------------------------


def completion(reward: float, agent: str = "a", tokens: tuple[int, ...] = (4, 5)) -> Completion:
    log = (Message("user", "q", (1, 2)), Message("assistant", "x", tokens, tuple(-0.1 for _ in tokens)))
    return Completion(log, reward, False, StopReason.NATURAL, 1, agent)


def test_prompt_group_record_has_nemo_rls_field_order_then_ours():
    names = [f.name for f in dataclasses.fields(PromptGroupRecord)]
    assert names[:7] == [
        "prompt_idx", "prompt", "extra_env_info", "metadata", "completions", "rollout_metrics", "loss_multiplier"
    ]
    assert names[7:] == ["agent_name"]
    assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(PromptGroupRecord)[6:])


def test_prompt_group_record_built_positionally_as_in_nemo_rl():
    prompt = [Message("user", "q", (1, 2))]
    record = PromptGroupRecord(3, prompt, {"ground_truth": "4"}, {"source": "x"}, [completion(1.0), completion(0.0)],
                               {"rollout/reward/mean": 0.5})
    assert record.prompt_idx == 3 and record.extra_env_info == {"ground_truth": "4"}
    assert record.metadata == {"source": "x"} and record.rollout_metrics == {"rollout/reward/mean": 0.5}
    assert record.prompt == tuple(prompt) and isinstance(record.completions, tuple)
    assert record.loss_multiplier == 1.0
    assert record.agent_name == "a"  # taken from the completions when not given
    assert PromptGroupRecord(0, (), {}, {}, [completion(1.0, "a"), completion(1.0, "b")], {}).agent_name == ""
    assert PromptGroupRecord(0, (), {}, {}, [], {}, 0.0, "z").loss_multiplier == 0.0
    for bad in (-1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match=r"prompt 0: loss_multiplier must be a finite float >= 0"):
            PromptGroupRecord(0, (), {}, {}, [], {}, bad)


def test_grpo_weights_each_groups_loss_by_its_loss_multiplier():
    from nemo_rl_ext.grpo.loop import weight_by_loss_multiplier

    records = [
        PromptGroupRecord(0, (), {}, {}, [completion(1.0), completion(0.0)], {}, loss_multiplier=0.0),
        PromptGroupRecord(1, (), {}, {}, [completion(1.0), completion(0.0)], {}),
        PromptGroupRecord(2, (), {}, {}, [completion(1.0), completion(0.0)], {}, loss_multiplier=0.5),
    ]
    batch = build_training_batch(records)
    weighted = weight_by_loss_multiplier(batch, records)
    masks = [item.loss_mask for item in weighted.items]
    expected_generated = torch.tensor([0.0, 0.0, 1.0, 1.0])  # prompt ids (1, 2) untrained, generated (4, 5)
    for i, mask in enumerate(masks):
        group_multiplier = records[i // 2].loss_multiplier
        torch.testing.assert_close(mask, expected_generated * group_multiplier)
    assert torch.equal(weighted.advantages, batch.advantages)  # advantages stay per group
    same = [PromptGroupRecord(0, (), {}, {}, [completion(1.0)], {})]
    one = build_training_batch(same)
    assert weight_by_loss_multiplier(one, same) is one
