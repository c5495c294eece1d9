"""What a failure inside one rollout does: retries, timeouts, and record-or-raise."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

logger = logging.getLogger(__name__)
T = TypeVar("T")
_NO_DEADLINE: contextlib.nullcontext[None] = contextlib.nullcontext()
"""`async with` it is a no-op; it holds no state, so every call without a deadline shares it."""


class RolloutError(RuntimeError):
    """A rollout failed and the fault policy says to fail fast."""


class FaultPolicy(BaseModel):
    """How rollouts treat exceptions and hangs (per generation and per environment step)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    on_error: Literal["record", "raise"] = Field(
        default="record",
        description="record: the rollout becomes an error completion and the others carry on; raise: fail fast.",
    )
    generation_timeout_s: float | None = Field(default=None, gt=0, description="Limit per generation call.")
    env_step_timeout_s: float | None = Field(
        default=300.0, gt=0, description="Limit per environment step; past it the rollout fails (None: no limit)."
    )
    generation_retries: int = Field(default=2, ge=0, description="Extra attempts for a failed generation.")
    retry_backoff_s: float = Field(default=0.5, ge=0, description="First retry delay; doubles each retry.")

    async def call_generation(self, make_call: Callable[[], Awaitable[T]], what: str) -> T:
        """Run a generation with the timeout, retrying transient failures with exponential backoff.

        ValueError means bad input and is never retried.
        """
        try:
            async with self.generation_deadline():  # in this task: no task per call
                return await make_call()
        except ValueError:
            raise
        except Exception as exc:
            return await self.retry_generation(make_call, what, exc)

    async def retry_generation(self, make_call: Callable[[], Awaitable[T]], what: str, failed: Exception) -> T:
        """The retries of a generation whose first attempt raised `failed` (not a ValueError): up to
        `generation_retries` more attempts, `retry_backoff_s` apart and doubling; the last failure is raised.
        The turn loop makes a turn's first attempt itself (no coroutine between it and the engine) and calls this
        when it fails, so both ways retry alike."""
        delay = self.retry_backoff_s
        for attempt in range(1, self.generation_retries + 1):
            logger.warning("%s failed (%s: %s); retry %d in %.2fs", what, type(failed).__name__, failed, attempt, delay)
            await asyncio.sleep(delay)
            delay *= 2
            try:
                async with self.generation_deadline():
                    return await make_call()
            except ValueError:
                raise
            except Exception as exc:
                failed = exc
        raise failed

    def generation_deadline(self) -> asyncio.Timeout | contextlib.nullcontext[None]:
        """The deadline of one generation call, as `async with policy.generation_deadline(): await ...`; with no
        `generation_timeout_s`, one shared no-op context (nothing allocated per call)."""
        return _NO_DEADLINE if self.generation_timeout_s is None else asyncio.timeout(self.generation_timeout_s)

    async def call_env(self, call: Awaitable[T]) -> T:
        """Run one environment step with its timeout (in this task: no task per step, as `wait_for` makes)."""
        async with self.env_deadline():
            return await call

    def env_deadline(self) -> asyncio.Timeout:
        """The deadline of one environment step, as `async with policy.env_deadline(): await env.step(...)` (what
        `call_env` does, without a coroutine of its own: the turn loop keeps thousands of steps in flight)."""
        return asyncio.timeout(self.env_step_timeout_s)


async def gather_or_cancel(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Await all concurrently; if one raises, cancel the others and re-raise (nothing keeps running)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def describe(exc: BaseException) -> str:
    """A short, readable error string for a completion's `error` field."""
    if isinstance(exc, TimeoutError):
        return "TimeoutError: timed out"
    return f"{type(exc).__name__}: {exc}"[:500]
