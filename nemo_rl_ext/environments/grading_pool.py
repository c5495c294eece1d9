"""Grading in worker processes with a hard per-answer deadline: a grade that overruns is killed, not waited for.

Some answers make math-verify/sympy run for minutes (`\\binom{10000000}{5000000}`, `\\Gamma(10^9)`), and a
thread cannot be stopped, so grading runs in a pebble `ProcessPool`: each answer is one task with
`timeout=grading_timeout_s` (counted from when a worker picks it up); a worker that overruns is killed and
replaced, and the answer's `Grade` says `status="timeout"` (reward 0). No alarm signal is involved, so any
thread or event loop may grade.

Workers are forked from a forkserver that imported the grading code once, so a worker (and the replacement
of a killed one) does not import sympy again, and nothing is forked from a process that holds torch
threads; workers live as long as their pool and are reused. Pools are shared per process (one per worker
count) and stop at interpreter exit, or on `shutdown_grading_pools()`. As with any spawn/forkserver
multiprocessing, a script that grades must guard its entry point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import multiprocessing
import multiprocessing.util  # registers its exit hook (which joins child processes) before ours
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pebble import ProcessPool

from nemo_rl_ext.environments.math_grading import Grade, grade_answer, math_vote_key

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_GRADING_TIMEOUT_S = 5.0
"""Default deadline of one answer's grading (ordinary answers take milliseconds)."""
DEFAULT_GRADING_WORKERS = max(4, min(os.cpu_count() or 1, 16))
"""Default worker processes per pool: at least 4, so a few hostile answers leave workers for the others."""
_WORKER_MODULE = "nemo_rl_ext.environments.math_grading"


def _init_worker(caller_pid: int) -> None:
    """Worker initializer: exit when the calling process dies (even by SIGKILL, which skips every exit hook),
    and grade one answer so that sympy's lazy imports are done before the first deadline."""
    threading.Thread(target=_exit_with, args=(caller_pid,), name="grading-watchdog", daemon=True).start()
    grade_answer("\\boxed{\\frac{1}{2}}", "0.5")


def _exit_with(pid: int) -> None:
    """Wait for process `pid` to end, then end this one (a busy worker would otherwise run on, orphaned)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: poll
        pidfd = None
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once `pid` has exited
    else:
        while _exists(pid):
            time.sleep(1.0)
    os._exit(1)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class GradingPool:
    """Worker processes that run grading functions, each call under a deadline."""

    def __init__(self, workers: int = DEFAULT_GRADING_WORKERS) -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"grading workers must be an int >= 1, got {workers!r}")
        self.workers = workers
        self._pool: ProcessPool | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stops_at_exit = False

    def _running_pool(self) -> ProcessPool:
        with self._lock:
            if self._pool is not None and self._pid == os.getpid() and not self._pool.active:
                logger.error("the grading pool broke; starting a new one (is the main module guarded by "
                             "`if __name__ == \"__main__\":`? worker processes import it)")
                _stop(self._pool)
                self._pool = None
            if self._pool is None or self._pid != os.getpid():
                context = multiprocessing.get_context("forkserver")
                context.set_forkserver_preload(["__main__", _WORKER_MODULE])
                self._pool = ProcessPool(
                    max_workers=self.workers, initializer=_init_worker, initargs=(os.getpid(),), context=context
                )
                self._pid = os.getpid()
                if not self._stops_at_exit:  # before multiprocessing's hook, which would wait on idle workers
                    atexit.register(self.shutdown)
                    self._stops_at_exit = True
            return self._pool

    async def run(self, function: Callable[..., T], args: Sequence[Any], timeout_s: float) -> T:
        """`function(*args)` in a worker; TimeoutError after `timeout_s` of running (the worker is killed).

        Cancelling the awaiting task cancels the call (a running worker is killed too).
        """
        future = self._running_pool().schedule(function, args=tuple(args), timeout=timeout_s)
        return await asyncio.wrap_future(future)

    async def grade(self, responses: Sequence[str], ground_truths: Sequence[Any], timeout_s: float) -> list[Grade]:
        """Grade every response concurrently, each within `timeout_s`; never raises for a bad answer.

        An answer whose grading times out gets `Grade(0.0, None, status="timeout")`; one whose worker dies
        (e.g. out of memory) gets `status="error"`.
        """
        calls = [self.run(grade_answer, (r, g), timeout_s) for r, g in zip(responses, ground_truths, strict=True)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        grades = []
        for response, result in zip(responses, results, strict=True):
            if isinstance(result, Grade):
                grades.append(result)
            elif isinstance(result, TimeoutError | concurrent.futures.TimeoutError):
                logger.warning("grading timed out after %.1fs: response %.200r", timeout_s, response)
                grades.append(Grade(reward=0.0, answer=None, status="timeout"))
            elif isinstance(result, Exception):
                logger.warning("grading failed (%s: %s): response %.200r", type(result).__name__, result, response)
                grades.append(Grade(reward=0.0, answer=None, status="error"))
            else:  # CancelledError and other BaseExceptions propagate
                raise result
        return grades

    async def vote_keys(self, answers: Sequence[str | None], timeout_s: float) -> list[str | None]:
        """`math_vote_key` of each answer, each within `timeout_s` (None when it times out)."""
        calls = [self.run(math_vote_key, (a,), timeout_s) for a in answers]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
        return [None if isinstance(r, BaseException) else r for r in results]

    def shutdown(self) -> None:
        """Stop the workers (running calls are killed); the next call starts new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pid == os.getpid():
            _stop(pool)


def _stop(pool: ProcessPool) -> None:
    """Stop a pool's workers now: idle ones exit on SIGTERM, busy ones are killed after a grace period."""
    pool.stop()
    try:
        pool.join()
    except RuntimeError as exc:
        logger.warning("grading pool did not stop cleanly: %s", exc)


_POOLS: dict[int, GradingPool] = {}
_POOLS_LOCK = threading.Lock()


def shared_grading_pool(workers: int = DEFAULT_GRADING_WORKERS) -> GradingPool:
    """The process's pool with `workers` workers (created on first use; its processes start on first call)."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = GradingPool(workers)
        return pool


def shutdown_grading_pools() -> None:
    """Stop every shared pool's workers (every pool also stops itself at interpreter exit)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    for pool in pools:
        pool.shutdown()
