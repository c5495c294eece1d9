"""Where GRPO's local teacher lives: in this process with one trainer worker, on the trainer ranks (never loaded
here) with `trainer.workers > 1`; a URL is a teacher over HTTP either way."""

from __future__ import annotations

from nemo_rl_ext.distillation.local_teacher import LocalTeacher
from nemo_rl_ext.distillation.rank_teacher import RankTeacher
from nemo_rl_ext.grpo.build import teacher_scorer
from nemo_rl_ext.grpo.config import GRPOConfig


class Trainer:
    """Stands for `DistributedTrainer`'s teacher side: records what it was asked to load."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_teacher(self, spec: str) -> str:
        self.loaded.append(spec)
        return f"teacher-{len(self.loaded) - 1}"


def config(workers: int) -> GRPOConfig:
    return GRPOConfig.model_validate({
        "policy": {"model_name": "tiny"}, "trainer": {"workers": workers}, "data": {"train_path": "rows.jsonl"},
        "on_policy_distillation": {"enabled": True, "teacher_model_by_agent_name": {
            "math": "/models/teacher", "code": "/models/teacher", "chat": "http://127.0.0.1:9/v1"}},
    })


def test_with_two_workers_the_driver_loads_no_teacher(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the driver loaded a local teacher")

    monkeypatch.setattr(LocalTeacher, "load", refuse)
    trainer = Trainer()
    scorer = teacher_scorer(config(2), trainer)
    assert trainer.loaded == ["/models/teacher"]  # once: math and code share it
    assert isinstance(scorer.teacher_for("math"), RankTeacher) and scorer.teacher_for("math").host is trainer
    assert type(scorer.teacher_for("chat")).__name__ == "HttpTeacher"
    scorer.close()


def test_with_one_worker_the_teacher_loads_here(monkeypatch):
    loads: list[str] = []

    class Loaded:  # what LocalTeacher.load returns, without a model
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            pass

    monkeypatch.setattr(LocalTeacher, "load", classmethod(lambda cls, name, **kw: loads.append(name) or Loaded(name)))
    trainer = Trainer()
    scorer = teacher_scorer(config(1), trainer)
    assert loads == ["/models/teacher"] and trainer.loaded == []
    assert isinstance(scorer.teacher_for("math"), Loaded) and scorer.teacher_for("code") is scorer.teacher_for("math")
