"""AsyncRolloutImpl: the native multi-turn rollout loop, generate -> environment step -> ..., in-process."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.environments.interfaces import EnvironmentInterface
from nemo_rl_ext.experience.chat_format import ObservationFormatter
from nemo_rl_ext.experience.fault_policy import FaultPolicy, RolloutError, describe, gather_or_cancel
from nemo_rl_ext.experience.generation_counts import GenerationCounts
from nemo_rl_ext.experience.records import Completion, DatumSpec, Message, PromptGroupRecord, StopReason
from nemo_rl_ext.experience.rollout_metrics import rollout_metrics
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationInterface, GenerationOutput


def rollout_seed(base: int | None, prompt_idx: int, sample_idx: int, turn: int) -> int | None:
    """A distinct, reproducible seed per (prompt, sample, turn); None stays unseeded."""
    if base is None:
        return None
    return (base * 1_000_003 + prompt_idx * 10_007 + sample_idx * 101 + turn) % (2**31 - 1)


@dataclass
class _Rollout:
    """The mutable state of one rollout while its turns run."""

    datum: DatumSpec
    sample_idx: int
    messages: list[Message]
    token_ids: list[int]
    env_metadata: Mapping[str, Any]
    stop_strings: tuple[str, ...] | None = None
    reward: float = 0.0
    turns: int = 0
    answer: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def finish(self, stop_reason: StopReason, truncated: bool, error: str | None = None) -> Completion:
        extras = {**self.extras, "answer": self.answer, "sample_idx": self.sample_idx}
        return Completion(
            message_log=tuple(self.messages),
            reward=0.0 if error else self.reward,
            truncated=truncated,
            stop_reason=stop_reason,
            num_turns=self.turns,
            agent_name=self.datum.agent,
            env_extras=extras,
            error=error,
        )


class AsyncRolloutImpl:
    """Runs the N rollouts of a prompt concurrently, each one a turn loop over the token ids."""

    def __init__(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase,
        task_to_env: Mapping[str, EnvironmentInterface],
        counts: GenerationCounts,
        max_seq_len: int,
        max_rollout_turns: int | None,
        policy_generation: GenerationInterface,
        generation_config: GenerationConfig,
        fault_policy: FaultPolicy,
    ) -> None:
        self.tokenizer = tokenizer
        self.task_to_env = task_to_env
        self.counts = counts
        self.max_seq_len = max_seq_len
        self.max_rollout_turns = max_rollout_turns
        self.policy = policy_generation
        self.config = generation_config
        self.faults = fault_policy
        self.formatter = ObservationFormatter(tokenizer)

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord:
        """Roll out one prompt N times (N from the per-agent counts) and score every rollout."""
        env = self.task_to_env.get(datum.task_name)
        if env is None:
            raise ValueError(
                f"row {datum.idx}: task_name {datum.task_name!r} has no environment in task_to_env "
                f"(known: {sorted(self.task_to_env)})"
            )
        n = self.counts.for_agent(datum.agent)
        start = time.perf_counter()
        completions = await gather_or_cancel(self._rollout_or_error(datum, env, i) for i in range(n))
        metrics = rollout_metrics(completions, [len(datum.message_log)] * n, time.perf_counter() - start)
        return PromptGroupRecord(
            prompt_idx=datum.idx,
            prompt=datum.message_log,
            extra_env_info=datum.extra_env_info,
            agent_name=datum.agent,
            completions=tuple(completions),
            rollout_metrics=metrics,
            metadata=datum.metadata,
        )

    async def _rollout_or_error(self, datum: DatumSpec, env: EnvironmentInterface, sample_idx: int) -> Completion:
        state = _Rollout(
            datum=datum,
            sample_idx=sample_idx,
            messages=list(datum.message_log),
            token_ids=[t for m in datum.message_log for t in m.token_ids],
            env_metadata=dict(datum.extra_env_info),
        )
        try:
            return await self._turn_loop(state, env)
        except Exception as exc:
            if self.faults.on_error == "raise":
                raise RolloutError(f"row {datum.idx}, sample {sample_idx}: {describe(exc)}") from exc
            return state.finish(StopReason.ERROR, truncated=False, error=describe(exc))

    async def _turn_loop(self, state: _Rollout, env: EnvironmentInterface) -> Completion:
        while True:
            room = self.max_seq_len - len(state.token_ids)
            if room <= 0:
                return state.finish(StopReason.TRUNCATED, truncated=True)
            output = await self._generate(state, room)
            state.turns += 1
            text = self.tokenizer.decode(output.output_ids, skip_special_tokens=True)
            state.messages.append(Message("assistant", text, output.output_ids, output.logprobs))
            state.token_ids.extend(output.output_ids)

            step = await self.faults.call_env(env.step([tuple(state.messages)], [state.env_metadata]))
            state.reward += float(step.rewards[0])
            state.env_metadata = step.metadata[0] if step.metadata[0] is not None else state.env_metadata
            state.answer = step.answers[0] if step.answers[0] is not None else state.answer
            state.stop_strings = step.next_stop_strings[0]
            state.extras["env_metadata"] = state.env_metadata
            if step.extras is not None:  # e.g. the answer's maj@k vote key and its grading status
                state.extras.update(step.extras[0])
            if step.terminateds[0]:
                if output.truncated:
                    return state.finish(StopReason.TRUNCATED, truncated=True)
                return state.finish(StopReason.NATURAL, truncated=False)

            if self.max_rollout_turns is not None and state.turns >= self.max_rollout_turns:
                return state.finish(StopReason.MAX_TURNS, truncated=output.truncated)

            observation = step.observations[0]
            ended_with_eos = output.finish_reason.value == "eos"
            text = self.formatter.render(observation.role, observation.content, ended_with_eos)
            obs_ids = self.formatter.tokenize(text)
            room = self.max_seq_len - len(state.token_ids)
            if len(obs_ids) >= room:  # no room left to generate after it: cut it and stop
                if room > 0:
                    content = self.tokenizer.decode(obs_ids[:room], skip_special_tokens=True)
                    state.messages.append(Message(observation.role, content, tuple(obs_ids[:room])))
                    state.token_ids.extend(obs_ids[:room])
                return state.finish(StopReason.TRUNCATED, truncated=True)
            state.messages.append(Message(observation.role, observation.content, tuple(obs_ids)))
            state.token_ids.extend(obs_ids)

    async def _generate(self, state: _Rollout, room: int) -> GenerationOutput:
        update: dict[str, Any] = {
            "max_new_tokens": min(self.config.max_new_tokens, room),
            "seed": rollout_seed(self.config.seed, state.datum.idx, state.sample_idx, state.turns),
        }
        if state.stop_strings is not None:
            update["stop_strings"] = tuple(state.stop_strings)
        config = self.config.model_copy(update=update)
        prompt = list(state.token_ids)
        what = f"generation for row {state.datum.idx}, sample {state.sample_idx}, turn {state.turns}"
        return await self.faults.call_generation(lambda: self.policy.generate_async(prompt, config), what)
