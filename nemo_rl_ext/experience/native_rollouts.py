"""AsyncRolloutImpl: the native multi-turn rollout loop, generate -> environment step -> ..., in-process.

NeMo-RL's documented API: `AsyncRolloutImpl(tokenizer, task_to_env, num_generations_per_prompt, max_seq_len,
policy_generation, max_rollout_turns=999999, **kwargs)` and `run_rollout(input_sample)`, with its hooks as the
extension points a subclass overrides: `_run_single_rollout` (one rollout), `_generate_response` (one model
turn, returning NeMo-RL's `(assistant_message, input_lengths, gen_metrics)`; ours with the turn's finish reason
and weight versions is `_generate_turn`) and `_aggregate_rollout_metrics` (the group's metrics).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Any

import torch

from nemo_rl_ext.data.chat import ObservationFormatter
from nemo_rl_ext.data.generation_counts import GenerationCounts
from nemo_rl_ext.data.nemo_rl_datum import message_from_nemo_rl
from nemo_rl_ext.data.records import (
    Completion,
    DatumSpec,
    Message,
    PromptGroupRecord,
    RewardComponentError,
    StopReason,
    check_reward_components,
)
from nemo_rl_ext.environments.interfaces import EnvironmentInterface
from nemo_rl_ext.experience.fault_policy import FaultPolicy, RolloutError, describe, gather_or_cancel
from nemo_rl_ext.experience.prompt_length import too_long_extras
from nemo_rl_ext.experience.rollout_impl import NO_CALL, RolloutCall, RolloutImpl, RolloutSetup
from nemo_rl_ext.experience.rollout_metrics import rollout_metrics
from nemo_rl_ext.experience.rollout_params import TokenizerType, check_common_parameters
from nemo_rl_ext.models.generation.interfaces import (
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
)

_MAX_EMPTY_ABORTS = 8
"""Consecutive aborted pieces without a token after which a turn gives up (updates that never let it run)."""

TURN_OUTPUT_KEY = "_turn_output"
"""Key of `_generate_response`'s metrics that carries the turn's `TurnOutput` to the turn loop (popped there,
as NeMo-RL's loop pops `_response_truncated`)."""


@dataclass(frozen=True, slots=True)
class TurnOutput:
    """One model turn's output: the engine's output, or the pieces of one cut by weight updates, joined."""

    output_ids: tuple[int, ...]
    """Every generated id, over all pieces."""
    logprobs: tuple[float, ...]
    """The logprob of each id, under the weights it was generated with."""
    versions: tuple[int, ...]
    """The weight version each id was generated under."""
    finish_reason: FinishReason
    """Why the last piece ended (never ABORTED unless the budget ran out with it)."""
    matched_stop: str | int | None = None
    """The stop string or id that ended the last piece, if any."""
    aborted: int = 0
    """How many pieces a weight update aborted (each continued from prompt + the ids so far)."""

    @property
    def truncated(self) -> bool:
        """True when a length limit ended the turn."""
        return self.finish_reason.truncated


def rollout_seed(base: int | None, prompt_idx: int, sample_idx: int, turn: int) -> int | None:
    """A distinct, reproducible seed per (prompt, sample, turn); None stays unseeded."""
    if base is None:
        return None
    return (base * 1_000_003 + prompt_idx * 10_007 + sample_idx * 101 + turn) % (2**31 - 1)


@dataclass(slots=True)  # no per-rollout __dict__: thousands are alive at once (bench/overhead.py)
class _Rollout:
    """The mutable state of one rollout while its turns run.

    It holds as few objects as it can: every one is scanned by each full garbage collection while the rollout
    runs, and a batch keeps thousands of rollouts in flight (docs/benchmarks.md, "Native overhead")."""

    datum: DatumSpec
    sample_idx: int
    messages: list[Message]
    num_tokens: int
    """The ids in `messages` (a count: the prompt of each turn is built from the messages themselves)."""
    env_metadata: Mapping[str, Any]
    stop_strings: tuple[str, ...] | None = None
    reward: float = 0.0
    turns: int = 0
    answer: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    components: dict[str, float] | None = None
    """The reward's named parts summed over turns; None until a step reports any."""
    generation_s: float = 0.0
    env_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def finish(self, stop_reason: StopReason, truncated: bool, error: str | None = None) -> Completion:
        """The completion, with the rollout's wall time so far as `latency_s`."""
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
            latency_s=time.perf_counter() - self.started,
            reward_components={} if error or self.components is None else dict(self.components),
        )

    def add_components(self, env: str, step_components: Sequence[Mapping[str, float]] | None) -> None:
        """Sum this step's reward components into the rollout's (a step without any adds nothing;
        `RewardComponentError` naming `env` and the field when one is not a finite number)."""
        if step_components is None:
            return
        parts = check_reward_components(env, step_components[0])
        if self.components is None:
            self.components = {}
        for name, value in parts.items():
            self.components[name] = self.components.get(name, 0.0) + value


