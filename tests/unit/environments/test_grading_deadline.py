"""Grading under a hard per-answer deadline: hostile answers are killed in their worker, the others finish."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nemo_rl_ext.data.datasets import datum_from_messages
from nemo_rl_ext.data.records import Completion, Message, StopReason
from nemo_rl_ext.environments import MathEnvironment, ToolCalculatorEnvironment
from nemo_rl_ext.environments.grading_pool import GradingPool
from nemo_rl_ext.environments.math_grading import extract_answer, grade_answer
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.experience.rollout_metrics import rollout_metrics
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.testing import ScriptedGeneration

REPO = Path(__file__).resolve().parents[3]

# Each made math-verify run for 40-70 s or more with its timeouts off (the unclosed boxes in extraction).
HOSTILE = [
    "\\boxed{\\binom{10000000}{5000000}}",
    "\\boxed{\\prod_{i=1}^{10^8} i}",
    "\\boxed{\\Gamma(10^9)}",
    "\\boxed{" + "\\frac{1}{" * 20 + "2" + "}" * 20 + "}",
    "\\boxed{" * 20_000,
]

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

async def main(hostile, deadline):
    env = MathEnvironment(grading_timeout_s=deadline, grading_workers=6)
    await env.step([log("\\boxed{1}")], [{"ground_truth": "1"}])  # the workers are up
    ordinary = [f"So the answer is \\boxed{{\\frac{{{i}}}{{4}}}}." for i in range(30)]
    truths = ["1"] * len(hostile) + [f"{i / 4}" for i in range(30)]
    start = time.perf_counter()
    result = await env.step([log(t) for t in hostile + ordinary], [{"ground_truth": t} for t in truths])
    wall = time.perf_counter() - start
    gradings = [e["grading"] for e in result.extras]
    print(json.dumps({"wall": wall, "rewards": list(result.rewards), "gradings": gradings,
                      "pids": descendants()}), flush=True)

if __name__ == "__main__":
    asyncio.run(main(json.loads(Path(sys.argv[1]).read_text()), float(sys.argv[2])))
    print("done", flush=True)
"""


@pytest.mark.timeout(90)
def test_hostile_answers_time_out_while_thirty_ordinary_ones_score(tmp_path: Path) -> None:
    deadline = 2.0
    script = tmp_path / "grade_35.py"
    script.write_text(CHILD)
    answers = tmp_path / "hostile.json"
    answers.write_text(json.dumps(HOSTILE))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(answers), str(deadline)],
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
    # the hostile answers ran side by side: about one deadline, not one per hostile answer
    assert deadline <= report["wall"] < 2 * deadline, report["wall"]
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
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
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


def test_unclosed_boxes_are_extracted_in_linear_time() -> None:
    start = time.perf_counter()
    assert extract_answer("\\boxed{" * 20_000) is None
    assert extract_answer("\\boxed{" * 20_000 + "\\boxed{7}") == "7"
    assert extract_answer("\\boxed{1} and \\boxed{2" + "{" * 20_000) == "1"
    assert time.perf_counter() - start < 1.0


def test_trailing_period_and_quotes_do_not_change_the_grade() -> None:
    for spelling in ("21", "21.", '"21"', "21.0", "$21$"):
        grade = grade_answer(f"\\boxed{{{spelling}}}", "21")
        assert grade.reward == 1.0, spelling
        assert grade.vote_key == "21", spelling


async def test_a_cancelled_grade_frees_its_worker() -> None:
    pool = GradingPool(workers=1)
    try:
        hostile = asyncio.ensure_future(pool.grade([HOSTILE[2]], ["1"], timeout_s=60.0))
        await asyncio.sleep(0.5)
        hostile.cancel()  # e.g. the fault policy's env step timeout
        with pytest.raises(asyncio.CancelledError):
            await hostile
        start = time.perf_counter()
        grades = await asyncio.wait_for(pool.grade(["\\boxed{3}"], ["3"], timeout_s=30.0), 20.0)
        assert grades[0].reward == 1.0 and grades[0].status == "ok"
        assert time.perf_counter() - start < 10.0
    finally:
        pool.shutdown()


def test_grading_timeout_must_be_positive() -> None:
    for bad in (0, -1.0, "5", True):
        with pytest.raises(ValueError, match="grading_timeout_s"):
            MathEnvironment(grading_timeout_s=bad)
    with pytest.raises(ValueError, match="grading workers"):
        MathEnvironment(grading_workers=0)


# ---- a timed-out grade in a rollout ----------------------------------------------------------------


def one_answer(tokenizer, text: str) -> ScriptedGeneration:
    """Answers every prompt with the same text, ended by EOS."""
    return ScriptedGeneration(tokenizer, [text], finish_reason=FinishReason.EOS, max_model_len=8192)


@pytest.mark.parametrize("env_class", [MathEnvironment, ToolCalculatorEnvironment])
async def test_a_timed_out_grade_scores_zero_and_is_counted(tiny_model_and_tokenizer, env_class) -> None:
    _, tok = tiny_model_and_tokenizer
    env = env_class(grading_timeout_s=1.0)
    datum = datum_from_messages(
        tok, 0, [{"role": "user", "content": "Compute it."}], task_name="math", extra_env_info={"ground_truth": "1"}
    )
    records = []
    for answer in (HOSTILE[2], "So \\boxed{1}."):
        manager = RolloutManager(
            tokenizer=tok, task_to_env={"math": env}, num_generations_per_prompt=2, max_seq_len=8192,
            max_rollout_turns=1, policy_generation=one_answer(tok, answer),
            generation_config=GenerationConfig(max_new_tokens=4096, seed=0),
        )
        records.append(await manager.run_rollout(datum))
    hostile, ordinary = records
    for c in hostile.completions:
        assert c.reward == 0.0 and c.stop_reason is StopReason.NATURAL and c.error is None
        assert c.env_extras["grading"] == "timeout" and c.env_extras["vote_key"] is None
    assert hostile.rollout_metrics["rollout/grading_timeouts"] == 2.0
    assert [c.reward for c in ordinary.completions] == [1.0, 1.0]
    assert all(c.env_extras["grading"] == "ok" for c in ordinary.completions)
    assert ordinary.rollout_metrics["rollout/grading_timeouts"] == 0.0


def test_rollout_metrics_count_grading_timeouts() -> None:
    prompt = (Message("user", "q", (1,)),)

    def completion(grading: str | None) -> Completion:
        extras = {} if grading is None else {"grading": grading}
        log = (*prompt, Message("assistant", "a", (2,), (-0.1,)))
        return Completion(log, 0.0, False, StopReason.NATURAL, 1, "math", extras)

    completions = [completion("timeout"), completion("ok"), completion(None), completion("timeout")]
    assert rollout_metrics(completions, [1] * 4, 1.0)["rollout/grading_timeouts"] == 2.0
