"""NeMo-RL's records and later API on our RolloutManager: its `DatumSpec` dicts, the documented
`_generate_response` return, and the 2026 keywords `timeouts`, `retry_policy`, `mask_env_flagged_samples`
and `set_weight_version`. Expected values are written out here from NeMo-RL's definitions (its
`nemo_rl/data/interfaces.py` and `nemo_rl/experience/rollout_manager.py`), not read off our outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from test_gym_rollouts import PROMPT, gym_datum, gym_manager
from test_native_rollouts import TOOL_SCRIPT, ScriptedPolicy, datum, manager
from test_rollout_api import StopEnv

from nemo_rl_ext.data.records import Message, StopReason
from nemo_rl_ext.environments.tool_env import ToolCalculatorEnvironment
from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.experience.native_rollouts import AsyncRolloutImpl
from nemo_rl_ext.experience.rollout_manager import RolloutManager, RolloutRetryPolicy, RolloutTimeouts
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.testing import Fault, ScriptedEnvironment

GYM_ONLY = {"agent_urls": {"agent_alpha": "http://127.0.0.1:9"}, "serve_policy": False}
"""Gym settings for constructing a Gym manager (nothing is contacted until a rollout runs)."""


def nemo_rl_datum(ours, **extra) -> dict:
    """NeMo-RL's row for our datum `ours`, as its math data processor builds one: messages as dicts whose
    `token_ids` are 1-D int64 tensors, `length` the sum of their lengths, `loss_multiplier` 1.0."""
    log = [{"role": m.role, "content": m.content, "token_ids": torch.tensor(m.token_ids)} for m in ours.message_log]
    row = {"message_log": log, "length": sum(len(m.token_ids) for m in ours.message_log),
           "extra_env_info": dict(ours.extra_env_info), "loss_multiplier": 1.0, "idx": ours.idx,
           "task_name": ours.task_name}
    return {**row, **extra}


def gym_manager_with(tok, **options) -> RolloutManager:
    return RolloutManager(tok, None, 1, 1024, None, None, GenerationConfig(), True, gym_config=GYM_ONLY, **options)


def native_manager_with(tok, **options) -> RolloutManager:
    return manager(tok, ScriptedPolicy(tok, TOOL_SCRIPT), ToolCalculatorEnvironment(), counts=1, **options)


# ---- NeMo-RL's DatumSpec dicts --------------------------------------------------------------------


async def test_a_nemo_rl_datum_dict_rolls_out_as_our_datum_does(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    ours = datum(tok, idx=7)
    ids = list(ours.message_log[0].token_ids)
    row = nemo_rl_datum(ours, loss_multiplier=0.0, source="gsm8k")  # an extra key, as NeMo-RL's __extra__ allows
    from_dict = await native_manager_with(tok).run_rollout(row)
    from_ours = await native_manager_with(tok).run_rollout(ours)
    assert from_dict.prompt_idx == 7 and [list(m.token_ids) for m in from_dict.prompt] == [ids]
    assert from_dict.prompt[0].role == "user" and from_dict.prompt[0].content == ours.message_log[0].content
    assert dict(from_dict.extra_env_info) == {"ground_truth": "17"}
    assert from_dict.loss_multiplier == 0.0  # the row's weight in the loss reaches its record
    assert dict(from_dict.metadata) == {"length": len(ids), "source": "gsm8k"}  # keys we have no field for
    assert from_dict.completions == from_ours.completions  # the same scripted rollout, token for token
    assert from_dict.completions[0].reward == 1.0 and from_dict.completions[0].num_turns == 3
    # token ids as plain lists, and a datum without loss_multiplier 0, work the same
    listed = nemo_rl_datum(ours)
    listed["message_log"] = [{**m, "token_ids": m["token_ids"].tolist()} for m in listed["message_log"]]
    record = await native_manager_with(tok).run_rollout(listed)
    assert record.completions == from_ours.completions and record.loss_multiplier == 1.0


async def test_run_rollouts_and_stream_rollouts_take_nemo_rl_dicts_too(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    rows = [nemo_rl_datum(datum(tok, idx=i)) for i in (4, 2)]
    records, _ = await native_manager_with(tok).run_rollouts(rows, progress=False)
    assert [r.prompt_idx for r in records] == [4, 2]
    streamed = [r async for r in native_manager_with(tok).stream_rollouts(rows)]
    assert sorted(r.prompt_idx for r in streamed) == [2, 4]


async def test_a_nemo_rl_datums_stop_strings_apply_to_each_turn_the_environment_names_none_for(
    tiny_model_and_tokenizer,
):
    _, tok = tiny_model_and_tokenizer
    policy = ScriptedPolicy(tok, TOOL_SCRIPT)
    mgr = manager(tok, policy, ToolCalculatorEnvironment(), counts=1)
    await mgr.run_rollout(nemo_rl_datum(datum(tok), stop_strings=["</answer>"]))
    # the calculator environment names no stop strings: NeMo-RL keeps the row's for every turn
    assert [c.config.stop_strings for c in policy.calls] == [("</answer>",)] * 3
    # the environment's own stop strings win for the turn after it names them
    stop_policy = ScriptedPolicy(tok, ["one<|im_end|>", "two<|im_end|>"])
    mgr = manager(tok, stop_policy, StopEnv(), counts=1)
    await mgr.run_rollout(nemo_rl_datum(datum(tok, task="echo"), stop_strings=["</answer>"]))
    assert [c.config.stop_strings for c in stop_policy.calls] == [("</answer>",), ("STOP",)]


async def test_a_wrong_datum_shape_is_one_error_naming_every_missing_key(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    policy = ScriptedPolicy(tok, TOOL_SCRIPT)
    mgr = manager(tok, policy, ToolCalculatorEnvironment(), counts=1)
    row = nemo_rl_datum(datum(tok, idx=3))
    for key in ("length", "loss_multiplier", "task_name"):
        del row[key]
    with pytest.raises(ValueError) as err:
        await mgr.run_rollout(row)
    assert str(err.value) == "NeMo-RL DatumSpec (idx 3): missing key(s) 'length', 'loss_multiplier', 'task_name'"
    bad = nemo_rl_datum(datum(tok, idx=3), loss_multiplier=-1.0)
    bad["message_log"] = [{"role": "user", "content": "q"},
                          {"role": "user", "content": "q", "token_ids": torch.ones(2, 2, dtype=torch.long)},
                          {"role": "user", "content": "q", "token_ids": torch.tensor([1.5, 2.0])}]
    with pytest.raises(ValueError) as err:
        await mgr.run_rollout(bad)
    message = str(err.value)
    assert "message_log[0]: missing key(s) 'token_ids'" in message
    assert "message_log[1].token_ids must hold ints (a 1-D tensor or list), got [1, 1]" in message
    assert "message_log[2].token_ids must hold ints (a 1-D tensor or list), got 1.5" in message
    assert "loss_multiplier must be a finite number >= 0, got -1.0" in message
    with pytest.raises(TypeError, match="expected a DatumSpec or a NeMo-RL DatumSpec dict, got list"):
        await mgr.run_rollout([row])
    assert policy.calls == []  # nothing was generated for a bad row


async def test_nemo_rls_gym_datum_with_its_placeholder_prompt_rolls_out_through_gym(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    ours = gym_datum(0, "agent_alpha")
    # NeMo-RL's nemo_gym_data_processor: a placeholder message with an empty (float) tensor, length 0
    row = {"extra_env_info": dict(ours.extra_env_info), "loss_multiplier": 0.5, "idx": 0, "task_name": "nemo_gym",
           "message_log": [{"role": "user", "content": "", "token_ids": torch.tensor([])}], "length": 0}
    mgr = gym_manager(tok, agents, 2)
    try:
        record = await mgr.run_rollout(row)
    finally:
        await mgr.shutdown()
    assert len(record.completions) == 2 and record.agent_name == "agent_alpha"
    assert record.prompt[0].token_ids == tuple(PROMPT) and record.loss_multiplier == 0.5


# ---- _generate_response: NeMo-RL's documented return -------------------------------------------------


async def test_an_override_flagging_truncation_as_nemo_rl_does_makes_the_rollout_truncated(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    reply = tuple(tok("cut off", add_special_tokens=False)["input_ids"])

    class Truncating(AsyncRolloutImpl):
        async def _generate_response(self, message_log, stop_strings):
            message = Message("assistant", "cut off", reply, (-1.0,) * len(reply))
            lengths = torch.tensor([sum(len(m.token_ids) for m in message_log)], dtype=torch.int32)
            return message, lengths, {"_response_truncated": torch.tensor([True])}

    impl = Truncating(tok, {"echo": StopEnv()}, 1, 1024, ScriptedPolicy(tok, TOOL_SCRIPT))
    c = (await impl.run_rollout(datum(tok, task="echo"))).completions[0]
    # StopEnv ends after its second step; the last turn hit a length limit, so the rollout is truncated
    assert c.num_turns == 2 and c.truncated and c.stop_reason is StopReason.TRUNCATED
    assert [m.token_ids for m in c.message_log if m.role == "assistant"] == [reply, reply]


async def test_an_override_that_wraps_the_default_changes_what_the_rollout_keeps(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    lengths_seen = []

    class Misreporting(AsyncRolloutImpl):
        async def _generate_response(self, message_log, stop_strings):
            message, input_lengths, metrics = await super()._generate_response(message_log, stop_strings)
            lengths_seen.append(int(input_lengths[0]))
            return Message("assistant", message.content.replace("17", "18"), message.token_ids,
                           message.generation_logprobs, message.generation_weight_versions), input_lengths, metrics

    impl = Misreporting(tok, {"calc": ToolCalculatorEnvironment()}, 1, 1024, ScriptedPolicy(tok, TOOL_SCRIPT))
    c = (await impl.run_rollout(datum(tok))).completions[0]
    assistant = [m for m in c.message_log if m.role == "assistant"]
    # the environment graded the overridden answer: 18 is wrong (the default rollout scores 1.0)
    assert len(assistant) == 3 and assistant[-1].content == "So the answer is \\boxed{18}."
    assert c.reward == 0.0 and c.stop_reason is StopReason.NATURAL
    # input_lengths: the ids before each turn, read off the message log by hand
    before, context = [], 0
    for m in c.message_log:
        if m.role == "assistant":
            before.append(context)
        context += len(m.token_ids)
    assert lengths_seen == before


# ---- timeouts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForeignTimeouts:
    """Stands in for NeMo-RL's own `RolloutTimeouts` instance (same field names, another class)."""

    rollout_s: float | None = None
    generation_s: float | None = None
    env_s: float | None = None


