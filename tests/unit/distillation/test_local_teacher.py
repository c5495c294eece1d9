"""A local teacher scores a record's assistant tokens: the same numbers as a separate forward pass of the
teacher over the same ids, for a multi-turn record with tool turns in between."""

from __future__ import annotations

import cloudpickle
import pytest
from teacher_checks import assert_scores_match_forward, tool_datum, tool_manager

from nemo_rl_ext.distillation.local_teacher import LocalTeacher, batches
from nemo_rl_ext.distillation.scoring import TeacherScorer
from nemo_rl_ext.experience.rollout_manager import batch_metrics


@pytest.fixture(scope="module")
def teacher(tiny_model_dir):
    """The tiny model loaded again as a teacher (its own copy: the shared fixture model is never frozen here)."""
    t = LocalTeacher.load(str(tiny_model_dir), max_batch_tokens=256)  # small: the group runs in several batches
    yield t
    t.close()


async def test_teacher_scores_every_assistant_turn_as_a_separate_forward(tiny_model_and_tokenizer, teacher):
    model, tok = tiny_model_and_tokenizer
    record = await tool_manager(tok, TeacherScorer({"calc": teacher}, top_k=3)).run_rollout(tool_datum(tok))
    assert len(record.completions) == 2
    assert_scores_match_forward(record, model, 3)
    terms = [g - t for c in record.completions for m in c.message_log if m.role == "assistant"
             for g, t in zip(m.generation_logprobs, m.teacher_logprobs, strict=True)]
    metrics = record.rollout_metrics
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(terms) / len(terms), rel=1e-12)
    assert metrics["agent/calc/distill/reverse_kl"] == metrics["distill/reverse_kl"]
    assert metrics["distill/teacher_tokens"] == sum(len(c.token_ids) for c in record.completions)
    assert metrics["distill/teacher_time_s"] > 0
    batch = batch_metrics([record], 1.0)
    assert batch["distill/reverse_kl"] == pytest.approx(metrics["distill/reverse_kl"], rel=1e-12)
    assert batch["distill/scored_tokens"] == len(terms) and batch["distill/teacher_tokens_per_s"] > 0
    # records cross Ray (an eval worker, a remote collector) pickled: the teacher's scores travel with them
    copy = cloudpickle.loads(cloudpickle.dumps(record))
    assert copy == record and copy.completions[0].message_log[1].teacher_topk_ids is not None


async def test_an_agent_without_a_teacher_is_not_scored(tiny_model_and_tokenizer, teacher):
    _, tok = tiny_model_and_tokenizer
    record = await tool_manager(tok, TeacherScorer({"other": teacher})).run_rollout(tool_datum(tok))
    assert all(m.teacher_logprobs is None for c in record.completions for m in c.message_log)
    assert "distill/reverse_kl" not in record.rollout_metrics


def test_the_teacher_is_frozen(teacher):
    assert not teacher.model.training
    assert not any(p.requires_grad for p in teacher.model.parameters())


def test_batches_stay_within_the_padded_token_budget():
    seqs = [[1] * n for n in (3, 5, 2, 9, 1)]
    cut = batches(seqs, 10)
    assert [s for b in cut for s in b] == seqs  # order kept, nothing lost
    assert [[len(s) for s in b] for b in cut] == [[3, 5], [2], [9], [1]]
