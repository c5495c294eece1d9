"""Faults a test double can be scripted to inject: an exception, a hang an asyncio timeout can end, or one it can't."""

from __future__ import annotations

import asyncio
import enum
import time


class Fault(enum.Enum):
    """A hang to inject where a reply or a step was expected (an exception instance is injected by raising it)."""

    HANG = "hang"
    """Await forever: the caller's deadline (or cancelling the call) ends it."""
    BLOCK = "block"
    """Block the thread for an hour (`time.sleep`): no asyncio timeout in the same process can end it, only a
    deadline outside it (a killed worker process or actor)."""


BLOCK_S = 3600.0
"""How long `Fault.BLOCK` blocks the thread."""


async def inject(fault: BaseException | Fault) -> None:
    """Raise `fault` if it is an exception, else hang as it says; never returns normally."""
    if isinstance(fault, BaseException):
        raise fault
    if fault is Fault.BLOCK:
        time.sleep(BLOCK_S)
    else:
        await asyncio.Event().wait()
    raise RuntimeError(f"injected {fault.value} ended")
