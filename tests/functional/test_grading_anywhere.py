"""Grading works wherever Python runs, and a grade that fails for infrastructure reasons is an error, not a 0.

The math grader's workers used to be started by a forkserver that re-imported the caller's main module: from
a script read on standard input (`python - < script.py`) they could not start (`FileNotFoundError:
'<stdin>'`), right answers scored 0 with `grading: "error"`, and 35 answers at once hung; an unguarded script
was re-run in them. Each launch below grades hostile answers (runaways killed at the deadline) and ordinary
ones side by side, in a child process under a hard time limit, with a script that has no
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_rl_ext.data.datasets import datum_from_messages
from nemo_rl_ext.data.records import Message, StopReason
from nemo_rl_ext.environments.grading_pool import GradingPool, GradingUnavailableError
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.testing import KilledGradingMathEnvironment, ScriptedGeneration

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 2.0
HOSTILE = ["\\boxed{\\binom{10000000}{5000000}}", "\\boxed{\\Gamma(10^9)}"]
ORDINARY = ["\\boxed{2}"] + [f"So the answer is \\boxed{{\\frac{{{i}}}{{4}}}}." for i in range(30)] + ["\\boxed{3}"]
TRUTHS = ["1", "1", "2"] + [f"{i / 4}" for i in range(30)] + ["2"]

GRADER = f"""
import asyncio, json
from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments import MathEnvironment

def log(text):
    return (Message("user", "q", ()), Message("assistant", text, ()))

async def grade(answers, truths):
    env = MathEnvironment(grading_timeout_s={DEADLINE_S}, grading_workers=4)
    result = await env.step([log(a) for a in answers], [{{"ground_truth": t}} for t in truths])
    return {{"rewards": list(result.rewards), "gradings": [e["grading"] for e in result.extras]}}

print(json.dumps(asyncio.run(grade({HOSTILE + ORDINARY!r}, {TRUTHS!r}))), flush=True)
"""

NO_FILE_MAIN = """
import sys, types
main = types.ModuleType("__main__")  # as a notebook kernel's: no __file__, no __spec__
sys.modules["__main__"] = main
exec(compile(open(sys.argv[1]).read(), "<cell>", "exec"), main.__dict__)
"""


def launch(how: str, script: Path) -> list[str]:
    """The command line and how the grading script reaches Python."""
    if how == "file":
        return [sys.executable, str(script)]
    if how == "-c":
        return [sys.executable, "-c", script.read_text()]
    if how == "stdin":
        return [sys.executable, "-"]
    if how == "no-file main":
        return [sys.executable, "-c", NO_FILE_MAIN, str(script)]
    raise AssertionError(how)


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["file", "-c", "stdin", "no-file main"])
def test_grading_works_from_any_main(how: str, tmp_path: Path) -> None:
    script = tmp_path / "grade.py"
    script.write_text(GRADER)
    with script.open() as stdin:
        proc = subprocess.run(
            launch(how, script), stdin=stdin if how == "stdin" else subprocess.DEVNULL, capture_output=True,
            text=True, timeout=120, env=child_env(), cwd=tmp_path,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"the script ran more than once (re-imported as a main module): {proc.stdout[-2000:]}"
    report = json.loads(lines[0])
    assert report["gradings"] == ["timeout"] * 2 + ["ok"] * len(ORDINARY)
    assert report["rewards"] == [0.0, 0.0, 1.0] + [1.0] * 30 + [0.0]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


CANNOT_START = """
import multiprocessing, sys, time
multiprocessing.set_executable("/bin/false")  # no process can be started: the forkserver exits at once
from nemo_rl_ext.environments import MathEnvironment
from nemo_rl_ext.environments.grading_pool import GradingPool, GradingUnavailableError
for attempt in range(2):
    start = time.monotonic()
    try:
        MathEnvironment(grading_workers=2)
    except GradingUnavailableError as err:
        print(f"{time.monotonic() - start:.2f} {err}", flush=True)
