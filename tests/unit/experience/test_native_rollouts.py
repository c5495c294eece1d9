"""RolloutManager with the native implementation: turn loop, token prefixes, counts, faults, limits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from nemo_rl_ext.data.datasets import datum_from_messages
from nemo_rl_ext.data.generation_counts import GenerationCountError
from nemo_rl_ext.data.records import Completion, StopReason
from nemo_rl_ext.environments.interfaces import Observation
from nemo_rl_ext.environments.tool_env import ToolCalculatorEnvironment
from nemo_rl_ext.experience.fault_policy import FaultPolicy, RolloutError
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig, GenerationOutput
from nemo_rl_ext.models.generation.hf_backend import HfGeneration
from nemo_rl_ext.testing import Fault, RolloutStep, ScriptedEnvironment, ScriptedGeneration

# ---- test doubles ---------------------------------------------------------------------------------


class ScriptedPolicy(ScriptedGeneration):
    """Answers turn k of every rollout with script[k] (real token ids); records every call; the first
    `failures` calls raise ConnectionError."""

    def __init__(self, tokenizer, script: Sequence[str], delay_s: float = 0.0, failures: int = 0) -> None:
        super().__init__(tokenizer, list(script), delay_s=delay_s)
        self.script = [self.encode(s) for s in script]
        self.failures = failures

    async def generate_async(self, prompt_token_ids, config: GenerationConfig) -> GenerationOutput:
        if self.failures:
            self.failures -= 1
            raise ConnectionError("engine hiccup")
        return await super().generate_async(prompt_token_ids, config)


class EchoEnv(ScriptedEnvironment):
    """Never terminates; answers each turn with a user message; reward 0.25 per step."""

    def __init__(self, raise_on_sample: int | None = None, hang_on_sample: int | None = None) -> None:
        def fault(step: RolloutStep) -> BaseException | Fault | None:
            sample = step.metadata.get("sample")
            if sample is not None and sample == raise_on_sample:
                return RuntimeError("env exploded")
            if sample is not None and sample == hang_on_sample:
                return Fault.HANG
            return None

        def calls(step: RolloutStep) -> int:
            return step.metadata.get("calls", 0) + 1

        super().__init__(
            turns=None, reward=0.25, fault=fault,
            observation=lambda s: Observation("user", f"continue please, step {calls(s)}"),
            metadata=lambda s: {**s.metadata, "calls": calls(s)},
        )


class SampleTaggingEnv(EchoEnv):
    """EchoEnv that learns its sample index from the order of first calls (to target one rollout)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.seen = 0

    async def step(self, message_logs, metadata):
        if "sample" not in metadata[0]:
            metadata = [{**metadata[0], "sample": self.seen}]
            self.seen += 1
        return await super().step(message_logs, metadata)


def call_pairs(policy: ScriptedGeneration) -> list[tuple[list[int], tuple[int, ...]]]:
    """(prompt ids, generated ids) of every answered call of `policy`."""
    return [(c.prompt_token_ids, c.output.output_ids) for c in policy.calls if c.output is not None]


def prompt_ids_per_turn(completion: Completion) -> list[tuple[list[int], tuple[int, ...]]]:
    """(prompt ids, generated ids) of each assistant turn, read off the message log."""
    turns, context = [], []
    for m in completion.message_log:
        if m.role == "assistant":
            turns.append((list(context), m.token_ids))
        context.extend(m.token_ids)
    return turns


def assert_token_exact(completion: Completion, calls: list[tuple[list[int], tuple[int, ...]]]) -> None:
    """Each turn's prompt is what the policy received, and starts with the previous prompt + generation."""
    turns = prompt_ids_per_turn(completion)
    assert turns, "no assistant turn"
    for prompt, generated in turns:
        assert (prompt, generated) in calls
    for (prev_prompt, prev_gen), (prompt, _) in zip(turns, turns[1:], strict=False):
        assert prompt[: len(prev_prompt) + len(prev_gen)] == prev_prompt + list(prev_gen)


def manager(tokenizer, policy, env, counts=2, **kwargs) -> RolloutManager:
    return RolloutManager(
        tokenizer=tokenizer,
        task_to_env={"calc": env, "echo": env},
        num_generations_per_prompt=counts,
        max_seq_len=kwargs.pop("max_seq_len", 1024),
        policy_generation=policy,
        generation_config=kwargs.pop("generation_config", GenerationConfig(max_new_tokens=64, seed=0)),
        **kwargs,
    )


