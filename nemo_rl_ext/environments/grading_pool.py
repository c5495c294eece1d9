"""Grading in worker processes with a hard per-answer deadline: a grade that overruns is killed, not waited for.

Some answers make math-verify/sympy run for minutes (`\\binom{10000000}{5000000}`, `\\Gamma(10^9)`), and a
thread cannot be stopped, so grading runs in a pebble `ProcessPool`: each answer is one task with
`timeout=grading_timeout_s` (counted from when a worker picks it up); a worker that overruns is killed and
replaced, and the answer's `Grade` says `status="timeout"` (reward 0: a hostile answer is a wrong answer).
No alarm signal is involved, so any thread or event loop may grade.

Workers are forked from this module's own forkserver, which imported the grading code once, so a worker (and
the replacement of a killed one) does not import sympy again, and nothing is forked from a process that holds
torch threads. Workers never import the caller's main module (multiprocessing's spawn and forkserver would
re-run it, which fails for a main read from standard input, `<stdin>`, and re-runs an unguarded script), so
grading works from a script file with or without an `if __name__ == "__main__":` guard, `python -c`, standard
input and a main module without a file (a notebook kernel). Workers live as long as their pool and are reused.
Pools are shared per process (one per worker count) and stop at interpreter exit, or on
`shutdown_grading_pools()`.

A grade that fails for a reason that is not the answer's (the workers could not start, a worker died while
grading, e.g. killed or out of memory, the pool broke or stopped making progress) raises
`GradingUnavailableError`: the environment's step raises, so the rollout becomes an error completion (not
scored, retried on resume), never a reward of 0. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import io
import logging
import multiprocessing.util  # registers its exit hook (which joins child processes) before ours
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn
from typing import Any, TypeVar

from pebble import ProcessExpired, ProcessPool

from nemo_rl_ext.environments.math_grading import GRADER_MODULES, Grade, grade_answer, math_vote_key

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_GRADING_TIMEOUT_S = 5.0
"""Default deadline of one answer's grading (ordinary answers take milliseconds)."""
DEFAULT_GRADING_WORKERS = max(4, min(os.cpu_count() or 1, 16))
"""Default worker processes per pool: at least 4, so a few hostile answers leave workers for the others."""
START_TIMEOUT_S = 60.0
"""Deadline for a pool's workers to start and grade a first answer (the forkserver imports sympy once)."""
RETRY_START_AFTER_S = 30.0
"""After a failed start, grades fail at once with the same error for this long, then a start is tried again."""
_CHECK_EVERY_S = 0.25
"""How often a waiting grade checks that its pool is still alive and making progress."""
_PROBE = ("\\boxed{\\frac{1}{2}}", "0.5")
"""A first answer every pool must grade correctly before it counts as started (1.0)."""
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")
"""What tells a new process of multiprocessing's to import the caller's main module: left out here."""


class GradingUnavailableError(RuntimeError):
    """Grading failed for a reason that is not the answer's (workers could not start, one died, the pool broke).

    Environments let it propagate: the rollout becomes an error completion (retried on resume), not a 0.
    """


# ---- worker processes that never import the caller's main module ---------------------------------------

_FORKSERVER: tuple[int, forkserver.ForkServer] | None = None
_FORKSERVER_LOCK = threading.Lock()


def _forkserver() -> forkserver.ForkServer:
    """This process's grading forkserver (its own, not multiprocessing's shared one): it preloads this module and
    the grader's modules (sympy, math-verify: imported once for every worker), never `__main__`; it starts on
    first use and exits when this process does."""
    global _FORKSERVER
    with _FORKSERVER_LOCK:
        if _FORKSERVER is None or _FORKSERVER[0] != os.getpid():
            server = forkserver.ForkServer()
            server.set_forkserver_preload([__name__, *GRADER_MODULES])
            _FORKSERVER = (os.getpid(), server)
        return _FORKSERVER[1]


class _GradingPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver `Popen` (the same steps), from `_forkserver()`, and with preparation data
    that does not name the main module, so the new process never imports (re-runs) it."""

    def _launch(self, process_obj: Any) -> None:
        data = spawn.get_preparation_data(process_obj._name)
        prep_data = {key: value for key, value in data.items() if key not in _MAIN_KEYS}
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = _forkserver().connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # kept open: the child's sign that this process is alive
        self.finalizer = multiprocessing.util.Finalize(self, multiprocessing.util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _GradingProcess(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _GradingPopen:  # noqa: N802 - multiprocessing's name
        return _GradingPopen(process_obj)


class _GradingContext(mp_context.ForkServerContext):
    """The forkserver start method, with `_GradingProcess` (for this module's pools only; the process-wide
    start method and forkserver stay as the program set them)."""

    Process = _GradingProcess


# ---- in a worker --------------------------------------------------------------------------------------


def _init_worker(caller_pid: int) -> None:
    """Worker initializer: exit when the calling process dies (even by SIGKILL, which skips every exit hook),
    and grade one answer so that sympy's lazy imports are done before the first deadline."""
    threading.Thread(target=_exit_with, args=(caller_pid,), name="grading-watchdog", daemon=True).start()
    grade_answer(*_PROBE)


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


