"""RolloutManager: validates its arguments once and routes rollouts to the implementation of a named mode.

NeMo-RL's `nemo_rl.experience.rollout_manager` API, importable from here: `RolloutManager`,
`AsyncRolloutImpl`, `AsyncNemoGymRolloutImpl`, `PromptGroupRecord`, `TokenizerType`, and its 2026 additions
`RolloutTimeouts`, `RolloutRetryPolicy` (see `nemo_rl_options`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import operator
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from nemo_rl_ext.data.generation_counts import GenerationCounts
from nemo_rl_ext.data.nemo_rl_datum import as_datum
from nemo_rl_ext.data.records import DatumSpec, PromptGroupRecord
from nemo_rl_ext.distillation.scoring import TeacherScorer
from nemo_rl_ext.environments.interfaces import EnvironmentInterface
from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.experience.gym_rollouts import AsyncNemoGymRolloutImpl
from nemo_rl_ext.experience.native_rollouts import AsyncRolloutImpl
from nemo_rl_ext.experience.nemo_rl_options import RolloutRetryPolicy, RolloutTimeouts, apply_nemo_rl_options
from nemo_rl_ext.experience.prompt_length import count_prompts_too_long
from nemo_rl_ext.experience.rollout_impl import NO_CALL, RolloutCall, RolloutImpl, RolloutSetup
from nemo_rl_ext.experience.rollout_metrics import rollout_metrics, teacher_metrics
from nemo_rl_ext.experience.rollout_modes import NEMO_GYM, mode_name, rollout_mode_class
from nemo_rl_ext.experience.rollout_params import TokenizerType
from nemo_rl_ext.experience.teacher_faults import scored_or_failed
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationInterface

__all__ = [
    "AsyncNemoGymRolloutImpl",
    "AsyncRolloutImpl",
    "PromptGroupRecord",
    "RolloutCall",
    "RolloutImpl",
    "RolloutManager",
    "RolloutRetryPolicy",
    "RolloutTimeouts",
    "TokenizerType",
    "batch_metrics",
]


class RolloutManager:
    """Turns a dataset row into a `PromptGroupRecord` of N scored completions.

    `num_generations_per_prompt` is an int or a dict keyed by agent name with `_default` as fallback.
    `mode` names a registered rollout mode (`rollout_modes`): `native` runs rollouts in-process through
    `task_to_env` (`AsyncRolloutImpl`); `nemo_gym` has NeMo Gym agent servers own the turn loop and the reward
    (`AsyncNemoGymRolloutImpl`, see `gym_config`). NeMo-RL's `use_nemo_gym=True` is `mode="nemo_gym"`; with
    neither, the mode is native. The positional parameters are NeMo-RL's; `mode`, `fault_policy`, `gym_config`
    and `owned_environments` (environments `shutdown` stops: those `build_rollouts` made for this manager) are ours.
    NeMo-RL's later keywords `timeouts`, `retry_policy` and `mask_env_flagged_samples` set our fault policy and
    Gym settings, or raise NotImplementedError naming what we lack (`nemo_rl_options.apply_nemo_rl_options`).
    """

    def __init__(
        self,
        tokenizer: TokenizerType,
        task_to_env: Mapping[str, EnvironmentInterface] | None,
        num_generations_per_prompt: int | Mapping[str, int],
        max_seq_len: int,
        max_rollout_turns: int | None = None,
        policy_generation: GenerationInterface | None = None,
        generation_config: GenerationConfig | None = None,
        use_nemo_gym: bool = False,
        *,
        mode: str | None = None,
        fault_policy: FaultPolicy | None = None,
        gym_config: Any = None,
        owned_environments: Sequence[EnvironmentInterface] = (),
        timeouts: RolloutTimeouts | Any = None,
        retry_policy: RolloutRetryPolicy | Any = None,
        mask_env_flagged_samples: bool | None = None,
        teachers: TeacherScorer | None = None,
    ) -> None:
        mode = mode_name(mode, use_nemo_gym)
        fault_policy, gym_config = apply_nemo_rl_options(
            use_nemo_gym=mode == NEMO_GYM, fault_policy=fault_policy, gym_config=gym_config, timeouts=timeouts,
            retry_policy=retry_policy, mask_env_flagged_samples=mask_env_flagged_samples,
        )
        self.weight_version: int | None = None
        """The trainer's weight version (`set_weight_version`); None until set."""
        self.tokenizer = tokenizer
        self.generation_config = generation_config or GenerationConfig()
        self.fault_policy = fault_policy or FaultPolicy()
        self.mode = mode
        """The registered rollout mode this manager runs."""
        self.use_nemo_gym = mode == NEMO_GYM
        """NeMo-RL's flag: True in nemo_gym mode."""
        self.owned_environments = tuple(owned_environments)
        self.teachers = teachers
        """On-policy distillation's teachers: each finished record's completions are scored by its agent's
        teacher (`distillation.scoring`); None: no scoring."""
        setup = RolloutSetup(
            tokenizer, task_to_env, num_generations_per_prompt, max_seq_len, max_rollout_turns, policy_generation,
            self.generation_config, self.fault_policy, gym_config,
        )
        self.impl: RolloutImpl = rollout_mode_class(mode).from_setup(setup)

    @property
    def counts(self) -> GenerationCounts:
        """The per-agent sample counts (the constructor's `num_generations_per_prompt`, parsed)."""
        return self.impl.counts

    @property
    def task_to_env(self) -> Mapping[str, EnvironmentInterface] | None:
        """The environments native rollouts step (given, or built and owned by `build_rollouts`); None with
        NeMo Gym, whose agents score their own rollouts (the mode's `environments`)."""
        return self.impl.environments

    @property
    def records_token_versions(self) -> bool:
        """True when every generated token of a record carries the engine's `weight_version` (native rollouts);
        False with NeMo Gym, whose results carry none (a caller then judges a group by when it started)."""
        return self.impl.records_token_versions

    async def shutdown(self) -> None:
        """Stop servers the implementation started (the NeMo Gym path starts a policy server and Gym) and the
        environments this manager owns (a remote one's actor, and a Ray only it started), and its teachers."""
        try:
            await self.impl.shutdown()
        finally:
            for env in self.owned_environments:
                env.shutdown()
            if self.teachers is not None:
                self.teachers.close()

    def preflight(
        self, datums: Sequence[DatumSpec], counts: GenerationCounts | None = None, *, warn_unused: bool = True
    ) -> None:
        """Check a dataset before any generation: every row's agent has a count (one error for all); with
        `warn_unused`, count keys that match no row's agent give a UserWarning."""
        lazy = getattr(datums, "agent_pairs", None)  # data.sources.LazyDatums: without tokenizing every row
        pairs = lazy() if lazy is not None else ((d.idx, d.agent) for d in datums)
        (counts or self.counts).preflight(pairs, warn_unused=warn_unused)

    def request_rows(self, datums: Sequence[DatumSpec]) -> dict[int, list[dict[str, Any]]] | None:
        """Prompt index -> the request rows the implementation sends for that datum, one per sample (nemo_gym:
        the bodies of Gym's `/run`, built now, or as pinned); None when it sends none (native: the prompt is
        rendered in this process). A caller may store them and `pin_rows` them on resume."""
        return self.impl.request_rows(datums)

    def pin_rows(self, rows_by_prompt: Mapping[int, Sequence[Mapping[str, Any]]]) -> None:
        """Send exactly these rows for these prompts (`request_rows`' shape) instead of building them; ValueError
        for an implementation that sends none."""
        self.impl.pin_rows(rows_by_prompt)

    async def aggregate_metrics(
        self, results_by_agent: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> dict[str, dict[str, Any]] | None:
        """Agent -> the implementation's own aggregate of finished results (nemo_gym: Gym's `/aggregate_metrics`
        answer, or `{"error": ...}`; starts Gym if it is not running); None when it has none (native)."""
        return await self.impl.aggregate_metrics(results_by_agent)

    def set_weight_version(self, version: int) -> None:
        """Set the trainer's weight version (NeMo-RL's): records that `run_rollout` returns from now on carry the
        version at their start and end as `rollout/weight_version/start|end` in `rollout_metrics` (where NeMo-RL
        tags its replay-buffer slot). Each generated token keeps the engine's own version either way."""
        if isinstance(version, bool):
            raise TypeError(f"set_weight_version: version must be an int, got {version!r}")
        self.weight_version = operator.index(version)

    async def run_rollout(
        self, input_sample: DatumSpec | Mapping[str, Any], *, call: RolloutCall = NO_CALL
    ) -> PromptGroupRecord:
        """Roll out one prompt N times and score the completions. `input_sample` is our `DatumSpec` or NeMo-RL's
        (a dict: `message_log`, `length`, `extra_env_info`, `loss_multiplier`, `idx`, `task_name`, ...);
        `call`: per-call state (`RolloutCall`: e.g. this call's sample counts)."""
        start = self.weight_version
        record = await self.impl.run_rollout(as_datum(input_sample), call=call)
        if self.teachers is not None:
            record = await scored_or_failed(self.teachers, record, self.fault_policy)
        if start is None:
            return record
        tags = {"rollout/weight_version/start": float(start), "rollout/weight_version/end": float(self.weight_version)}
        return dataclasses.replace(record, rollout_metrics={**record.rollout_metrics, **tags})

    async def stream_rollouts(
        self,
        datums: Sequence[DatumSpec | Mapping[str, Any]],
        *,
        max_concurrent_prompts: int | None = None,
        counts: int | Mapping[str, int] | GenerationCounts | None = None,
    ) -> AsyncIterator[PromptGroupRecord]:
        """Preflight, then yield each prompt's record as soon as it is done (not in `datums` order).

        At most `max_concurrent_prompts` prompts are in flight (None: all). `counts` replaces the per-agent
        sample counts for this call only (e.g. validation with another count on the same manager and servers).
        Leaving the loop early (break, an exception, cancellation) cancels the rollouts still running.
        `datums` may also be NeMo-RL's dicts (see `run_rollout`).
        """
        datums = [as_datum(d) for d in datums]
        override = None
        if counts is not None:
            override = counts if isinstance(counts, GenerationCounts) else GenerationCounts.parse(counts)
        self.preflight(datums, override, warn_unused=False)  # a batch need not hold every agent of the data
        if not datums:
            return
        call = RolloutCall(counts=override)
        limit = asyncio.Semaphore(max_concurrent_prompts or len(datums))

        async def one(datum: DatumSpec) -> PromptGroupRecord:
            async with limit:
                return await self.run_rollout(datum, call=call)

        tasks = [asyncio.ensure_future(one(d)) for d in datums]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run_rollouts(
        self,
        datums: Sequence[DatumSpec | Mapping[str, Any]],
        *,
        progress: bool = True,
        desc: str = "rollouts",
        max_concurrent_prompts: int | None = None,
        counts: int | Mapping[str, int] | GenerationCounts | None = None,
    ) -> tuple[list[PromptGroupRecord], dict[str, float]]:
        """Every prompt's record in `datums` order (through `stream_rollouts`), and metrics over all of them."""
        datums = [as_datum(d) for d in datums]
        start = time.perf_counter()
        by_idx: dict[int, list[int]] = {}
        for i, d in enumerate(datums):
            by_idx.setdefault(d.idx, []).append(i)
        records: list[PromptGroupRecord | None] = [None] * len(datums)
        bar = tqdm(total=len(datums), desc=desc, unit="prompt", disable=not progress)
        try:
            stream = self.stream_rollouts(datums, max_concurrent_prompts=max_concurrent_prompts, counts=counts)
            async with contextlib.aclosing(stream):
                async for record in stream:
                    slot = by_idx[record.prompt_idx].pop(0)
                    records[slot] = record
                    bar.update(1)
        finally:
            bar.close()
        done = [r for r in records if r is not None]
        return done, batch_metrics(done, time.perf_counter() - start)


def batch_metrics(records: Sequence[PromptGroupRecord], wall_time_s: float) -> dict[str, float]:
    """Rollout metrics over every completion of several groups, with `rollout/num_prompts` and
    `rollout/prompts_too_long` (prompts that alone left no room to generate, see `prompt_length`)."""
    completions = [c for r in records for c in r.completions]
    prompt_lens = [len(r.prompt) for r in records for _ in r.completions]
    metrics = rollout_metrics(completions, prompt_lens, wall_time_s)
    metrics["rollout/num_prompts"] = float(len(records))
    metrics["rollout/prompts_too_long"] = float(count_prompts_too_long(records)[0])
    metrics.update(teacher_metrics(records))
    return metrics
