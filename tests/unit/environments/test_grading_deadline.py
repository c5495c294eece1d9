"""Grading under a hard per-answer deadline: hostile answers are killed in their worker, the others finish.
The tests that start a grading script as its own process (35 answers at once, a killed caller) are in
tests/functional/test_grading_processes.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from hostile_answers import HOSTILE

from nemo_rl_ext.data.datasets import datum_from_messages
from nemo_rl_ext.data.records import Completion, Message, StopReason
from nemo_rl_ext.environments import MathEnvironment, ToolCalculatorEnvironment
from nemo_rl_ext.environments.grading_pool import GradingPool
from nemo_rl_ext.environments.math_grading import extract_answer, grade_answer
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.experience.rollout_metrics import rollout_metrics
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.testing import ScriptedGeneration


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
