"""The collector of asynchronous GRPO: keeps groups in flight and hands finished ones to the trainer.

    collector = AsyncCollector(manager, stream, settings, per_step=8, version=step, offset=...)
    collector.start()
    taken = await collector.take()          # a step's groups; raises at once if the collector failed
    ...train, refit...
    collector.set_version(step)             # the engine now serves the next version
    await collector.aclose()

One task per group (`RolloutManager.run_rollout`), each inside a `RequestScope` (its seed salt, the oldest
weight version its outputs came back with). Admission follows `staleness.admission_budget` (AReaL's rule);
`queue_size` also stops it while that many finished groups wait. What happens to a group:

- finished, within the lag bound: waits in the queue (dynamic sampling drops one without signal on arrival,
  `batch.has_signal`);
- finished, but its oldest token is more than `max_lag` versions behind the weights that would train it:
  dropped and counted (`async/groups/dropped_stale`), also while it waits, at each version change; one
  that finished within the bound but went stale waiting (steps took other groups first) was surplus and
  also counts in `async/groups/oversampled_discarded`, as do the groups in flight or waiting after the
  last step (`take(final=True)`);
- in flight when a version change makes it certainly too stale: one of its outputs is already that old,
  or it has returned no output while more than `max_lag` versions passed since it started (counted from
  its start version, as AReaL counts staleness, so a group hung before its first token frees its slot):
  cancelled and counted (`async/groups/cancelled_stale`); a step never waits for it;
- running past `group_deadline_s`: cancelled and counted (`async/groups/deadline_expired`);
- a rollout that raises (not an error recorded as data: those are completions) fails the collector, and
  the trainer's next `take`/`guard` raises `CollectorError` at once.

A step takes `per_step` finished groups as soon as that many wait (the oldest versions first), so no step
waits on one particular group; its groups are trained in the order they were drawn from the prompt stream.
Seeds: the group drawn at stream position p runs with the salt (TRAIN_SALT, p // per_step + 1, 0), which is
the synchronous loop's salt of that prompt when steps take whole blocks (max_lag 0, no over-sampling).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.records import DatumSpec, PromptGroupRecord
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.grpo.batch import has_signal
from nemo_rl_ext.grpo.config import AsyncSettings, DynamicSamplingSettings, GRPOSettings
from nemo_rl_ext.grpo.prompt_stream import PromptStream
from nemo_rl_ext.grpo.step_seeds import REQUEST_SCOPE, RequestScope
from nemo_rl_ext.objectives.staleness import admission_budget, group_version, lag_metrics

T = TypeVar("T")

_DEADLINE = object()
"""What a group task returns when its deadline cancelled it."""


class CollectorError(RuntimeError):
    """The collector stopped: a rollout raised (the cause is chained) or it was closed."""


@dataclass(eq=False)
class _InFlight:
    """A group being rolled out."""

    position: int
    """Its position in the prompt stream (draw order)."""
    datum: DatumSpec
    """Its row."""
    start_version: int
    """The policy version when it started."""
    scope: RequestScope
    """Its salt and the oldest engine version seen so far."""
    task: asyncio.Task[Any] | None = None
    """The rollout task."""


@dataclass(frozen=True)
class FinishedGroup:
    """A group that finished and passed the checks on arrival."""

    position: int
    """Its position in the prompt stream."""
    record: PromptGroupRecord
    """The rollout's record."""
    version: int
    """The policy version of its oldest token (`staleness.group_version`)."""


@dataclass(frozen=True)
class TakenStep:
    """What one step trains on, with what the collector did since the previous step."""

    groups: tuple[FinishedGroup, ...]
    """The trained groups, in draw order (fewer than a step's worth only when dynamic sampling ran out)."""
    generated: tuple[PromptGroupRecord, ...]
    """The trained groups and the zero-variance ones dynamic sampling dropped since the last step."""
    metrics: dict[str, float] = field(default_factory=dict)
    """`async/*` and `dynamic_sampling/*` metrics of the step."""


