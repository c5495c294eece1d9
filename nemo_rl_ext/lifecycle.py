"""Stopping a run on SIGTERM or SIGINT: an orderly shutdown first, at once on the second signal.

    with stop_on_signals():          # in a script's main thread
        sys.exit(main())

- The first SIGTERM is handled like Ctrl-C: inside `asyncio.run` / `asyncio.Runner.run` the main task
  is cancelled (asyncio's own SIGINT handling), elsewhere `KeyboardInterrupt` is raised. Either way the
  `finally` blocks and context managers run: the Gym launcher stops its servers' process groups, the
  policy server stops, files are closed. The block then exits with 128 + the signal number (143 for
  SIGTERM, 130 for SIGINT) and one line on stderr instead of a traceback.
- A second SIGTERM stops at once: every registered `on_force_stop` callback runs (the Gym launchers
  SIGKILL their process groups) and the process exits with `os._exit`.
- SIGINT keeps Python's and asyncio's own handling (a second Ctrl-C raises `KeyboardInterrupt` inside the
  shutdown); whatever that leaves, the launcher's watchdog (`nemo_rl_ext/gym/watchdog.py`) stops when the
  process exits.

Work that must not be cut in the middle (a training step that updates weights and optimizer state) runs
inside `graceful_stop`: there the first SIGTERM (under `stop_on_signals`) or SIGINT only *requests* the
stop. `requested` becomes True and the block's `on_request` callback runs (from the signal handler: it
should only wake what waits, e.g. `loop.call_soon_threadsafe`); the code stops at its next safe point
(GRPO: after the step in progress, with a checkpoint) and raises `KeyboardInterrupt` itself, so the exit
is the same as above. A second signal stops at once, and so does the block's `timeout_s` running out
before the code stopped: the force-stop callbacks run and the process exits 128 + the signal.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

_force_stops: dict[int, Callable[[], None]] = {}
_ids = itertools.count()
_graceful: list[graceful_stop] = []
"""The active `graceful_stop` blocks, innermost last."""


def on_force_stop(callback: Callable[[], None]) -> Callable[[], None]:
    """Run `callback` (fast, no waiting) if the process is stopped at once; returns the unregister function."""
    key = next(_ids)
    _force_stops[key] = callback

    def unregister() -> None:
        _force_stops.pop(key, None)

    return unregister


def force_stop() -> None:
    """Run every registered force-stop callback (errors are printed, not raised)."""
    for callback in list(_force_stops.values()):
        try:
            callback()
        except Exception as exc:  # a failing callback must not keep the others from running
            print(f"force stop: {callback!r} failed: {exc!r}", file=sys.stderr)


class stop_on_signals:  # noqa: N801 (used as a context manager, like contextlib's)
    """Turn SIGTERM into an orderly shutdown (a second one stops at once); exit 128 + signal afterwards."""

    def __init__(self, name: str | None = None, resume_hint: str = "Re-run the same command to resume.") -> None:
        self.name = name or os.path.basename(sys.argv[0] or "run")
        self.resume_hint = resume_hint
        self.signum: int | None = None
        """The first signal received (None if none)."""
        self.received_at: float | None = None
        """time.monotonic() when it came."""
        self._count = 0
        self._previous: Any = None

    def __enter__(self) -> stop_on_signals:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._count += 1
        if self._count == 1:
            self.signum, self.received_at = signum, time.monotonic()
            if _graceful and not _graceful[-1].requested:  # after a Ctrl-C's request: at once, below
                print(f"{self.name}: SIGTERM received; send it again to stop at once", file=sys.stderr, flush=True)
                _graceful[-1].request(signum)
                return
            print(f"{self.name}: SIGTERM received, stopping (Gym servers, policy server); "
                  "send it again to stop at once", file=sys.stderr, flush=True)
            handler = signal.getsignal(signal.SIGINT)
            if callable(handler):
                handler(signal.SIGINT, frame)  # asyncio's: cancel the main task; Python's: KeyboardInterrupt
                return
            raise KeyboardInterrupt
        print(f"{self.name}: second SIGTERM, stopping at once", file=sys.stderr, flush=True)
        force_stop()
        os._exit(128 + signum)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
        if exc_type is None or not issubclass(exc_type, KeyboardInterrupt):
            return False
        signum = self.signum or signal.SIGINT
        took = f" {time.monotonic() - self.received_at:.1f} s after the signal" if self.received_at else ""
        print(f"{self.name}: stopped by {signal.Signals(signum).name}{took}; every process it started is "
              f"stopped. {self.resume_hint}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum) from None


class graceful_stop:  # noqa: N801 (a context manager, like contextlib's)
    """Inside the block (main thread only), the first stop signal is a request; see the module docstring.

    `on_request` runs in the signal handler on the first signal; `timeout_s` bounds the time from that
    signal to leaving the block; `what` names the work in the message printed on the first signal.
    Outside the main thread the block does nothing (signals are only delivered there).
    """

    def __init__(self, on_request: Callable[[], None] = lambda: None, *, timeout_s: float = 600.0,
                 what: str = "the work in progress", name: str | None = None) -> None:
        self.on_request = on_request
        self.timeout_s = timeout_s
        self.what = what
        self.name = name or os.path.basename(sys.argv[0] or "run")
        self.requested = False
        """True once a stop was requested."""
        self.signum: int | None = None
        """The signal that requested it."""
        self._timer: threading.Timer | None = None
        self._previous: Any = None
        self._active = False

    def __enter__(self) -> graceful_stop:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._active = True
        _graceful.append(self)
        if callable(signal.getsignal(signal.SIGINT)):  # an ignored SIGINT (a background job) stays ignored
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # as a second SIGTERM: a KeyboardInterrupt would unwind into a step still running
            print(f"{self.name}: second SIGINT, stopping at once", file=sys.stderr, flush=True)
            force_stop()
            os._exit(128 + signum)
        self.request(signum)

    def request(self, signum: int) -> None:
        """Request the stop (what the first signal does)."""
        if self.requested:
            return
        self.requested, self.signum = True, signum
        print(f"{self.name}: {signal.Signals(signum).name}: finishing {self.what} (at most {self.timeout_s:g} s), "
              "then stopping; send the signal again to stop at once", file=sys.stderr, flush=True)
        self._timer = threading.Timer(self.timeout_s, self._expired)
        self._timer.daemon = True
        self._timer.start()
        self.on_request()

    def _expired(self) -> None:
        print(f"{self.name}: {self.what} did not finish within {self.timeout_s:g} s of the signal; stopping at "
              "once", file=sys.stderr, flush=True)
        force_stop()
        os._exit(128 + (self.signum or signal.SIGINT))

    def __exit__(self, *exc: object) -> None:
        if not self._active:
            return
        self._active = False
        if self._timer is not None:
            self._timer.cancel()
        _graceful.remove(self)
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def freeze_startup_heap() -> None:
    """Move every object alive now to Python's permanent generation (`gc.freeze`), once start-up is done.

    A job imports torch, transformers and the rest before its first rollout: about 300k objects the garbage
    collector's full collections would scan again and again for the whole run, although none of them is ever
    garbage. Frozen, they are skipped, so a collection costs what the run itself holds and a rollout's share
    of it stops growing with the number of rollouts (`bench/overhead.py`, docs/benchmarks.md). The CLIs
    (`run_eval.py`, `run_grpo.py`, the policy server) call this after their imports and config checks; a
    library user may do the same in their own script. Frozen objects are never freed, which is what happens to
    imported modules anyway."""
    import gc  # stdlib, cheap: local only by habit, could move to the top

    gc.collect()
    gc.freeze()