def datum(tokenizer, idx=0, task="calc", agent=None, question="What is 3*4 + 5?", answer="17"):
    return datum_from_messages(
        tokenizer,
        idx,
        [{"role": "user", "content": question}],
        task_name=task,
        extra_env_info={"ground_truth": answer},
        agent_name=agent,
    )


TOOL_SCRIPT = [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+5"}}\n</tool_call><|im_end|>',
    "So the answer is \\boxed{17}.<|im_end|>",
]

# ---- the turn loop --------------------------------------------------------------------------------


async def test_three_turn_tool_rollout(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    policy = ScriptedPolicy(tok, TOOL_SCRIPT)
    record = await manager(tok, policy, ToolCalculatorEnvironment(), counts=2).run_rollout(datum(tok))
    assert len(record.completions) == 2
    for c in record.completions:
        assert [m.role for m in c.message_log] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert c.message_log[2].content.strip() == "12"
        assert c.message_log[4].content.strip() == "17"
        assert "\\boxed{17}" in c.message_log[5].content
        assert c.reward == 1.0 and c.num_turns == 3
        assert c.stop_reason is StopReason.NATURAL and not c.truncated and c.error is None
        assert c.env_extras["answer"] is not None and "17" in c.env_extras["answer"]
        for m in c.message_log:
            assert (m.generation_logprobs is not None) == (m.role == "assistant")
        # the tool turn is framed by the chat template and decodes back to the observation
        assert tok.decode(c.message_log[2].token_ids).startswith("\n<|im_start|>tool\n")
        assert_token_exact(c, call_pairs(policy))
    assert record.rollout_metrics["rollout/reward/mean"] == 1.0
    assert record.rollout_metrics["rollout/turns/mean"] == 3.0
    assert record.rollout_metrics["agent/calc/reward/mean"] == 1.0


async def test_prefix_property_with_the_tiny_model(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    backend = HfGeneration(model, tok, max_model_len=1024)
    recording = ScriptedGeneration(tok, None, backend=backend, max_model_len=1024)  # records every call

    cfg = GenerationConfig(max_new_tokens=8, temperature=1.0, seed=1)
    mgr = manager(tok, recording, EchoEnv(), counts=3, max_rollout_turns=3, generation_config=cfg)
    try:
        record = await mgr.run_rollout(datum(tok, task="echo"))
    finally:
        backend.shutdown()
    assert len(record.completions) == 3
    for c in record.completions:
        assert c.num_turns == 3 and c.stop_reason is StopReason.MAX_TURNS
        assert c.reward == pytest.approx(0.75)
        assert_token_exact(c, call_pairs(recording))
    # distinct seeds per rollout index: the three samples differ
    assert len({c.message_log[1].token_ids for c in record.completions}) > 1


# ---- per-agent generation counts ------------------------------------------------------------------


async def test_per_agent_counts(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    mgr = manager(tok, ScriptedPolicy(tok, TOOL_SCRIPT), ToolCalculatorEnvironment(),
                  counts={"a": 3, "b": 1, "_default": 2})
    rows = [datum(tok, idx=i, agent=agent) for i, agent in enumerate(["a", "b", "c"])]
    records, metrics = await mgr.run_rollouts(rows, progress=False)
    assert [len(r.completions) for r in records] == [3, 1, 2]
    assert [r.agent_name for r in records] == ["a", "b", "c"]
    assert {c.agent_name for c in records[0].completions} == {"a"}
    assert metrics["agent/a/num_samples"] == 3 and metrics["agent/c/num_samples"] == 2
    assert metrics["rollout/num_samples"] == 6


def test_bad_counts_are_reported_together(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    with pytest.raises(ValueError) as err:
        manager(tok, ScriptedPolicy(tok, TOOL_SCRIPT), EchoEnv(), counts={"a": 0, "b": -2, "c": "x", "d": 2})
    message = str(err.value)
    assert "'a': 0" in message and "'b': -2" in message and "'c': 'x'" in message and "'d'" not in message


def test_preflight_reports_every_row_without_a_count(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    mgr = manager(tok, ScriptedPolicy(tok, TOOL_SCRIPT), EchoEnv(), counts={"a": 2})
    rows = [datum(tok, idx=i, agent=agent) for i, agent in enumerate(["a", "x", "y", "x"])]
    with pytest.raises(GenerationCountError) as err:
        mgr.preflight(rows)
    message = str(err.value)
    assert "3 row(s)" in message and "'x': rows [1, 3]" in message and "'y': rows [2]" in message


async def test_preflight_runs_before_any_generation(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    policy = ScriptedPolicy(tok, TOOL_SCRIPT)
    mgr = manager(tok, policy, EchoEnv(), counts={"a": 2})
    with pytest.raises(GenerationCountError):
        await mgr.run_rollouts([datum(tok, idx=0, agent="a"), datum(tok, idx=1, agent="zzz")], progress=False)
    assert policy.calls == []


def test_unused_count_keys_warn_once(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    mgr = manager(tok, ScriptedPolicy(tok, TOOL_SCRIPT), EchoEnv(), counts={"a": 2, "mth": 3, "_default": 1})
    with pytest.warns(UserWarning, match=r"match no row's agent: \['mth'\]"):
        mgr.preflight([datum(tok, idx=0, agent="a"), datum(tok, idx=1, agent="math")])


# ---- concurrency, faults, limits ------------------------------------------------------------------


async def test_group_rollouts_run_concurrently(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    policy = ScriptedPolicy(tok, ["thinking...<|im_end|>"], delay_s=0.2)
    mgr = manager(tok, policy, EchoEnv(), counts=8, max_rollout_turns=2)
    start = time.perf_counter()
    record = await mgr.run_rollout(datum(tok, task="echo"))
    elapsed = time.perf_counter() - start
    assert [c.num_turns for c in record.completions] == [2] * 8
    assert elapsed < 0.5 * 8 * 2 * 0.2, f"8 rollouts x 2 turns x 0.2 s took {elapsed:.2f} s"


async def test_env_exception_becomes_an_error_completion(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    mgr = manager(tok, ScriptedPolicy(tok, ["ok<|im_end|>"]), SampleTaggingEnv(raise_on_sample=1),
                  counts=4, max_rollout_turns=2)
    record = await mgr.run_rollout(datum(tok, task="echo"))
    errors = [c for c in record.completions if c.stop_reason is StopReason.ERROR]
    assert len(errors) == 1 and errors[0].error == "RuntimeError: env exploded"
    assert errors[0].reward == 0.0 and errors[0].message_log[-1].role == "assistant"
    assert [c.stop_reason for c in record.completions].count(StopReason.MAX_TURNS) == 3
    assert record.rollout_metrics["rollout/errors"] == 1.0


async def test_env_hang_times_out_into_an_error_completion(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    policy = FaultPolicy(env_step_timeout_s=0.3)
    mgr = manager(tok, ScriptedPolicy(tok, ["ok<|im_end|>"]), SampleTaggingEnv(hang_on_sample=2),
                  counts=4, max_rollout_turns=2, fault_policy=policy)
    start = time.perf_counter()
    record = await asyncio.wait_for(mgr.run_rollout(datum(tok, task="echo")), 10)
    assert time.perf_counter() - start < 5
    reasons = [c.stop_reason for c in record.completions]
    assert reasons.count(StopReason.ERROR) == 1 and reasons.count(StopReason.MAX_TURNS) == 3
    assert next(c.error for c in record.completions if c.error).startswith("TimeoutError")


async def test_fail_fast_raises(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    mgr = manager(tok, ScriptedPolicy(tok, ["ok<|im_end|>"]), SampleTaggingEnv(raise_on_sample=0),
                  counts=3, max_rollout_turns=2, fault_policy=FaultPolicy(on_error="raise"))
    with pytest.raises(RolloutError, match=r"row 0, sample \d: RuntimeError: env exploded"):
        await mgr.run_rollout(datum(tok, task="echo"))


async def test_generation_errors_are_retried_then_recorded(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    retrying = FaultPolicy(generation_retries=2, retry_backoff_s=0.01)
    policy = ScriptedPolicy(tok, TOOL_SCRIPT, failures=2)
    record = await manager(tok, policy, ToolCalculatorEnvironment(), counts=1,
                           fault_policy=retrying).run_rollout(datum(tok))
    assert record.completions[0].reward == 1.0
    exhausted = FaultPolicy(generation_retries=1, retry_backoff_s=0.01)
    policy = ScriptedPolicy(tok, TOOL_SCRIPT, failures=2)
    record = await manager(tok, policy, ToolCalculatorEnvironment(), counts=1,
                           fault_policy=exhausted).run_rollout(datum(tok))
    assert record.completions[0].stop_reason is StopReason.ERROR
    assert record.completions[0].error == "ConnectionError: engine hiccup"


async def test_max_seq_len_truncates_the_observation(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    d = datum(tok, task="echo")
    prompt_len = sum(len(m.token_ids) for m in d.message_log)
    policy = ScriptedPolicy(tok, ["ok<|im_end|>"])
    gen_len = len(policy.script[0])
    mgr = manager(tok, policy, EchoEnv(), counts=1, max_seq_len=prompt_len + gen_len + 3)
    c = (await mgr.run_rollout(d)).completions[0]
    assert c.stop_reason is StopReason.TRUNCATED and c.truncated
    assert len(c.token_ids) == prompt_len + gen_len + 3
    assert c.message_log[-1].role == "user" and len(c.message_log[-1].token_ids) == 3


async def test_max_seq_len_truncates_the_generation(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    d = datum(tok)
    prompt_len = sum(len(m.token_ids) for m in d.message_log)
    mgr = manager(tok, ScriptedPolicy(tok, TOOL_SCRIPT), ToolCalculatorEnvironment(), counts=1,
                  max_seq_len=prompt_len + 4)
    c = (await mgr.run_rollout(d)).completions[0]
    assert c.stop_reason is StopReason.TRUNCATED and c.truncated
    assert len(c.token_ids) == prompt_len + 4 and c.num_turns == 1


async def test_max_rollout_turns_stops_the_loop(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    mgr = manager(tok, ScriptedPolicy(tok, TOOL_SCRIPT), ToolCalculatorEnvironment(), counts=1,
                  max_rollout_turns=2)
    c = (await mgr.run_rollout(datum(tok))).completions[0]
    assert c.stop_reason is StopReason.MAX_TURNS and c.num_turns == 2 and not c.truncated
    assert c.reward == 0.0 and c.message_log[-1].role == "assistant"


ABORTED = FinishReason.ABORTED


def aborting_policy(tok, pieces: Sequence[GenerationOutput]) -> ScriptedGeneration:
    """Answers call j with pieces[j]; a weight update comes with the second call (its pieces carry version 1)."""

    def reply(request):
        if request.index == 1:
            policy.update_weights({})
        return pieces[request.index]

    policy = ScriptedGeneration(tok, reply)
    return policy


async def test_a_turn_aborted_by_weight_updates_continues_into_one_message(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    eos = tok.eos_token_id
    pieces = [GenerationOutput((11, 12), (-0.1, -0.2), ABORTED), GenerationOutput((), (), ABORTED),
              GenerationOutput((13, eos), (-0.3, -0.4), FinishReason.EOS, eos)]
    policy = aborting_policy(tok, pieces)
    mgr = manager(tok, policy, ScriptedEnvironment(turns=1, reward=1.0), counts=1)
    log = datum(tok).message_log
    message, _, metrics = await mgr.impl._generate_response(log, None)
    assert message.token_ids == (11, 12, 13, eos) and message.generation_logprobs == (-0.1, -0.2, -0.3, -0.4)
    assert message.generation_weight_versions == (0, 0, 1, 1) and metrics["aborted_pieces"] == 2.0
    prompt = [t for m in log for t in m.token_ids]
    # piece 2 continues after piece 1's ids; piece 3 asks again for the same, as piece 2 brought no id
    assert policy.prompts == [prompt, prompt + [11, 12], prompt + [11, 12]]
    moved_on = (0 * 1_000_003 + 2) % (2**31 - 1)
    assert [(c.seed, c.max_new_tokens) for c in policy.configs] == [(0, 64), (moved_on, 62), (moved_on, 62)]


async def test_a_turn_gives_up_after_eight_empty_aborted_pieces_in_a_row(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    policy = aborting_policy(tok, [GenerationOutput((), (), ABORTED)] * 9)
    mgr = manager(tok, policy, ScriptedEnvironment(turns=1, reward=1.0), counts=1)
    with pytest.raises(RuntimeError, match="8 weight updates in a row aborted it before its first token"):
        await mgr.impl._generate_response(datum(tok).message_log, None)
    assert policy.num_calls == 8


def test_manager_reports_every_bad_argument(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    with pytest.raises(ValueError) as err:
        RolloutManager(tok, {}, num_generations_per_prompt=0, max_seq_len=0, max_rollout_turns=0)
    message = str(err.value)
    for part in ("max_seq_len", "max_rollout_turns", "policy_generation", "task_to_env", ">= 1, got 0"):
        assert part in message


async def test_unknown_task_names_the_row(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    mgr = manager(tok, ScriptedPolicy(tok, TOOL_SCRIPT), EchoEnv())
    with pytest.raises(ValueError, match=r"row 7: task_name 'nope' has no environment"):
        await mgr.run_rollout(datum(tok, idx=7, task="nope"))
