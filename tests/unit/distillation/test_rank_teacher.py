"""A teacher on the trainer ranks, through a test double of the distributed trainer (`TeacherHost`): the driver
loads nothing, the batches it sends are the local teacher's and come back in order, one host teacher per distinct
model (deduplicated), and a host that fails is a teacher failure: the fault policy's error completions, as over
HTTP (two ranks for real: tests/functional/test_trainer_workers_teacher.py)."""

from __future__ import annotations

import copy

import pytest
from teacher_checks import tool_datum, tool_manager

from nemo_rl_ext.data.records import StopReason
from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.distillation.local_teacher import LocalTeacher, batches, score_batch
from nemo_rl_ext.distillation.rank_teacher import RankTeacher, teachers_on
from nemo_rl_ext.distillation.scoring import TeacherScorer
from nemo_rl_ext.distillation.teachers import build_scorer
from nemo_rl_ext.experience.fault_policy import FaultPolicy, RolloutError


class Host:
    """Stands for `DistributedTrainer`: holds "loaded" teachers by key and scores batches with `model` in this
    process (`score_batch`, what every rank runs); `error` makes every score call raise it."""

    def __init__(self, model=None, error: Exception | None = None) -> None:
        self.model, self.error = model, error
        self.loaded: list[str] = []
        self.calls: list[tuple[str, list[list[list[int]]], int]] = []

    def load_teacher(self, spec: str) -> str:
        self.loaded.append(spec)
        return f"teacher-{len(self.loaded) - 1}"

    def score_teacher(self, key, cut, top_k):
        self.calls.append((key, list(cut), top_k))
        if self.error is not None:
            raise self.error
        return [score_batch(self.model, batch, top_k) for batch in cut]


@pytest.fixture
def no_local_loads(monkeypatch):
    """A local teacher loaded in this process fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the driver loaded a local teacher")

    monkeypatch.setattr(LocalTeacher, "load", refuse)


def settings(**mapping) -> DistillationSettings:
    return DistillationSettings(enabled=True, teacher_model_by_agent_name=mapping, max_batch_tokens=200)


def test_local_teachers_load_on_the_host_once_per_model_never_here(no_local_loads):
    host = Host()
    scorer = build_scorer(settings(a="/m/one", b="/m/one", c="/m/two", d="http://127.0.0.1:9/v1"), teachers_on(host))
    assert host.loaded == ["/m/one", "/m/two"]  # a shared folder loads once; a URL is a teacher over HTTP
    assert scorer.teacher_for("a") is scorer.teacher_for("b") and isinstance(scorer.teacher_for("c"), RankTeacher)
    assert type(scorer.teacher_for("d")).__name__ == "HttpTeacher"
    scorer.close()
    unshared = build_scorer(settings(a="/m/one", b="/m/one").model_copy(
        update={"deduplicate_shared_teacher_checkpoints": False}), teachers_on(host))
    assert host.loaded[2:] == ["/m/one", "/m/one"]  # one sharded teacher per agent, as asked
    unshared.close()


async def test_scores_come_back_in_order_from_the_local_teachers_batches(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    host = Host(model)
    local = LocalTeacher(copy.deepcopy(model), "tiny", max_batch_tokens=200)  # it freezes its model: not the shared one
    scorer = build_scorer(settings(calc="tiny"), teachers_on(host))
    record = await tool_manager(tok, scorer).run_rollout(tool_datum(tok))
    want = await tool_manager(tok, TeacherScorer({"calc": local})).run_rollout(tool_datum(tok))
    (key, cut, top_k), = host.calls  # the group in one call, cut as the local teacher cuts it
    assert key == "teacher-0" and top_k == 0
    assert cut == batches([list(c.token_ids) for c in record.completions], 200) and len(cut) > 1
    assert [c.message_log for c in record.completions] == [c.message_log for c in want.completions]
    assert record.rollout_metrics["distill/scored_tokens"] > 0
    scorer.close()
    local.close()


async def test_a_teacher_that_fails_on_a_rank_makes_error_completions(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    host = Host(error=RuntimeError("trainer worker rank 1 (pid 7) on node n (127.0.0.1) died: RayActorError"))
    scorer = TeacherScorer({"calc": RankTeacher(host, "/m/teacher")})
    record = await tool_manager(tok, scorer).run_rollout(tool_datum(tok))
    for c in record.completions:  # infrastructure: an error completion, never a score of 0
        assert c.stop_reason is StopReason.ERROR and c.reward == 0.0 and c.env_extras["teacher_error"] is True
        assert c.error.startswith("teacher /m/teacher: TeacherError: trainer ranks: RuntimeError: trainer worker rank 1")
        assert all(m.teacher_logprobs is None for m in c.message_log)
    assert record.rollout_metrics["distill/teacher_failures"] == 1
    manager = tool_manager(tok, scorer, fault_policy=FaultPolicy(on_error="raise"))
    with pytest.raises(RolloutError, match="row 0: teacher /m/teacher: TeacherError: trainer ranks"):
        await manager.run_rollout(tool_datum(tok))
    scorer.close()