class AsyncCollector:
    """See the module docstring. `version` is the policy version the engine serves now and `offset` turns
    the engine's `weight_version` into policy versions; `steps_taken` starts equal to `version`."""

    def __init__(
        self,
        manager: RolloutManager,
        stream: PromptStream,
        settings: AsyncSettings,
        *,
        per_step: int,
        version: int,
        offset: int,
        salt_prefix: int,
        dynamic: DynamicSamplingSettings | None = None,
        measures_tokens: bool = True,
        advantages: GRPOSettings | None = None,
    ) -> None:
        self.manager = manager
        self.stream = stream
        self.settings = settings
        self.per_step = per_step
        self.version = version
        self.steps_taken = version
        self.offset = offset
        self.salt_prefix = salt_prefix
        self.dynamic = dynamic if dynamic is not None and dynamic.enabled else None
        self.measures_tokens = measures_tokens
        self.advantages = advantages
        """The run's advantage settings, by which dynamic sampling judges a group (`batch.has_signal`)."""
        """False when the records carry no token versions (NeMo Gym): lag is then judged by start version."""
        self._in_flight: dict[asyncio.Task[Any], _InFlight] = {}
        self._ready: list[FinishedGroup] = []
        self._filtered: list[PromptGroupRecord] = []
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._counts = dict.fromkeys(
            ("started", "finished", "dropped_stale", "cancelled_stale", "deadline_expired", "oversampled_discarded"),
            0,
        )
        self._idle_s = 0.0
        self._idle_since: float | None = time.perf_counter()

    # ---- the trainer's side ----------------------------------------------------------------------

    def start(self) -> None:
        """Start admitting groups (call inside the running event loop)."""
        self._task = asyncio.create_task(self._run(), name="grpo-async-collector")

    async def take(self, *, final: bool = False) -> TakenStep:
        """Wait for a step's groups and take them (the step counts as taken); raises `CollectorError` at once
        when the collector fails. `final`: the run's last step; the groups left over (in flight or waiting)
        count as `oversampled_discarded`."""
        called = time.perf_counter()
        while True:
            self._raise_if_failed()
            self._drop_stale_ready()
            if self._step_ready():
                break
            self._changed.clear()
            await self.guard(self._changed.wait())
        self._ready.sort(key=lambda g: (g.version, g.position))  # the oldest first: they expire first
        taken = sorted(self._ready[: self.per_step], key=lambda g: g.position)
        del self._ready[: self.per_step]
        filtered, self._filtered = self._filtered, []
        lags = [self.version - g.version for g in taken]
        self.steps_taken += 1
        self._wake.set()
        if final:
            self._counts["oversampled_discarded"] += len(self._ready) + len(self._in_flight)
        now = time.perf_counter()
        idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
        self._idle_s, self._idle_since = 0.0, (now if self._idle_since is not None else None)
        metrics = lag_metrics(lags, self.settings.max_lag)
        metrics.update({f"async/groups/{k}": float(v) for k, v in self._counts.items()})
        metrics["async/groups/discarded"] = float(
            self._counts["dropped_stale"] + self._counts["cancelled_stale"] + self._counts["deadline_expired"]
        )
        metrics["async/groups/in_flight"] = float(len(self._in_flight))
        metrics["async/groups/waiting"] = float(len(self._ready))
        metrics["async/generation_idle_s"] = idle
        metrics["async/trainer_wait_s"] = now - called
        self._counts = dict.fromkeys(self._counts, 0)
        if self.dynamic is not None:
            generated = len(taken) + len(filtered)
            metrics["dynamic_sampling/gen_batches"] = generated / self.per_step
            metrics["dynamic_sampling/kept_groups"] = float(len(taken))
            metrics["dynamic_sampling/zero_variance_fraction"] = len(filtered) / generated if generated else 0.0
        records = tuple(g.record for g in taken) + tuple(filtered)
        return TakenStep(tuple(taken), records, metrics)

    def set_version(self, version: int) -> None:
        """The engine serves `version` now: drop and cancel what can no longer be trained within max_lag."""
        self.version = version
        self._drop_stale_ready()
        floor = version - self.settings.max_lag  # the oldest version a group may still hold
        for group in list(self._in_flight.values()):
            seen = group.scope.min_version
            # its oldest output's version; with none yet (or no token versions: NeMo Gym), its start version
            oldest = seen + self.offset if self.measures_tokens and seen is not None else group.start_version
            if oldest < floor and group.task is not None and not group.task.done():
                group.task.cancel()
                self._counts["cancelled_stale"] += 1
        self._wake.set()

    async def guard(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable`, but raise `CollectorError` as soon as the collector fails."""
        future = asyncio.ensure_future(awaitable)
        if self._task is None:
            return await future
        try:
            await asyncio.wait({future, self._task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            future.cancel()
            raise
        if not future.done():
            future.cancel()
            self._raise_if_failed()
        return future.result()

    def pending_rows(self) -> list[int]:
        """Rows drawn but not trained (in flight or waiting): a checkpoint skips them on resume."""
        groups = [*self._in_flight.values(), *self._ready]
        return [g.datum.idx if isinstance(g, _InFlight) else g.record.prompt_idx for g in groups]

    async def aclose(self) -> None:
        """Stop admitting and cancel every group in flight (waits until they are cancelled)."""
        tasks = [t for t in (self._task, *self._in_flight) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._in_flight.clear()

    # ---- the collector's side -------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._task is None or not self._task.done():
            return
        if self._task.cancelled():
            raise CollectorError("the asynchronous collector was cancelled")
        error = self._task.exception()
        if isinstance(error, CollectorError | ConfigError):  # a user error (e.g. a bad reward component) as is
            raise error
        raise CollectorError(f"the asynchronous collector failed: {error!r}") from error

    def _step_ready(self) -> bool:
        if len(self._ready) >= self.per_step:
            return True
        if self.dynamic is None:
            return False
        return len(self._ready) + len(self._filtered) >= self.dynamic.max_gen_batches * self.per_step

    def _drop_stale_ready(self) -> None:
        """Drop the waiting groups that became too stale (surplus: steps took others first); their budget
        slots free up, so admission runs again."""
        keep = [g for g in self._ready if self.version - g.version <= self.settings.max_lag]
        dropped = len(self._ready) - len(keep)
        if dropped:
            self._counts["dropped_stale"] += dropped
            self._counts["oversampled_discarded"] += dropped
            self._ready = keep
            self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            self._harvest()
            self._admit()
            self._changed.set()
            await self._wake.wait()

    def _admit(self) -> None:
        settings = self.settings
        budget = admission_budget(
            self.version, self.steps_taken, max_lag=settings.max_lag, per_step=self.per_step,
            oversample=settings.oversample,
        )
        while len(self._in_flight) + len(self._ready) < budget and (
            settings.queue_size is None or len(self._ready) < settings.queue_size
        ):
            position = self.stream.consumed
            (datum,) = self.stream.next(1)
            group = _InFlight(
                position, datum, self.version,
                RequestScope((self.salt_prefix, position // self.per_step + 1, 0)),
            )
            group.task = asyncio.create_task(self._rollout(group), name=f"grpo-group-{position}")
            group.task.add_done_callback(lambda _: self._wake.set())
            self._in_flight[group.task] = group
            self._counts["started"] += 1
            if self._idle_since is not None:
                self._idle_s += time.perf_counter() - self._idle_since
                self._idle_since = None

    async def _rollout(self, group: _InFlight) -> Any:
        REQUEST_SCOPE.set(group.scope)  # this task's context only
        deadline = self.settings.group_deadline_s
        if deadline is None:
            return await self.manager.run_rollout(group.datum)
        try:
            async with asyncio.timeout(deadline) as cm:
                return await self.manager.run_rollout(group.datum)
        except TimeoutError:
            if cm.expired():
                return _DEADLINE
            raise

    def _harvest(self) -> None:
        for task in [t for t in self._in_flight if t.done()]:
            group = self._in_flight.pop(task)
            if task.cancelled():  # counted where it was cancelled
                continue
            error = task.exception()
            if isinstance(error, ConfigError):  # a user error (e.g. a bad reward component): as it is, exit 2
                raise error
            if error is not None:
                raise CollectorError(
                    f"the asynchronous collector failed: the rollout of row {group.datum.idx} raised {error!r}"
                ) from error
            result = task.result()
            if result is _DEADLINE:
                self._counts["deadline_expired"] += 1
                continue
            self._counts["finished"] += 1
            record: PromptGroupRecord = result
            version = group_version(record, offset=self.offset, start_version=group.start_version)
            if self.version - version > self.settings.max_lag:
                self._counts["dropped_stale"] += 1
            elif self.dynamic is not None and not has_signal(record, self.advantages):
                self._filtered.append(record)
            else:
                self._ready.append(FinishedGroup(group.position, record, version))
        if not self._in_flight and self._idle_since is None:
            self._idle_since = time.perf_counter()