"""


@pytest.mark.timeout(120)
def test_workers_that_cannot_start_give_one_clear_error_when_the_environment_is_built(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CANNOT_START], capture_output=True, text=True, timeout=100, env=child_env(),
        cwd=tmp_path,
    )
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    first_s, first = lines[0].split(" ", 1)
    again_s, again = lines[1].split(" ", 1)
    assert "worker processes could not start" in first and "can import nemo_rl_ext" in first
    assert again == first and float(again_s) < 1.0  # remembered: later grades fail at once with the same error


# ---- a worker killed mid-grade ---------------------------------------------------------------------


def log(text: str) -> tuple[Message, Message]:
    return (Message("user", "q", ()), Message("assistant", text, ()))


@pytest.mark.timeout(120)
async def test_a_worker_killed_mid_grade_raises_and_the_next_grade_is_right(tmp_path: Path) -> None:
    flag = tmp_path / "kill"
    flag.touch()
    env = KilledGradingMathEnvironment(str(flag), kill_truths=["2"], grading_workers=2, grading_timeout_s=30.0)
    start = time.monotonic()
    with pytest.raises(GradingUnavailableError, match="a grading worker died while grading this answer "
                       r"\(signal SIGKILL; e.g. killed, or out of memory\)"):
        await env.step([log("\\boxed{2}"), log("\\boxed{3}")], [{"ground_truth": "2"}, {"ground_truth": "3"}])
    assert time.monotonic() - start < 20.0  # not the 30 s grading deadline: the death is seen at once
    flag.unlink()
    result = await env.step([log("\\boxed{2}"), log("\\boxed{3}")], [{"ground_truth": "2"}, {"ground_truth": "3"}])
    assert list(result.rewards) == [1.0, 1.0] and [e["grading"] for e in result.extras] == ["ok", "ok"]


@pytest.mark.timeout(120)
async def test_a_worker_killed_mid_grade_makes_an_error_completion(tiny_model_and_tokenizer, tmp_path) -> None:
    _, tok = tiny_model_and_tokenizer
    flag = tmp_path / "kill"
    flag.touch()
    env = KilledGradingMathEnvironment(str(flag), grading_workers=2, grading_timeout_s=30.0)
    datum = datum_from_messages(
        tok, 0, [{"role": "user", "content": "1 + 1?"}], task_name="math", extra_env_info={"ground_truth": "2"}
    )
    manager = RolloutManager(
        tokenizer=tok, task_to_env={"math": env}, num_generations_per_prompt=2, max_seq_len=512,
        max_rollout_turns=1, generation_config=GenerationConfig(max_new_tokens=64, seed=0),
        policy_generation=ScriptedGeneration(tok, ["So \\boxed{2}."], finish_reason=FinishReason.EOS),
    )
    record = await manager.run_rollout(datum)
    for c in record.completions:
        assert c.stop_reason is StopReason.ERROR and c.reward == 0.0
        assert c.error.startswith("GradingUnavailableError: a grading worker died") and "SIGKILL" in c.error
        assert "grading" not in c.env_extras  # never graded, so never counted as an answer
    assert record.rollout_metrics["rollout/grading_timeouts"] == 0.0
    flag.unlink()  # the fault is gone: the same rollouts now score
    record = await manager.run_rollout(datum)
    assert [(c.stop_reason, c.reward, c.error) for c in record.completions] == [(StopReason.NATURAL, 1.0, None)] * 2


@pytest.mark.timeout(120)
async def test_grades_sent_to_a_pool_whose_workers_all_died_end_and_are_never_a_silent_zero() -> None:
    """Every worker killed while idle breaks pebble's pool, and tasks still queued in it were never settled
    (the 35-answer hang): now each grade ends within a deadline, right or with GradingUnavailableError."""
    pool = GradingPool(workers=2)
    try:
        assert (await pool.grade(["\\boxed{1}"], ["1"], 30.0))[0].reward == 1.0
        for pid in list(pool._pool._pool_manager.worker_manager.workers):  # pebble's own record of its workers
            os.kill(pid, signal.SIGKILL)
        answers, truths = [f"\\boxed{{{i}}}" for i in range(35)], [str(i) for i in range(35)]
        start = time.monotonic()
        try:
            grades = await asyncio.wait_for(pool.grade(answers, truths, 30.0), 60.0)
        except GradingUnavailableError as err:  # the pool broke under these grades: an error, not a 0
            assert "grading pool broke" in str(err) or "worker died" in str(err), err
        else:  # the pool was replaced before they were sent
            assert [g.reward for g in grades] == [1.0] * 35
        assert time.monotonic() - start < 30.0
        grades = await asyncio.wait_for(pool.grade(answers, truths, 30.0), 60.0)
        assert [g.reward for g in grades] == [1.0] * 35  # and the next grades are right
    finally:
        pool.shutdown()
