"""Grading scripts run as their own processes: 35 answers (runaways among them) graded under the deadline in a
process that then exits promptly leaving no worker behind, and workers busy with runaways that die with a killed
caller. (The in-process grading deadline tests are tests/unit/environments/test_grading_deadline.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hostile_answers import HOSTILE

REPO = Path(__file__).resolve().parents[2]


def child_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


CHILD = r"""
import asyncio, json, os, sys, time
from pathlib import Path
import psutil
from nemo_rl_ext.environments import MathEnvironment
from nemo_rl_ext.data.records import Message

def log(text):
    return (Message("user", "q", ()), Message("assistant", text, ()))

def descendants():
    return [p.pid for p in psutil.Process().children(recursive=True)]

async def timed_step(env, answers, truths):
    start = time.perf_counter()
    result = await env.step([log(a) for a in answers], [{"ground_truth": t} for t in truths])
    return result, time.perf_counter() - start

async def main(hostile, min_deadline):
    ordinary = [f"So the answer is \\boxed{{\\frac{{{i}}}{{4}}}}." for i in range(30)]
    ordinary_truths = [f"{i / 4}" for i in range(30)]
    env = MathEnvironment(grading_timeout_s=60.0, grading_workers=6)
    await env.step([log("\\boxed{1}")], [{"ground_truth": "1"}])  # the workers are up
    _, base = await timed_step(env, ordinary, ordinary_truths)  # the ordinary ones alone, at this load
    deadline = max(min_deadline, 2 * base)
    env = MathEnvironment(grading_timeout_s=deadline, grading_workers=6)  # the same (shared) pool
    result, wall = await timed_step(env, hostile + ordinary, ["1"] * len(hostile) + ordinary_truths)
    gradings = [e["grading"] for e in result.extras]
    print(json.dumps({"wall": wall, "base": base, "deadline": deadline, "rewards": list(result.rewards),
                      "gradings": gradings, "pids": descendants()}), flush=True)

if __name__ == "__main__":
    asyncio.run(main(json.loads(Path(sys.argv[1]).read_text()), float(sys.argv[2])))
    print("done", flush=True)
"""


@pytest.mark.timeout(90)
def test_hostile_answers_time_out_while_thirty_ordinary_ones_score(tmp_path: Path) -> None:
    """The 4 runaways are killed at the deadline side by side: the step takes about one deadline, not one per
    runaway (>= 4 deadlines). The deadline is 2 s, or twice the time the 30 ordinary answers alone took in the
    same process (measured first), whichever is longer: on a loaded machine the ordinary grades alone can take
    longer than 2 s, and a fixed 2 s deadline then made "< 2 deadlines" fail with the runaways still graded side by
    side (8.3 s seen at load 10-20)."""
    min_deadline = 2.0
    script = tmp_path / "grade_35.py"
    script.write_text(CHILD)
    answers = tmp_path / "hostile.json"
    answers.write_text(json.dumps(HOSTILE))
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, str(script), str(answers), str(min_deadline)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        report = json.loads(proc.stdout.readline())
        assert proc.stdout.readline().strip() == "done"
        done = time.monotonic()
        proc.wait(timeout=30)
        exit_s = time.monotonic() - done
    finally:
        proc.kill()
        proc.wait()
    rewards, gradings = report["rewards"], report["gradings"]
    assert rewards[5:] == [1.0] * 30 and gradings[5:] == ["ok"] * 30
    assert rewards[:5] == [0.0] * 5
    assert gradings[:4] == ["timeout"] * 4  # sympy's runaways are killed at the deadline
    assert gradings[4] in ("ok", "timeout")  # 20,000 unclosed boxes: extraction is linear now, no answer
    # the hostile answers ran side by side: about one deadline, not one per hostile answer (4 or more deadlines)
    deadline = report["deadline"]
    assert deadline <= report["wall"] < 2 * deadline, report
    assert exit_s < 5.0, f"the process took {exit_s:.1f}s to exit"
    left = wait_until_gone(report["pids"], 10.0)  # the forkserver exits once its clients are gone
    assert not left, f"processes left running after exit: {left}"


KILLED_CHILD = r"""
import asyncio, sys
from nemo_rl_ext.environments.grading_pool import GradingPool

async def main():
    pool = GradingPool(workers=2)
    await pool.grade(["\boxed{1}"], ["1"], 30.0)
    busy = asyncio.ensure_future(pool.grade(sys.argv[1:], ["1"] * len(sys.argv[1:]), 600.0))
    await asyncio.sleep(1.0)
    print("busy", flush=True)
    await busy

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.timeout(60)
def test_workers_busy_with_hostile_answers_die_with_a_killed_caller(tmp_path: Path) -> None:
    script = tmp_path / "killed.py"
    script.write_text(KILLED_CHILD)
    env = child_env()
    proc = subprocess.Popen(
        [sys.executable, str(script), HOSTILE[0], HOSTILE[2]],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        assert proc.stdout.readline().strip() == "busy"
        pids = descendants(proc.pid)
        assert len(pids) >= 3, pids  # the forkserver and two workers (and multiprocessing's resource tracker)
    finally:
        proc.kill()  # SIGKILL: no exit hook of the caller runs
        proc.wait()
    left = wait_until_gone(pids, 10.0)
    assert not left, f"processes left running after the caller was killed: {left}"


def descendants(root: int) -> list[int]:
    """Every process below `root` (children, grandchildren, ...)."""
    return [p.pid for p in psutil.Process(root).children(recursive=True)]


def wait_until_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after `timeout_s`; those are then killed, so a failing test leaves nothing."""
    give_up = time.monotonic() + timeout_s
    while (left := [pid for pid in pids if running(pid)]) and time.monotonic() < give_up:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (this container's init may not reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
