"""Run as a script (stdlib only, no nemo_rl_ext import): kill process groups when the parent dies.

    python watchdog.py < pipe        # one line per process group id to guard; "done" to exit quietly

The launcher starts one watchdog per launch with a pipe on its stdin and writes the id of every
process group it starts. When the launcher's process dies by any means (SIGKILL included), the pipe
closes; the watchdog then SIGTERMs every guarded group and every process of its session, waits
`GRACE_S`, and SIGKILLs what is left. A normal stop writes "done" first, and the watchdog exits
without touching anything.
"""

import os
import signal
import subprocess
import sys
import time

GRACE_S = 3.0


def _signal(pgids: set[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    try:  # Ray workers leave their process group but not the session of the leader
        out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    for line in out.splitlines():
        pid, _, sid = line.strip().partition(" ")
        if pid.isdigit() and sid.strip().isdigit() and int(sid) in pgids and int(pid) != os.getpid():
            try:
                os.kill(int(pid), sig)
            except (ProcessLookupError, PermissionError):
                pass


def _alive(pgids: set[int]) -> bool:
    for pgid in pgids:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            pass
    return False


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the parent must not stop the guard
    pgids: set[int] = set()
    for line in sys.stdin:
        word = line.strip()
        if word == "done":
            return
        if word.lstrip("-").isdigit():
            pgid = int(word)
            if pgid > 0:
                pgids.add(pgid)
            else:
                pgids.discard(-pgid)
    if not pgids:
        return
    _signal(pgids, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while _alive(pgids) and time.monotonic() < deadline:
        time.sleep(0.1)
    _signal(pgids, signal.SIGKILL)


if __name__ == "__main__":
    main()