@pytest.mark.parametrize("given", [RolloutTimeouts(generation_s=12.5, env_s=7.0),
                                   ForeignTimeouts(generation_s=12.5, env_s=7.0),
                                   {"generation_s": 12.5, "env_s": 7.0}], ids=["ours", "nemo_rl_like", "dict"])
def test_timeouts_set_the_generation_and_environment_deadlines(tiny_model_and_tokenizer, given):
    _, tok = tiny_model_and_tokenizer
    policy = native_manager_with(tok, timeouts=given).fault_policy
    assert (policy.generation_timeout_s, policy.env_step_timeout_s) == (12.5, 7.0)
    assert policy.generation_retries == FaultPolicy().generation_retries  # untouched


def test_a_timeout_left_none_keeps_our_deadline(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    policy = native_manager_with(tok, timeouts=RolloutTimeouts(generation_s=3.0)).fault_policy
    assert policy.generation_timeout_s == 3.0 and policy.env_step_timeout_s == 300.0  # ours, not "no deadline"


async def test_the_environment_deadline_from_timeouts_ends_a_hung_step(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    hung = ScriptedEnvironment(fault=lambda step: Fault.HANG)
    mgr = manager(tok, ScriptedPolicy(tok, TOOL_SCRIPT), hung, counts=2, timeouts=RolloutTimeouts(env_s=0.2))
    start = time.monotonic()
    record = await mgr.run_rollout(datum(tok))
    assert time.monotonic() - start < 30  # 0.2 s per step; generous for a loaded machine
    assert [(c.stop_reason, c.error) for c in record.completions] == [(StopReason.ERROR, "TimeoutError: timed out")] * 2


async def test_the_generation_deadline_from_timeouts_ends_a_slow_generation(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    slow = ScriptedPolicy(tok, TOOL_SCRIPT, delay_s=60.0)
    mgr = manager(tok, slow, ToolCalculatorEnvironment(), counts=1, timeouts=RolloutTimeouts(generation_s=0.2),
                  retry_policy=RolloutRetryPolicy.single_attempt())
    start = time.monotonic()
    c = (await mgr.run_rollout(datum(tok))).completions[0]
    assert time.monotonic() - start < 30
    assert c.stop_reason is StopReason.ERROR and c.error == "TimeoutError: timed out"


def test_timeouts_that_contradict_our_fault_policy_or_are_invalid_are_refused(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    with pytest.raises(ValueError, match=r"timeouts.env_s=20.0 contradicts fault_policy.env_step_timeout_s=10.0"):
        native_manager_with(tok, fault_policy=FaultPolicy(env_step_timeout_s=10.0), timeouts=RolloutTimeouts(env_s=20.0))
    agreed = native_manager_with(tok, fault_policy=FaultPolicy(env_step_timeout_s=10.0, on_error="raise"),
                                 timeouts=RolloutTimeouts(env_s=10.0, generation_s=5.0))
    assert (agreed.fault_policy.on_error, agreed.fault_policy.generation_timeout_s) == ("raise", 5.0)
    with pytest.raises(ValueError, match=r"timeouts.env_s: Input should be greater than 0 \(got -1.0\)"):
        native_manager_with(tok, timeouts=RolloutTimeouts(env_s=-1.0))


def test_a_gym_group_deadline_is_not_implemented(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    with pytest.raises(NotImplementedError, match=r"timeouts.rollout_s .*gym_config.row_timeout_s"):
        gym_manager_with(tok, timeouts=RolloutTimeouts(rollout_s=60.0))
    # native rollouts ignore it, as NeMo-RL's native implementation does (only its Gym one reads it)
    assert native_manager_with(tok, timeouts=RolloutTimeouts(rollout_s=60.0)).fault_policy == FaultPolicy()


# ---- retry_policy -----------------------------------------------------------------------------------


def test_retry_policy_sets_generation_retries_backoff_and_gym_row_attempts(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    retry = RolloutRetryPolicy(max_infra_attempts=3, max_data_attempts=1, max_gym_row_attempts=4, backoff_base_s=0.25)
    native = native_manager_with(tok, retry_policy=retry).fault_policy
    assert (native.generation_retries, native.retry_backoff_s) == (2, 0.25)  # 3 attempts = 1 + 2 retries
    gym = gym_manager_with(tok, retry_policy=retry)
    assert gym.impl.gym.max_attempts == 4
    assert gym.fault_policy.generation_retries == 2  # the same budget; Gym rows never call it
    with pytest.raises(ValueError, match=r"retry_policy.max_gym_row_attempts=4 contradicts gym_config.max_attempts=1"):
        RolloutManager(tok, None, 1, 1024, None, None, GenerationConfig(), True,
                       gym_config={**GYM_ONLY, "max_attempts": 1}, retry_policy=retry)


@pytest.mark.parametrize(("attempts", "failures", "error"), [(3, 2, None), (2, 2, "ConnectionError: engine hiccup"),
                                                             (1, 1, "ConnectionError: engine hiccup")])
async def test_max_infra_attempts_is_how_often_a_failing_generation_is_tried(
    tiny_model_and_tokenizer, attempts, failures, error
):
    _, tok = tiny_model_and_tokenizer
    policy = ScriptedPolicy(tok, TOOL_SCRIPT, failures=failures)  # the first `failures` calls raise
    retry = RolloutRetryPolicy.single_attempt(max_infra_attempts=attempts, backoff_base_s=0.01)
    mgr = manager(tok, policy, ToolCalculatorEnvironment(), counts=1, retry_policy=retry)
    c = (await mgr.run_rollout(datum(tok))).completions[0]
    # 3 attempts outlast 2 failures (the third answers); 2 attempts do not, nor does 1 attempt one failure
    assert c.error == error
    assert c.stop_reason is (StopReason.NATURAL if error is None else StopReason.ERROR)


def test_retry_budgets_we_do_not_have_are_named_in_one_not_implemented_error(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    shipped = RolloutRetryPolicy(max_infra_attempts=5, max_data_attempts=2, max_gym_row_attempts=3,
                                 max_skipped_prompts=1, max_consecutive_dropped_prompts=3)
    with pytest.raises(NotImplementedError) as err:
        native_manager_with(tok, retry_policy=shipped)
    message = str(err.value)
    for name in ("retry_policy.max_data_attempts=2", "retry_policy.max_skipped_prompts=1",
                 "retry_policy.max_consecutive_dropped_prompts=3"):
        assert name in message
    # 5 attempts from 1 s: retries wait 1, 2, 4, 8 s; a cap of 4 s would shorten the last, 30 s none
    with pytest.raises(NotImplementedError, match=r"retry_policy.max_backoff_s=4.0 .* longest delay here would be 8s"):
        native_manager_with(tok, retry_policy=RolloutRetryPolicy.single_attempt(max_infra_attempts=5, max_backoff_s=4.0))
    capped = RolloutRetryPolicy.single_attempt(max_infra_attempts=5, max_backoff_s=8.0)
    assert native_manager_with(tok, retry_policy=capped).fault_policy.generation_retries == 4
    with pytest.raises(ValueError, match="max_infra_attempts must be an int >= 1, got 0"):
        native_manager_with(tok, retry_policy={"max_infra_attempts": 0, "max_data_attempts": 1,
                                               "max_gym_row_attempts": 1})
    with pytest.raises(ValueError, match="retry_policy: missing max_gym_row_attempts"):
        native_manager_with(tok, retry_policy={"max_infra_attempts": 1, "max_data_attempts": 1})
    with pytest.raises(ValueError, match=r"timeouts: unknown key\(s\) env_timeout \(known: rollout_s, generation_s, env_s\)"):
        native_manager_with(tok, timeouts={"env_timeout": 5.0})


# ---- mask_env_flagged_samples ------------------------------------------------------------------------


def test_masking_env_flagged_gym_samples_is_not_implemented_and_false_is_what_we_do(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    with pytest.raises(NotImplementedError, match=r"mask_env_flagged_samples=True"):
        gym_manager_with(tok, mask_env_flagged_samples=True)
    assert gym_manager_with(tok, mask_env_flagged_samples=False).use_nemo_gym
    # NeMo-RL's native implementation ignores it; so does ours
    assert native_manager_with(tok, mask_env_flagged_samples=True).fault_policy == FaultPolicy()


# ---- set_weight_version ------------------------------------------------------------------------------


async def test_set_weight_version_tags_each_record_with_the_version_at_its_start_and_end(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    holder = {}

    class RefitMidway(ScriptedPolicy):
        """Its first call stands for a trainer that refits while the group is being generated."""

        async def generate_async(self, prompt_token_ids, config):
            if len(self.calls) == 0:
                holder["manager"].set_weight_version(4)
            return await super().generate_async(prompt_token_ids, config)

    mgr = manager(tok, RefitMidway(tok, TOOL_SCRIPT), ToolCalculatorEnvironment(), counts=1)
    holder["manager"] = mgr
    untagged = await native_manager_with(tok).run_rollout(datum(tok))
    assert not any(k.startswith("rollout/weight_version") for k in untagged.rollout_metrics)  # never set: no tags
    mgr.set_weight_version(3)
    record = await mgr.run_rollout(datum(tok))
    assert record.rollout_metrics["rollout/weight_version/start"] == 3.0
    assert record.rollout_metrics["rollout/weight_version/end"] == 4.0
    record = await mgr.run_rollout(datum(tok))  # no refit during this one
    assert (record.rollout_metrics["rollout/weight_version/start"], record.rollout_metrics["rollout/weight_version/end"]
            ) == (4.0, 4.0)
    for bad in (1.5, True, "3"):
        with pytest.raises(TypeError):
            mgr.set_weight_version(bad)
    assert mgr.weight_version == 4
