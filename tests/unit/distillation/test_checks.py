"""The checks of on-policy distillation before any model loads, and which teacher scores which agent."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.data.datasets import datum_from_messages
from nemo_rl_ext.distillation.checks import distillation_problems
from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.distillation.teacher import Teacher
from nemo_rl_ext.distillation.teachers import build_scorer, unmapped_problem
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.models.loading import load_tokenizer


def settings(**kwargs) -> DistillationSettings:
    return DistillationSettings(enabled=True, **kwargs)


def teacher_folder(tiny_model_dir: Path, dest: Path, change) -> Path:
    """A copy of the tiny model whose tokenizer `change` edited (the weights are the same)."""
    shutil.copytree(tiny_model_dir, dest)
    tok = load_tokenizer(dest)
    change(tok)
    tok.save_pretrained(dest)
    return dest


def test_unmapped_agents_are_one_error_listing_them_all():
    problem = unmapped_problem(settings(teacher_model_by_agent_name={"a": "tiny"}), ["a", "c", "b", "c"])
    assert problem.startswith("on_policy_distillation: no teacher for agent(s) ['b', 'c']")
    assert unmapped_problem(settings(teacher_model_by_agent_name={"a": "tiny"}, strict_agent_name_match=False),
                            ["b"]) is None
    assert unmapped_problem(settings(teacher_model_by_agent_name={"a": "tiny"}, default_teacher_alias="a"),
                            ["b"]) is None


def test_enabled_without_any_teacher_is_a_config_error():
    with pytest.raises(ValidationError, match="enabled needs a teacher"):
        DistillationSettings(enabled=True)


class Named(Teacher):
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = 0

    async def score(self, sequences, top_k=0):
        raise AssertionError("not called")

    def close(self) -> None:
        self.closed += 1


def test_shared_teachers_are_one_object_unless_deduplication_is_off():
    mapping = {"a": "m1", "b": "m1", "c": "m2"}
    made: list[str] = []

    def make(spec, _):
        made.append(spec)
        return Named(spec)

    scorer = build_scorer(settings(teacher_model_by_agent_name=mapping, default_teacher_alias="c"), make)
    assert made == ["m1", "m2"] and scorer.teachers["a"] is scorer.teachers["b"]
    assert scorer.teacher_for("zzz") is scorer.teachers["c"]  # the alias names agent c: c's teacher
    scorer.close()
    assert [t.closed for t in (scorer.teachers["a"], scorer.teachers["c"])] == [1, 1]  # each closed once
    made.clear()
    scorer = build_scorer(settings(teacher_model_by_agent_name=mapping, deduplicate_shared_teacher_checkpoints=False,
                                   default_teacher_alias="m3"), make)
    assert made == ["m1", "m1", "m2", "m3"] and scorer.teachers["a"] is not scorer.teachers["b"]
    assert build_scorer(DistillationSettings(), make) is None


def test_a_teacher_with_another_vocabulary_is_refused_naming_it(tiny_model_dir, tmp_path):
    student = load_tokenizer(tiny_model_dir)
    bigger = teacher_folder(tiny_model_dir, tmp_path / "bigger",
                            lambda t: t.add_special_tokens({"additional_special_tokens": ["<|extra|>"]}))
    [problem] = distillation_problems(settings(teacher_model_by_agent_name={"calc": str(bigger)}), ["calc"], student)
    assert problem.startswith(f"on_policy_distillation: teacher {str(bigger)!r} does not share the student's tokenizer")
    assert f"vocabulary of {len(student) + 1} ids, the student's has {len(student)}" in problem
    assert distillation_problems(settings(teacher_model_by_agent_name={"calc": str(tiny_model_dir)}), ["calc"],
                                 student) == []


def test_a_teacher_with_another_chat_template_is_refused_naming_the_ids(tiny_model_dir, tmp_path):
    student = load_tokenizer(tiny_model_dir)

    def plain_template(t):
        t.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"

    other = teacher_folder(tiny_model_dir, tmp_path / "other", plain_template)
    [problem] = distillation_problems(settings(teacher_model_by_agent_name={"calc": str(other)}), ["calc"], student)
    assert "its chat template renders ids" in problem and str(other) in problem
    im_start = student.convert_tokens_to_ids("<|im_start|>")
    assert f"where the student's renders {im_start}" in problem


def test_the_grpo_run_reports_every_distillation_problem_at_once(tiny_model_dir, tmp_path):
    from nemo_rl_ext.grpo.build import check_inputs

    bigger = teacher_folder(tiny_model_dir, tmp_path / "bigger",
                            lambda t: t.add_special_tokens({"additional_special_tokens": ["<|extra|>"]}))
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump({
        "data": {"train_path": "x.jsonl"}, "policy": {"model_name": str(tiny_model_dir)},
        "on_policy_distillation": {"enabled": True, "teacher_model_by_agent_name": {
            "a": str(bigger), "b": str(tmp_path / "no_such_teacher")}},
    }))
    cfg = load_config(path, [], GRPOConfig)
    tok = load_tokenizer(tiny_model_dir)
    datums = [datum_from_messages(tok, i, [{"role": "user", "content": "hi"}], task_name="math", agent_name=agent)
              for i, agent in enumerate(["a", "c", "d"])]
    with pytest.raises(ConfigError) as err:
        check_inputs(cfg, datums, [])
    message = str(err.value)
    assert "no teacher for agent(s) ['c', 'd']" in message
    assert f"teacher {str(bigger)!r} does not share the student's tokenizer" in message
    assert f"teacher {str(tmp_path / 'no_such_teacher')!r}: " in message and "config.json" in message
