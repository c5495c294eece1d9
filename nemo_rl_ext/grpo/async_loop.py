"""The asynchronous GRPO loop (`grpo.async.enabled`): `AsyncLoop` runs the steps of a `GRPO` run while its
`AsyncCollector` keeps groups in flight, training and refitting on one worker thread.

Every step refits the engine (`in_flight` says what happens to the generations in flight), even one without an
optimizer step, so that the policy version is the step count. A checkpoint skips the rows in flight or waiting
(`data_state` counts them as drawn): a resumed run never replays a group that may have wedged the run.

A stop request cuts the wait for a step's groups; a training step in progress finishes (not its refit: a
resumed engine loads the checkpoint's weights), then the last whole step is checkpointed with the rows in
flight or waiting at the request as skipped.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from nemo_rl_ext.data.records import PromptGroupRecord
from nemo_rl_ext.experience.prompt_length import PromptLengthWarning, count_prompts_too_long
from nemo_rl_ext.experience.rollout_manager import RolloutManager, batch_metrics
from nemo_rl_ext.grpo.async_collector import AsyncCollector, TakenStep
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.prompt_stream import PromptStream
from nemo_rl_ext.grpo.step_seeds import TRAIN_SALT, SaltedGeneration
from nemo_rl_ext.grpo.stopping import Stopped
from nemo_rl_ext.grpo.trackers import sample_rows
from nemo_rl_ext.models.generation.interfaces import InFlightPolicy

T = TypeVar("T")


class SteppedRun(Protocol):
    """What `AsyncLoop` uses of the run it steps (`loop.GRPO`): its parts, its step count, and the pieces of a step
    that the synchronous loop runs too (training, refit, validation, logging and checkpointing, the stop request).
    Declared here so that this module does not import the loop that imports it."""

    cfg: GRPOConfig
    step: int
    manager: RolloutManager
    train_data: PromptStream
    generation: SaltedGeneration
    _prompt_length_warning: PromptLengthWarning
    _samples: list[list[Any]]

    def save(self, extra: Mapping[str, Any] | None = None) -> Path: ...
    def _stopping(self) -> bool: ...
    async def _unless_stopped(self, awaitable: Awaitable[T]) -> T: ...
    def _train_records(self, records: Sequence[PromptGroupRecord], metrics: dict[str, float]) -> None: ...
    def _cluster_metrics(self, metrics: dict[str, float]) -> None: ...
    def _validates_now(self) -> bool: ...
    async def _validate(self) -> dict[str, float]: ...
    def _refit(self, in_flight: InFlightPolicy) -> dict[str, float]: ...
    def _end_step(self, metrics: dict[str, float], start: float, history: list[dict[str, float]], bar: Any,
                  checkpoint_extra: Mapping[str, Any] | None = None) -> None: ...


class AsyncLoop:
    """The asynchronous steps of `grpo` from its current step to `grpo.max_num_steps`; `run` runs them."""

    def __init__(self, grpo: SteppedRun, history: list[dict[str, float]], bar: Any) -> None:
        settings = grpo.cfg.grpo
        self.grpo = grpo
        self.history = history
        """The step metrics, appended to as each step ends."""
        self.bar = bar
        """The progress bar."""
        self.knobs = settings.async_
        self.collector = AsyncCollector(
            grpo.manager, grpo.train_data, self.knobs, per_step=settings.num_prompts_per_step, version=grpo.step,
            offset=grpo.step - grpo.generation.weight_version, salt_prefix=TRAIN_SALT,
            dynamic=settings.dynamic_sampling, measures_tokens=grpo.manager.records_token_versions, advantages=settings,
        )
        grpo.generation.salt = (TRAIN_SALT, grpo.step + 1, 0)  # requests outside a group's scope (nemo_gym)
        self.loop = asyncio.get_running_loop()
        threads = torch.get_num_threads()  # the trainer thread computes as the main thread would
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="grpo-trainer", initializer=torch.set_num_threads,
                                           initargs=(threads,))
        self.skipped: list[int] | None = None
        """The rows drawn and not trained when a stop was requested (then the collector is closed)."""

    async def run(self) -> None:
        """Run the steps; on a stop request, checkpoint the last whole step (see the module docstring)."""
        grpo, max_steps = self.grpo, self.grpo.cfg.grpo.max_num_steps
        self.collector.start()
        try:
            while grpo.step < max_steps:
                start = time.perf_counter()
                try:
                    taken = await grpo._unless_stopped(self.collector.take(final=grpo.step + 1 == max_steps))
                except Stopped:
                    break
                await self._step(taken, start)
                if grpo._stopping():
                    return
            if grpo._stopping() and grpo.step > 0:  # stopped while waiting for a step's groups
                await self._close_for_stop()
                grpo.save({"async": {"policy_version": grpo.step, "skipped_rows": self.skipped}})
        finally:
            await self.collector.aclose()
            self.executor.shutdown(wait=True)

    async def _close_for_stop(self) -> None:
        if self.skipped is None:
            self.skipped = self.collector.pending_rows()
            await self.collector.aclose()  # also frees the requests a refit in "finish" mode waits for

    async def _step(self, taken: TakenStep, start: float) -> None:
        """Train on the groups `taken`, refit, validate when due, and end the step (checkpointed when stopping)."""
        grpo = self.grpo
        rollout_done = time.perf_counter()
        records = [g.record for g in taken.groups]
        grpo._samples = sample_rows(records, grpo.cfg.logger.num_sample_rollouts)
        metrics = batch_metrics(taken.generated, rollout_done - start)
        too_long, longest = count_prompts_too_long(taken.generated)
        grpo._prompt_length_warning(too_long, len(taken.generated), longest)
        metrics.update(taken.metrics)
        # never cut: it updates the weights and the optimizer state on the trainer's thread
        await self.collector.guard(self.loop.run_in_executor(self.executor, grpo._train_records, records, metrics))
        train_done = time.perf_counter()
        if not grpo._stopping():
            await self._refit(metrics)
        refit_done = time.perf_counter()
        grpo.step += 1
        self.collector.set_version(grpo.step)
        grpo.generation.salt = (TRAIN_SALT, grpo.step + 1, 0)
        grpo._cluster_metrics(metrics)
        metrics["timing/rollout_s"] = rollout_done - start
        metrics["timing/train_s"] = train_done - rollout_done
        metrics["timing/refit_s"] = refit_done - train_done
        if grpo._validates_now() and not grpo._stopping():
            await self._validate(metrics)
        if grpo._stopping():
            await self._close_for_stop()
        pending = self.skipped if self.skipped is not None else self.collector.pending_rows()
        extra = {"async": {"policy_version": grpo.step, "skipped_rows": pending}}
        grpo._end_step(metrics, start, self.history, self.bar, extra)  # checkpoints it when stopping

    async def _refit(self, metrics: dict[str, float]) -> None:
        """Refit the engine on the trainer's thread; a stop request meanwhile closes the collector (the refit
        finishes)."""
        refit = self.loop.run_in_executor(
            self.executor, functools.partial(self.grpo._refit, in_flight=self.knobs.in_flight)
        )
        try:
            metrics.update(await self.grpo._unless_stopped(self.collector.guard(asyncio.shield(refit))))
        except Stopped:
            await self._close_for_stop()
            metrics.update(await refit)

    async def _validate(self, metrics: dict[str, float]) -> None:
        """Validate (cut by a stop request), then restore the next step's seed salt."""
        grpo = self.grpo
        try:
            metrics.update(await grpo._unless_stopped(self.collector.guard(grpo._validate())))
        except Stopped:
            pass
        grpo.generation.salt = (TRAIN_SALT, grpo.step + 1, 0)
