"""A teacher that fails turns the group it was to score into error completions (never scores of 0), or raises
under `on_error: raise`; a teacher that answers scores of the wrong length is a bug, raised as it is."""

from __future__ import annotations

import pytest
from teacher_checks import tool_datum, tool_manager

from nemo_rl_ext.data.records import StopReason
from nemo_rl_ext.distillation.scoring import TeacherScorer
from nemo_rl_ext.distillation.teacher import Teacher, TeacherError, TeacherScores
from nemo_rl_ext.experience.fault_policy import FaultPolicy, RolloutError
from nemo_rl_ext.experience.rollout_manager import batch_metrics


class Broken(Teacher):
    """Raises `error` on every call (or answers one score too few with `short`)."""

    name = "http://127.0.0.1:9/v1"

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls = 0

    async def score(self, sequences, top_k=0):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return [TeacherScores((0.0,) * (len(s) - 2)) for s in sequences]


async def test_a_failed_teacher_makes_error_completions_without_scores(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    teacher = Broken(TeacherError("connection refused"))
    record = await tool_manager(tok, TeacherScorer({"calc": teacher})).run_rollout(tool_datum(tok))
    assert teacher.calls == 1  # the group in one call
    for c in record.completions:
        assert c.stop_reason is StopReason.ERROR and c.reward == 0.0 and c.reward_components == {}
        assert c.error == f"teacher {teacher.name}: TeacherError: connection refused"
        assert c.env_extras["teacher_error"] is True
        assert all(m.teacher_logprobs is None for m in c.message_log)
    assert record.rollout_metrics["rollout/errors"] == 2 and record.rollout_metrics["distill/teacher_failures"] == 1
    metrics = batch_metrics([record], 1.0)
    assert metrics["rollout/errors"] == 2 and "distill/reverse_kl" not in metrics


async def test_a_failed_teacher_raises_under_on_error_raise(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    manager = tool_manager(tok, TeacherScorer({"calc": Broken(TimeoutError())}),
                           fault_policy=FaultPolicy(on_error="raise"))
    with pytest.raises(RolloutError, match=r"row 0: teacher http://127.0.0.1:9/v1: TimeoutError"):
        await manager.run_rollout(tool_datum(tok))


async def test_scores_that_do_not_fit_the_ids_are_a_bug_not_a_fault(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    with pytest.raises(ValueError, match="teacher returned .* scores for .* ids"):
        await tool_manager(tok, TeacherScorer({"calc": Broken()})).run_rollout(tool_datum(tok))
