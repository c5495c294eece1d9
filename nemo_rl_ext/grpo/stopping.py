"""Stopping a training loop on SIGTERM / Ctrl-C at a safe point: `lifecycle.graceful_stop` plus an event loop.

    stop = LoopStop(runner.get_loop(), timeout_s=600, what="the training step in progress")
    with stop:
        ...
        records = runner.run(stop.unless_stopped(collect()))   # raises Stopped as soon as a stop is requested
        train(records)                                         # never cut: checked with stop.requested after

The first signal does not interrupt anything: it sets `requested` and wakes the waits that `unless_stopped`
guards (rollouts, validation), which cancel what they await and raise `Stopped`. Work outside them (a
training step) runs to its end; the loop then checkpoints and stops itself. A second signal, or
`timeout_s` after the first, stops at once (see `lifecycle`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from nemo_rl_ext.lifecycle import graceful_stop

T = TypeVar("T")


class Stopped(Exception):
    """A stop request cut a wait guarded by `LoopStop.unless_stopped`."""


class LoopStop:
    """A `graceful_stop` block whose request also wakes `loop` (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, timeout_s: float, what: str, name: str) -> None:
        self.loop = loop
        self._event = asyncio.Event()
        self._block = graceful_stop(self._wake, timeout_s=timeout_s, what=what, name=name)

    @property
    def requested(self) -> bool:
        """True once a stop was requested."""
        return self._block.requested

    def _wake(self) -> None:
        """From the signal handler: set the event on the loop's thread (the loop may be running or not)."""
        try:
            self.loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop is closed: nothing waits on it
            pass

    async def unless_stopped(self, awaitable: Awaitable[T]) -> T:
        """Await `awaitable` on `loop`, but cancel it and raise `Stopped` as soon as a stop is requested."""
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self._event.wait())
        try:
            if not self.requested:
                await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise Stopped
        return task.result()

    def __enter__(self) -> LoopStop:
        self._block.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._block.__exit__(*exc)