# ---- the pool -----------------------------------------------------------------------------------------


class GradingPool:
    """Worker processes that run grading functions, each call under a deadline."""

    def __init__(self, workers: int = DEFAULT_GRADING_WORKERS, start_timeout_s: float = START_TIMEOUT_S) -> None:
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"grading workers must be an int >= 1, got {workers!r}")
        self.workers = workers
        self.start_timeout_s = start_timeout_s
        self._pool: ProcessPool | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._stops_at_exit = False
        self._start_error: tuple[float, GradingUnavailableError] | None = None
        self._last_progress = time.monotonic()
        self._longest_timeout_s = 0.0

    def start(self) -> None:
        """Start the workers unless they run, and wait until one has graded a first answer.

        Raises `GradingUnavailableError` (within `start_timeout_s`) when they cannot, saying what to do; it is
        raised again at once by every call for `RETRY_START_AFTER_S`. Blocks: async code awaits `run`.
        """
        self._started_pool()

    def _live_pool(self) -> ProcessPool | None:
        """The started pool when it is alive and this process's, else None."""
        pool = self._pool
        if pool is not None and self._pid == os.getpid() and pool.active:
            return pool
        return None

    def _started_pool(self) -> ProcessPool:
        with self._lock:
            pool = self._live_pool()
            if pool is not None:
                return pool
            if self._pool is not None and self._pid == os.getpid():
                logger.error("the grading pool broke (its workers died); starting a new one")
                _stop(self._pool)
            self._pool = None
            if self._start_error is not None:
                failed_at, error = self._start_error
                if time.monotonic() - failed_at < RETRY_START_AFTER_S:
                    raise GradingUnavailableError(str(error)) from error.__cause__
            pool = ProcessPool(
                max_workers=self.workers, initializer=_init_worker, initargs=(os.getpid(),), context=_GradingContext()
            )
            self._pid = os.getpid()
            try:
                self._probe(pool)
            except GradingUnavailableError as error:
                self._start_error = (time.monotonic(), error)
                _stop(pool)
                raise
            self._pool, self._start_error = pool, None
            self._last_progress = time.monotonic()
            if not self._stops_at_exit:  # before multiprocessing's hook, which would wait on idle workers
                atexit.register(self.shutdown)
                self._stops_at_exit = True
            return pool

    def _probe(self, pool: ProcessPool) -> None:
        """Grade `_PROBE` on a new pool within `start_timeout_s`, or raise GradingUnavailableError."""
        deadline = time.monotonic() + self.start_timeout_s
        try:
            future = pool.schedule(grade_answer, args=_PROBE, timeout=self.start_timeout_s)
            while not future.done() and time.monotonic() < deadline and pool.active:
                concurrent.futures.wait([future], timeout=_CHECK_EVERY_S)
            if not future.done():
                future.cancel()
                cause = "the pool broke: its workers died" if not pool.active else "no worker started in time"
                raise GradingUnavailableError(_start_failure(cause, self.start_timeout_s))
            grade = future.result()
        except GradingUnavailableError:
            raise
        except Exception as exc:
            raise GradingUnavailableError(_start_failure(f"{type(exc).__name__}: {exc}", self.start_timeout_s)) from exc
        if not (isinstance(grade, Grade) and grade.reward == 1.0):
            raise GradingUnavailableError(f"the math grader is broken: {_PROBE[0]!r} against {_PROBE[1]!r} gave {grade!r}")

    async def run(self, function: Callable[..., T], args: Sequence[Any], timeout_s: float) -> T:
        """`function(*args)` in a worker; TimeoutError after `timeout_s` of running (the worker is killed).

        `function` must be importable by its module's name (workers never import `__main__`).

        GradingUnavailableError when the call could not run to its end for another reason (no worker could
        start, its worker died, the pool broke or stopped making progress). Cancelling the awaiting task
        cancels the call (a running worker is killed too).
        """
        pool = self._live_pool() or await asyncio.to_thread(self._started_pool)
        try:
            future = pool.schedule(function, args=tuple(args), timeout=timeout_s)
        except RuntimeError as exc:  # pebble: the pool broke or stopped since the check above
            raise GradingUnavailableError(f"the grading pool stopped before this answer was graded ({exc})") from exc
        self._longest_timeout_s = max(self._longest_timeout_s, timeout_s)
        future.add_done_callback(self._progressed)
        waited = asyncio.wrap_future(future)
        since = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({waited}, timeout=_CHECK_EVERY_S)
                if done:
                    return waited.result()
                problem = self._problem(pool, since)
                if problem is not None:
                    waited.cancel()
                    raise GradingUnavailableError(problem)
        except ProcessExpired as exc:
            raise GradingUnavailableError(
                f"a grading worker died while grading this answer ({_exit_text(exc.exitcode)}; e.g. killed, or out "
                "of memory): the answer was not scored"
            ) from exc
        except BrokenProcessPool as exc:
            raise GradingUnavailableError(f"the grading pool broke before this answer was graded ({exc})") from exc
        except asyncio.CancelledError:
            waited.cancel()
            raise

    def _progressed(self, _future: concurrent.futures.Future) -> None:
        self._last_progress = time.monotonic()

    def _problem(self, pool: ProcessPool, since: float) -> str | None:
        """Why a call waiting on `pool` since `since` will never end, or None while it may."""
        if not pool.active:
            return "the grading pool broke before this answer was graded (every worker died)"
        stalled_s = time.monotonic() - max(self._last_progress, since)
        longest = self._longest_timeout_s  # every running grade ends (or is killed) within its deadline
        if stalled_s > longest + self.start_timeout_s:
            self._replace(pool)
            return (f"no grade finished in {stalled_s:.0f}s although each has at most {longest:g}s: the grading "
                    "pool is stuck (it is replaced for the next grade)")
        return None

    def _replace(self, pool: ProcessPool) -> None:
        """Stop `pool` (if it is still this pool's) so that the next call starts a new one."""
        with self._lock:
            if self._pool is not pool:
                return
            self._pool = None
        threading.Thread(target=_stop, args=(pool,), name="grading-pool-stop", daemon=True).start()

    async def grade(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        timeout_s: float,
        function: Callable[[str, Any], Grade] = grade_answer,
    ) -> list[Grade]:
        """Grade every response concurrently with `function` (a module-level function workers can import), each
        within `timeout_s`; never raises for a bad answer.

        An answer whose grading times out gets `Grade(0.0, None, status="timeout")`. When any answer could not be
        graded for another reason (see `run`), every call still ends, then GradingUnavailableError is raised.
        """
        calls = [self.run(function, (r, g), timeout_s) for r, g in zip(responses, ground_truths, strict=True)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        grades, failures = [], []
        for response, result in zip(responses, results, strict=True):
            if isinstance(result, Grade):
                grades.append(result)
            elif isinstance(result, TimeoutError):
                logger.warning("grading timed out after %.1fs: response %.200r", timeout_s, response)
                grades.append(Grade(reward=0.0, answer=None, status="timeout"))
            elif isinstance(result, Exception):
                failures.append(result)
            else:  # CancelledError and other BaseExceptions propagate
                raise result
        if failures:
            raise _unavailable(failures, len(responses))
        return grades

    async def vote_keys(self, answers: Sequence[str | None], timeout_s: float) -> list[str | None]:
        """`math_vote_key` of each answer, each within `timeout_s` (None when it times out);
        GradingUnavailableError as in `grade`."""
        calls = [self.run(math_vote_key, (a,), timeout_s) for a in answers]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
        failures = [r for r in results if isinstance(r, Exception) and not isinstance(r, TimeoutError)]
        if failures:
            raise _unavailable(failures, len(answers))
        return [None if isinstance(r, BaseException) else r for r in results]

    def shutdown(self) -> None:
        """Stop the workers (running calls are killed); the next call starts new ones."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._start_error = None
        if pool is not None and self._pid == os.getpid():
            _stop(pool)


def _unavailable(failures: Sequence[Exception], total: int) -> GradingUnavailableError:
    """One GradingUnavailableError for the calls of a batch that failed (the first one's message)."""
    first = failures[0]
    text = str(first) if isinstance(first, GradingUnavailableError) else f"{type(first).__name__}: {first}"
    if len(failures) > 1:
        text += f" ({len(failures)} of {total} answers failed)"
    error = GradingUnavailableError(text)
    error.__cause__ = first
    return error


def _start_failure(cause: str, timeout_s: float) -> str:
    return (
        f"the math grader's worker processes could not start within {timeout_s:g}s ({cause}). They are forked "
        f"from a new Python process ({spawn.get_executable()}) that imports {__name__}: check that a new Python "
        "process can import nemo_rl_ext (installed, or on PYTHONPATH) and that this process may start child "
        "processes; the workers' own errors, if any, are on standard error above"
    )


def _exit_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


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
