"""Stopping on signals (`nemo_rl_ext.lifecycle`) and the launcher's watchdog, in small subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from nemo_rl_ext.gym.launcher import WATCHDOG

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

ASYNC_MAIN = """
import asyncio, sys, time
from nemo_rl_ext.lifecycle import on_force_stop, stop_on_signals

marker, cleanup_s = sys.argv[1], float(sys.argv[2])
on_force_stop(lambda: open(marker + ".forced", "w").write("forced"))

async def main():
    try:
        print("ready", flush=True)
        await asyncio.sleep(60)
    finally:  # an asynchronous cleanup, like RolloutManager.shutdown() stopping Gym
        await asyncio.sleep(cleanup_s)
        open(marker, "w").write("cleaned")

with stop_on_signals(name="job"):
    asyncio.run(main())
"""

BLOCKING_MAIN = """
import sys, time
from nemo_rl_ext.lifecycle import stop_on_signals

with stop_on_signals(name="job"):
    try:
        print("ready", flush=True)
        time.sleep(60)
    finally:
        open(sys.argv[1], "w").write("cleaned")
"""


def interruptible() -> None:
    """In the child, before exec: SIGINT back to its default. A shell without job control starts background
    jobs with SIGINT ignored (and a test run started so passes that on); Python then installs no
    KeyboardInterrupt handler, as a user's `cmd &` expects, and a test that sends SIGINT must undo it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args], cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)},
        preexec_fn=interruptible,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize("main", [ASYNC_MAIN, BLOCKING_MAIN], ids=["asyncio", "blocking"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_runs_the_cleanup_and_exits_128_plus_the_signal(tmp_path, main, sig):
    marker = tmp_path / "marker"
    proc = start(main, str(marker), "0.2")
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 128 + sig, err
    assert marker.read_text() == "cleaned"
    assert f"job: stopped by {signal.Signals(sig).name}" in err and "Traceback" not in err
    assert not Path(f"{marker}.forced").exists()


def test_a_second_sigterm_stops_at_once(tmp_path):
    marker = tmp_path / "marker"
    proc = start(ASYNC_MAIN, str(marker), "60")  # a cleanup that would take a minute
    proc.send_signal(signal.SIGTERM)
    assert "SIGTERM received" in proc.stderr.readline()
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 128 + signal.SIGTERM
    assert Path(f"{marker}.forced").read_text() == "forced"  # the launchers' kill-now callbacks ran
    assert not marker.exists()


GRACEFUL_MAIN = """
import sys, time
from nemo_rl_ext.lifecycle import graceful_stop, stop_on_signals

marker, work_s, timeout_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
with stop_on_signals(name="job"):
    with graceful_stop(lambda: print("requested", flush=True), timeout_s=timeout_s, what="the step",
                       name="job") as stop:
        print("ready", flush=True)
        while not stop.requested:  # a loop between safe points
            time.sleep(0.01)
        time.sleep(work_s)  # the step in progress, then its checkpoint
        open(marker, "w").write("saved")
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_inside_graceful_stop_the_first_signal_lets_the_step_finish(tmp_path, sig):
    marker = tmp_path / "marker"
    proc = start(GRACEFUL_MAIN, str(marker), "0.5", "30")
    sent = time.monotonic()
    proc.send_signal(sig)
    assert proc.stdout.readline().strip() == "requested"  # the callback ran, nothing was interrupted
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent >= 0.5
    assert marker.read_text() == "saved"
    assert proc.returncode == 128 + sig, err
    assert "finishing the step (at most 30 s)" in err and f"job: stopped by {signal.Signals(sig).name}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_inside_graceful_stop_a_second_signal_stops_at_once(tmp_path, sig):
    marker = tmp_path / "marker"
    proc = start(GRACEFUL_MAIN, str(marker), "60", "600")  # a step that would take a minute
    proc.send_signal(sig)
    assert proc.stdout.readline().strip() == "requested"
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 10
    assert proc.returncode == 128 + sig, err
    assert not marker.exists()


def test_graceful_stop_gives_up_after_its_timeout(tmp_path):
    marker = tmp_path / "marker"
    proc = start(GRACEFUL_MAIN, str(marker), "60", "1")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert 1.0 <= time.monotonic() - sent < 10
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "the step did not finish within 1 s of the signal; stopping at once" in err
    assert not marker.exists()


PARENT = """
import subprocess, sys, time
watchdog = subprocess.Popen([sys.executable, sys.argv[1]], stdin=subprocess.PIPE, text=True,
                            start_new_session=True)
child = subprocess.Popen(["sleep", "120"], start_new_session=True)  # a Gym server in its own group
watchdog.stdin.write(f"{child.pid}\\n"); watchdog.stdin.flush()
print("ready", flush=True)
print(child.pid, watchdog.pid, flush=True)
if sys.argv[2] == "done":  # a normal stop: the guard is told to go and touches nothing
    watchdog.stdin.write("done\\n"); watchdog.stdin.flush(); watchdog.wait(10)
time.sleep(120)
"""


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], within_s: float) -> float:
    start = time.monotonic()
    while not all(gone(p) for p in pids) and time.monotonic() - start < within_s:
        time.sleep(0.05)
    return time.monotonic() - start


def test_the_watchdog_stops_the_children_of_a_killed_parent():
    parent = start(PARENT, str(WATCHDOG), "guard")
    child, watchdog = (int(x) for x in parent.stdout.readline().split())
    assert not gone(child)
    parent.kill()  # SIGKILL: no finally, no atexit
    parent.wait(10)
    took = wait_gone([child, watchdog], 15)
    assert gone(child) and gone(watchdog), "the child outlived its killed parent"
    assert took < 6


def test_the_watchdog_leaves_the_children_alone_after_done():
    parent = start(PARENT, str(WATCHDOG), "done")
    child, watchdog = (int(x) for x in parent.stdout.readline().split())
    try:
        wait_gone([watchdog], 10)
        assert gone(watchdog)
        parent.kill()
        parent.wait(10)
        time.sleep(0.5)
        assert not gone(child)
    finally:
        os.kill(child, signal.SIGKILL)


def test_freeze_startup_heap_takes_the_objects_alive_out_of_collections_and_later_garbage_is_still_freed() -> None:
    """What the CLIs call after start-up: the objects alive then are frozen (never scanned again), and a cycle
    made afterwards is still collected (run in a child: freezing is process-wide)."""
    code = """
import gc, weakref
from nemo_rl_ext.lifecycle import freeze_startup_heap
alive = len(gc.get_objects())
freeze_startup_heap()
assert gc.get_freeze_count() >= alive * 0.9, (gc.get_freeze_count(), alive)
assert len(gc.get_objects()) < alive * 0.1, len(gc.get_objects())
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
ref = weakref.ref(a)
del a, b
gc.collect()
assert ref() is None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