_CURRENT_ROLLOUT: ContextVar[_Rollout | None] = ContextVar("nemo_rl_ext_rollout", default=None)
"""The rollout of the running task, set by `_run_single_rollout`, so that `_generate_response(message_log,
stop_strings)` keeps NeMo-RL's signature (an override calls `super()` with those two) and still gets a distinct
seed per (prompt, sample, turn) (see docs/architecture.md, "Per-call state")."""


class AsyncRolloutImpl(RolloutImpl):
    """Manages per-prompt multi-turn rollouts: each `run_rollout` runs a prompt's N rollouts concurrently.

    `num_generations_per_prompt` is an int or a per-agent dict (`_default` as fallback); `max_rollout_turns`
    None means no limit. Ours, as keyword arguments: `generation_config` (sampling; its seed is made distinct
    per prompt, sample and turn) and `fault_policy` (retries, timeouts, record-or-raise).
    """

    def __init__(
        self,
        tokenizer: TokenizerType,
        task_to_env: Mapping[str, EnvironmentInterface],
        num_generations_per_prompt: int | Mapping[str, int] | GenerationCounts,
        max_seq_len: int,
        policy_generation: GenerationInterface,
        max_rollout_turns: int | None = 999999,
        *,
        generation_config: GenerationConfig | None = None,
        fault_policy: FaultPolicy | None = None,
    ) -> None:
        counts, problems = check_common_parameters(num_generations_per_prompt, max_seq_len)
        if max_rollout_turns is not None and (
            isinstance(max_rollout_turns, bool) or not isinstance(max_rollout_turns, int) or max_rollout_turns < 1
        ):
            problems.append(f"max_rollout_turns must be None or an int >= 1, got {max_rollout_turns!r}")
        if policy_generation is None:
            problems.append("policy_generation is required: the GenerationInterface that rollouts call")
        if not task_to_env:
            problems.append("task_to_env is required for native rollouts (use_nemo_gym=False)")
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))
        self.tokenizer = tokenizer
        self.task_to_env = task_to_env
        self.num_generations_per_prompt = num_generations_per_prompt
        self._counts: GenerationCounts = counts
        self.max_seq_len = max_seq_len
        self.policy_generation = policy_generation
        self.max_rollout_turns = max_rollout_turns
        self.generation_config = generation_config or GenerationConfig()
        self.fault_policy = fault_policy or FaultPolicy()
        self.formatter = ObservationFormatter(tokenizer)

    @classmethod
    def from_setup(cls, setup: RolloutSetup) -> AsyncRolloutImpl:
        """The native mode of a RolloutManager (`rollout_impl.RolloutSetup`)."""
        return cls(
            setup.tokenizer, setup.task_to_env, setup.num_generations_per_prompt, setup.max_seq_len,
            setup.policy_generation, setup.max_rollout_turns, generation_config=setup.generation_config,
            fault_policy=setup.fault_policy,
        )

    @property
    def counts(self) -> GenerationCounts:
        """The per-agent sample counts (the constructor's `num_generations_per_prompt`, parsed)."""
        return self._counts

    @property
    def environments(self) -> Mapping[str, EnvironmentInterface]:
        """`task_to_env`: the environments the turn loop steps."""
        return self.task_to_env

    async def run_rollout(self, input_sample: DatumSpec, *, call: RolloutCall = NO_CALL) -> PromptGroupRecord:
        """Run the prompt's N rollouts (N from `call`'s counts, else the mode's) concurrently; one record of N
        completions."""
        self._environment(input_sample)  # an unknown task is the row's error, before anything runs
        n = call.counts_or(self._counts).for_agent(input_sample.agent)
        start = time.perf_counter()
        results = await gather_or_cancel(self._run_single_rollout(input_sample, i) for i in range(n))
        completions = [completion for completion, _ in results]
        metrics = dict(self._aggregate_rollout_metrics(completions, [m for _, m in results]))
        metrics["rollout/wall_time_s"] = time.perf_counter() - start
        return PromptGroupRecord(
            prompt_idx=input_sample.idx,
            prompt=input_sample.message_log,
            extra_env_info=input_sample.extra_env_info,
            metadata=input_sample.metadata,
            completions=tuple(completions),
            rollout_metrics=metrics,
            loss_multiplier=input_sample.loss_multiplier,
            agent_name=input_sample.agent,
        )

    # ---- the hooks ------------------------------------------------------------------------------

    async def _run_single_rollout(self, input_sample: DatumSpec, traj_idx: int) -> tuple[Completion, dict[str, float]]:
        """Run rollout number `traj_idx` of the prompt to its end; returns the completion and its metrics.

        A failure becomes an error completion (`fault_policy.on_error="record"`) or raises `RolloutError`.
        The completion carries the rollout's wall time (`latency_s`), errors included.
        The metrics: `prompt_messages`, `generation_time_s`, `env_time_s` (read by `_aggregate_rollout_metrics`).
        """
        env = self._environment(input_sample)
        state = _Rollout(
            datum=input_sample,
            sample_idx=traj_idx,
            messages=list(input_sample.message_log),
            num_tokens=sum(len(m.token_ids) for m in input_sample.message_log),
            env_metadata=dict(input_sample.extra_env_info),
            stop_strings=input_sample.stop_strings,
        )
        try:
            completion = await self._turn_loop(state, env)
        except RewardComponentError:  # the environment's contract, not a fault of this rollout: never recorded
            raise
        except Exception as exc:
            if self.fault_policy.on_error == "raise":
                raise RolloutError(f"row {input_sample.idx}, sample {traj_idx}: {describe(exc)}") from exc
            completion = state.finish(StopReason.ERROR, truncated=False, error=describe(exc))
        metrics = {
            "prompt_messages": float(len(input_sample.message_log)),
            "generation_time_s": state.generation_s,
            "env_time_s": state.env_s,
        }
        return completion, metrics

    async def _generate_response(
        self, message_log: Sequence[Message], stop_strings: Sequence[str] | None
    ) -> tuple[Message, torch.Tensor, dict[str, Any]]:
        """One model turn after `message_log`, as NeMo-RL documents it: (the assistant message, the prompt's
        length as a 1-element int32 tensor, the turn's metrics). The turn loop calls this hook, so an override
        changes every turn; it may return our `Message` or NeMo-RL's message dict (`role`, `content`,
        `token_ids`, `generation_logprobs`). Ours, `_generate_turn`, does the work; its `TurnOutput` (finish
        reason, weight versions) rides in the metrics under `TURN_OUTPUT_KEY`."""
        message, output, metrics = await self._generate_turn(message_log, stop_strings)
        length = metrics.get("input_tokens")
        if length is None:  # an override of `_generate_turn` that does not count them
            length = sum(len(m.token_ids) for m in message_log)
        input_lengths = torch.tensor([int(length)], dtype=torch.int32)
        return message, input_lengths, {**metrics, TURN_OUTPUT_KEY: output}

    def _generate_turn(
        self, message_log: Sequence[Message], stop_strings: Sequence[str] | None
    ) -> Awaitable[tuple[Message, TurnOutput, dict[str, float]]]:
        """One model turn after `message_log`: (the assistant message, the turn's output, the turn's metrics).

        The prompt is the log's token ids as they are (never re-tokenized); `max_new_tokens` is capped by
        the room left under `max_seq_len`; `stop_strings` (None: the generation config's) end the turn.
        Inside a rollout the request's seed is distinct per (prompt, sample, turn). A generation that a weight
        update aborts is continued on the new weights (`_generate_continuing`): the message holds every piece,
        with the weight version of each id. (Awaitable: the rollout it runs for, when the hooks are overridden, is
        the one `_next_turn_through_hook` set.)
        """
        return self._turn(message_log, stop_strings, _CURRENT_ROLLOUT.get())

    async def _turn(
        self, message_log: Sequence[Message], stop_strings: Sequence[str] | None, rollout: _Rollout | None
    ) -> tuple[Message, TurnOutput, dict[str, float]]:
        """`_generate_turn` for `rollout` (None: a turn outside any rollout, with the config's own seed)."""
        # a tuple of ints: the garbage collector stops tracking it at its first pass, a list it scans every time
        prompt = tuple(chain.from_iterable(m.token_ids for m in message_log))
        config, what = self._turn_request(message_log, len(prompt), stop_strings, rollout)
        start = time.perf_counter()
        try:  # the first attempt here, not in a coroutine of the fault policy's: thousands of turns are in flight
            if self.fault_policy.generation_timeout_s is None:  # (not even a no-op `async with` held per turn)
                first = await self.policy_generation.generate_async(prompt, config)
            else:
                async with self.fault_policy.generation_deadline():
                    first = await self.policy_generation.generate_async(prompt, config)
        except ValueError:  # bad input: never retried
            raise
        except Exception as exc:
            request = partial(self.policy_generation.generate_async, prompt, config)
            first = await self.fault_policy.retry_generation(request, what, exc)
        if _ends_turn(first, config):  # the usual case: one piece, no lists to join
            output = TurnOutput(tuple(first.output_ids), tuple(first.logprobs),
                                (first.weight_version,) * len(first.output_ids), first.finish_reason, first.matched_stop)
        else:
            output = await self._generate_continuing(prompt, config, what, first)
        elapsed = time.perf_counter() - start
        text = self.tokenizer.decode(output.output_ids, skip_special_tokens=True)
        message = Message("assistant", text, output.output_ids, output.logprobs, output.versions)
        metrics = {"generation_time_s": elapsed, "input_tokens": float(len(prompt)),
                   "output_tokens": float(len(output.output_ids)), "aborted_pieces": float(output.aborted)}
        return message, output, metrics

    def _turn_request(
        self, message_log: Sequence[Message], prompt_len: int, stop_strings: Sequence[str] | None,
        rollout: _Rollout | None,
    ) -> tuple[GenerationConfig, str]:
        """The config of the turn's request (room-capped `max_new_tokens`, the rollout's seed and session, the stop
        strings) and its name in logs and errors. A function of its own, so that none of the temporaries stays
        alive in the turn's frame while the engine works."""
        room = self.max_seq_len - prompt_len
        if room <= 0:
            raise ValueError(f"the message log holds {prompt_len} tokens: no room under max_seq_len={self.max_seq_len}")
        base = self.generation_config.seed
        update: dict[str, Any] = {"max_new_tokens": min(self.generation_config.max_new_tokens, room)}
        if rollout is None:
            update["seed"], what = base, "generation"
        else:
            prompt_idx, sample_idx = rollout.datum.idx, rollout.sample_idx
            turn = sum(m.role == "assistant" for m in message_log[len(rollout.datum.message_log) :])
            update["seed"] = rollout_seed(base, prompt_idx, sample_idx, turn)
            update["session"] = (prompt_idx, sample_idx)  # a replica pool keeps its turns together
            what = f"generation for row {prompt_idx}, sample {sample_idx}, turn {turn}"
        if stop_strings is not None:
            update["stop_strings"] = tuple(stop_strings)
        return self.generation_config.model_copy(update=update), what

    async def _generate_continuing(
        self, prompt: tuple[int, ...], config: GenerationConfig, what: str, first: GenerationOutput
    ) -> TurnOutput:
        """Continue a generation that a weight update aborted (`first`, its first piece): the request is re-issued
        with prompt + the ids so far and the remaining budget (its seed moved on by the ids so far), until it
        ends for another reason or the budget is spent; the pieces join into one output."""
        ids: list[int] = list(first.output_ids)
        logprobs: list[float] = list(first.logprobs)
        versions: list[int] = [first.weight_version] * len(first.output_ids)
        aborted, empty, out = 1, 0 if first.output_ids else 1, first
        while not _ends_turn(out, config, len(ids)):
            if empty >= _MAX_EMPTY_ABORTS:
                raise RuntimeError(f"{what}: {empty} weight updates in a row aborted it before its first token")
            out = await self.fault_policy.call_generation(self._continuation(prompt, config, ids), what)
            ids.extend(out.output_ids)
            logprobs.extend(out.logprobs)
            versions.extend([out.weight_version] * len(out.output_ids))
            if not _ends_turn(out, config, len(ids)):
                aborted += 1
                empty = 0 if out.output_ids else empty + 1
        return TurnOutput(tuple(ids), tuple(logprobs), tuple(versions), out.finish_reason, out.matched_stop, aborted)

    def _continuation(
        self, prompt: tuple[int, ...], config: GenerationConfig, ids: list[int]
    ) -> Callable[[], Awaitable[GenerationOutput]]:
        """The request that continues a turn after its `ids` so far: prompt + ids, the remaining budget, the seed
        moved on by the ids so far (the turn's own request again while no id came back)."""
        if not ids:
            return partial(self.policy_generation.generate_async, prompt, config)
        update: dict[str, Any] = {"max_new_tokens": config.max_new_tokens - len(ids)}
        if config.seed is not None:
            update["seed"] = (config.seed * 1_000_003 + len(ids)) % (2**31 - 1)
        return partial(self.policy_generation.generate_async, [*prompt, *ids], config.model_copy(update=update))

    def _aggregate_rollout_metrics(
        self, completions: Sequence[Completion], all_sample_metrics: Sequence[Mapping[str, float]]
    ) -> dict[str, float]:
        """The group's flat metrics: `rollout_metrics` of the completions, plus the mean generation and
        environment seconds per rollout (`run_rollout` adds the group's wall time)."""
        prompt_lens = [int(m.get("prompt_messages", 0)) for m in all_sample_metrics]
        metrics = rollout_metrics(completions, prompt_lens)
        if all_sample_metrics:
            n = len(all_sample_metrics)
            metrics["rollout/generation_time_s/mean"] = sum(m.get("generation_time_s", 0.0) for m in all_sample_metrics) / n
            metrics["rollout/env_time_s/mean"] = sum(m.get("env_time_s", 0.0) for m in all_sample_metrics) / n
        return metrics

    # ---- the turn loop --------------------------------------------------------------------------

    def _turn_result(self, message: Message | Mapping[str, Any], gen_metrics: dict[str, Any]) -> tuple[Message, TurnOutput]:
        """`_generate_response`'s message as our `Message`, and the turn's output: ours from the metrics, or, from an
        override that made its own, one read off the message (NeMo-RL's `_response_truncated` flag: truncated;
        else EOS when its last id is the tokenizer's EOS)."""
        if not isinstance(message, Message):
            message = message_from_nemo_rl(message, "_generate_response's assistant message")
        output = gen_metrics.pop(TURN_OUTPUT_KEY, None)
        if isinstance(output, TurnOutput):
            return message, output
        flag = gen_metrics.pop("_response_truncated", None)
        ids = message.token_ids
        if flag is not None and bool(flag[0] if isinstance(flag, Sequence | torch.Tensor) else flag):
            reason = FinishReason.MAX_NEW_TOKENS
        elif ids and ids[-1] == self.tokenizer.eos_token_id:
            reason = FinishReason.EOS
        else:
            reason = FinishReason.STOP_STRING
        versions = message.generation_weight_versions or ()
        return message, TurnOutput(ids, message.generation_logprobs or (), versions, reason)

    def _environment(self, input_sample: DatumSpec) -> EnvironmentInterface:
        env = self.task_to_env.get(input_sample.task_name)
        if env is None:
            raise ValueError(
                f"row {input_sample.idx}: task_name {input_sample.task_name!r} has no environment in task_to_env "
                f"(known: {sorted(self.task_to_env)})"
            )
        return env

    def _next_turn(self, state: _Rollout) -> Awaitable[tuple[Message, TurnOutput, dict[str, Any]]]:
        """The rollout's next model turn through the `_generate_response` hook; straight to the turn, with the
        rollout passed (no NeMo-RL `input_lengths` tensor, no ContextVar, no coroutine of its own between the loop
        and the engine), when no subclass overrides that hook or `_generate_turn`."""
        cls = type(self)
        if cls._generate_response is AsyncRolloutImpl._generate_response and (
            cls._generate_turn is AsyncRolloutImpl._generate_turn
        ):
            return self._turn(tuple(state.messages), state.stop_strings, state)
        return self._next_turn_through_hook(state)

    async def _next_turn_through_hook(self, state: _Rollout) -> tuple[Message, TurnOutput, dict[str, Any]]:
        # NeMo-RL's hook signatures carry no rollout: ours reach it through the ContextVar (docs/architecture.md)
        token = _CURRENT_ROLLOUT.set(state)
        try:
            message, _, gen_metrics = await self._generate_response(tuple(state.messages), state.stop_strings)
        finally:
            _CURRENT_ROLLOUT.reset(token)
        message, output = self._turn_result(message, gen_metrics)
        return message, output, gen_metrics

    async def _turn_loop(self, state: _Rollout, env: EnvironmentInterface) -> Completion:
        while True:
            room = self.max_seq_len - state.num_tokens
            if room <= 0:
                if state.turns == 0:  # the prompt alone fills the context: counted and warned about
                    state.extras.update(too_long_extras(state.num_tokens, self.max_seq_len))
                return state.finish(StopReason.TRUNCATED, truncated=True)
            message, output, gen_metrics = await self._next_turn(state)
            state.generation_s += gen_metrics.get("generation_time_s", 0.0)
            state.turns += 1
            state.messages.append(message)
            state.num_tokens += len(message.token_ids)

            start = time.perf_counter()
            try:
                async with self.fault_policy.env_deadline():
                    step = await env.step([tuple(state.messages)], [state.env_metadata])
            finally:
                state.env_s += time.perf_counter() - start
            state.reward += float(step.rewards[0])
            state.add_components(state.datum.task_name, step.reward_components)
            state.env_metadata = step.metadata[0] if step.metadata[0] is not None else state.env_metadata
            state.answer = step.answers[0] if step.answers[0] is not None else state.answer
            stops = step.next_stop_strings[0]
            state.stop_strings = state.datum.stop_strings if stops is None else stops  # None: the row's again
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
            room = self.max_seq_len - state.num_tokens
            if len(obs_ids) >= room:  # no room left to generate after it: cut it and stop
                if room > 0:
                    content = self.tokenizer.decode(obs_ids[:room], skip_special_tokens=True)
                    state.messages.append(Message(observation.role, content, tuple(obs_ids[:room])))
                    state.num_tokens += room
                return state.finish(StopReason.TRUNCATED, truncated=True)
            state.messages.append(Message(observation.role, observation.content, tuple(obs_ids)))
            state.num_tokens += len(obs_ids)


def _ends_turn(out: GenerationOutput, config: GenerationConfig, generated: int | None = None) -> bool:
    """True when a piece ends the turn: it ended for another reason than a weight update's abort, or the turn's
    `generated` ids (default: the piece's) spent the budget."""
    n = len(out.output_ids) if generated is None else generated
    return out.finish_reason is not FinishReason.ABORTED or n >= config.max_new_tokens
