"""On-policy distillation in nemo_gym mode: one GRPO step whose rollouts come from real NeMo Gym 0.7.0 agents
(agent_alpha and agent_beta calling our policy server on the tiny model), with a local teacher (another tiny
model, the student's tokenizer). Each Gym record's assistant messages carry the teacher's logprobs (and top-2) of
the exact ids the student produced, equal to a separate forward pass of the teacher over the same ids; the step's
metrics report the KL per agent and the update's."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from teacher_checks import TIE
from test_grpo_gym import gym_grpo_config
from tolerances import SAME_MODEL_LOGPROBS, approx

from nemo_rl_ext.grpo.batch import build_training_batch
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.models.loading import load_model_and_tokenizer
from nemo_rl_ext.testing import forward_logprobs
from nemo_rl_ext.testing.reference import forward_top_logprobs

pytestmark = [pytest.mark.gym, pytest.mark.timeout(900)]
TOP_K = 2


def assert_scored_as_forward(completion, teacher) -> int:
    """Each assistant message of `completion` carries the teacher's logprobs and top-k of its own ids after
    everything before it (prompt and earlier turns), as one forward pass of `teacher` computes them
    (`SAME_MODEL_LOGPROBS`); no other message is scored. Returns the number of scored tokens."""
    context: list[int] = []
    scored = 0
    for m in completion.message_log:
        if m.role != "assistant":
            assert m.teacher_logprobs is None and m.teacher_topk_ids is None, m.role
        else:
            assert len(m.teacher_logprobs) == len(m.token_ids) > 0
            want = forward_logprobs(teacher, context, m.token_ids, 1.0).tolist()
            assert list(m.teacher_logprobs) == approx(want, SAME_MODEL_LOGPROBS)
            values, ids = forward_top_logprobs(teacher, context, m.token_ids, TOP_K)
            assert [list(v) for v in m.teacher_topk_logprobs] == [approx(v, SAME_MODEL_LOGPROBS) for v in values]
            for got, want_ids, vals in zip(m.teacher_topk_ids, ids, values, strict=True):
                if vals[0] - vals[1] > TIE:  # two logprobs within rounding may swap places
                    assert list(got) == want_ids
            scored += len(m.token_ids)
        context += m.token_ids
    return scored


def test_gym_records_carry_the_teachers_forward_pass(gym_venv, tmp_path, monkeypatch):
    from nemo_rl_ext.grpo import loop as grpo_module
    from nemo_rl_ext.models.tiny import build_tiny_model

    steps = []  # the records of each step, as the trainer gets them

    def recording_build_training_batch(records, **kwargs):
        steps.append(list(records))
        return build_training_batch(records, **kwargs)

    monkeypatch.setattr(grpo_module, "build_training_batch", recording_build_training_batch)
    student = build_tiny_model(tmp_path / "tiny", seed=0, initializer_range=0.05)
    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=1)  # other weights, the student's tokenizer
    cfg = gym_grpo_config({"model_name": str(student), "max_model_len": 512}, gym_venv, tmp_path, steps=1)
    cfg = GRPOConfig.model_validate({**cfg.model_dump(), "on_policy_distillation": {
        "enabled": True, "default_teacher_alias": str(teacher_dir), "top_k": TOP_K}})
    with GRPO(cfg) as grpo:
        grpo.run()
    teacher, _ = load_model_and_tokenizer(teacher_dir)

    ((alpha, beta),) = steps  # the first two Gym rows: one group of each agent, every completion scored
    assert [(r.agent_name, len(r.completions)) for r in (alpha, beta)] == [("agent_alpha", 4), ("agent_beta", 3)]
    scored = {}
    for record in (alpha, beta):
        assert all(c.error is None for c in record.completions)
        scored[record.agent_name] = sum(assert_scored_as_forward(c, teacher) for c in record.completions)
    (step,) = [m for m in read_metrics(Path(cfg.output_dir) / "metrics.jsonl") if m.get("step", 0) > 0]
    assert step["rollout/errors"] == 0 and step["distill/scored_tokens"] == sum(scored.values()), step
    for key in ("distill/reverse_kl", "agent/agent_alpha/distill/reverse_kl", "agent/agent_beta/distill/reverse_kl",
                "train/distill/reverse_kl"):
        assert isinstance(step[key], float) and math.isfinite(step[key]), (key, step)
    assert step["distill/reverse_kl"] > 1.0, step  # another random model: a real KL (~10 nats a token)
