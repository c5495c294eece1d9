"""The on-policy distillation update's math on hand-made tensors: per-token reverse-KL advantages, the forward
KL over the teacher's top-k (renormalised within k), mixed weights, metrics, and the record-to-tensor plumbing."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_ext.data.records import Completion, Message, StopReason
from nemo_rl_ext.objectives.distillation import (
    DistillationLoss,
    TeacherBatch,
    distillation_advantages,
    distillation_metrics,
    distillation_terms,
    means_of_sums,
    teacher_batch,
    topk_forward_kl,
)
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, completion_to_tensors

# float32 inputs, results a few float32 operations away: a few ulps relative (tests/tolerances.py)
FEW_ULPS = {"rel": 1e-6, "abs": 1e-7}


def _teacher(logprobs, mask, topk_ids=None, topk_logprobs=None) -> TeacherBatch:
    return TeacherBatch(
        torch.tensor(logprobs),
        torch.tensor(mask),
        torch.tensor(topk_ids) if topk_ids is not None else None,
        torch.tensor(topk_logprobs) if topk_logprobs is not None else None,
    )


OLD = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.25, -3.0, 0.0]])
TEACHER = _teacher([[0.0, -1.5, -1.0, 0.0], [0.0, -0.25, -0.5, 0.0]],
                   [[False, True, True, False], [False, True, True, False]])
GRPO = torch.tensor([0.4, -1.0])


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        # reverse, pure distillation: -(s - q) on scored tokens; A (the reward's) where the teacher scored none
        (DistillationLoss("reverse"), [[0.4, -0.5, 1.0, 0.4], [-1.0, 0.0, 2.5, -1.0]]),
        # + reward_weight * A on the scored tokens
        (DistillationLoss("reverse", reward_weight=0.5), [[0.4, -0.3, 1.2, 0.4], [-1.0, -0.5, 2.0, -1.0]]),
        # mixed: the reverse advantage weighted 1 - w
        (DistillationLoss("mixed", mixed_kl_weight=0.25), [[0.4, -0.375, 0.75, 0.4], [-1.0, 0.0, 1.875, -1.0]]),
        # forward: the policy-gradient term gets the reward alone (weighted) on scored tokens
        (DistillationLoss("forward", reward_weight=2.0), [[0.4, 0.8, 0.8, 0.4], [-1.0, -2.0, -2.0, -1.0]]),
    ],
)
def test_per_token_advantages_by_hand(settings, expected):
    adv = distillation_advantages(OLD, TEACHER, GRPO, settings)
    assert adv.tolist() == [pytest.approx(row, **FEW_ULPS) for row in expected]
    assert not adv.requires_grad


def test_advantages_are_detached_from_the_student():
    old = OLD.clone().requires_grad_(True)
    adv = distillation_advantages(old, TEACHER, GRPO, DistillationLoss())
    assert not adv.requires_grad


def test_forward_kl_over_the_top_k_renormalised_by_hand():
    # teacher: p(a) = 0.6, p(b) = 0.2 of the full vocabulary -> within k: 0.75, 0.25; student 0.1, 0.3 -> 0.25, 0.75
    teacher = torch.log(torch.tensor([[[0.6, 0.2]]]))
    student = torch.log(torch.tensor([[[0.1, 0.3]]])).requires_grad_(True)
    fkl = topk_forward_kl(student, teacher)
    expected = 0.75 * math.log(0.75 / 0.25) + 0.25 * math.log(0.25 / 0.75)  # = 0.5 ln 3
    assert float(fkl.detach()) == pytest.approx(expected, **FEW_ULPS)
    fkl.sum().backward()
    # d/ds_i of -sum p_hat log softmax(s)_i = s_hat_i - p_hat_i
    assert student.grad[0, 0].tolist() == pytest.approx([0.25 - 0.75, 0.75 - 0.25], **FEW_ULPS)


def test_forward_kl_is_zero_for_a_student_equal_to_its_teacher_within_k():
    lp = torch.log(torch.tensor([[[0.5, 0.1, 0.05]]]))
    student = (lp * 2 - lp).clone().requires_grad_(True)  # the same values
    fkl = topk_forward_kl(student, lp)
    fkl.sum().backward()
    assert float(fkl.detach()) == pytest.approx(0.0, abs=1e-7)
    assert student.grad.abs().max() < 1e-7


def test_mixed_loss_value_by_hand():
    """mixed, w = 0.25: the loss term is w * the token mean of the forward KL over the scored trained tokens (here
    one scored token of two trained), divided by the minibatch's trained-token count (token-mean)."""
    teacher = _teacher([[0.0, -0.2, -1.0]], [[False, True, False]],
                       topk_ids=[[[0, 0], [3, 4], [0, 0]]],
                       topk_logprobs=[[[0.0, 0.0], [math.log(0.6), math.log(0.2)], [0.0, 0.0]]])
    student_topk = torch.zeros(1, 3, 2)
    student_topk[0, 1] = torch.log(torch.tensor([0.1, 0.3]))
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    terms = distillation_terms(
        DistillationLoss("mixed", mixed_kl_weight=0.25), teacher, old_logprobs=torch.tensor([[0.0, -0.7, -1.0]]),
        advantages=torch.tensor([1.0]), mask=mask, student_topk_logprobs=student_topk,
        loss_config=ClippedPGLossConfig(), count=2.0, agents=["a"],
    )
    assert float(terms.extra_loss) == pytest.approx(0.25 * 0.5 * math.log(3) / 2, **FEW_ULPS)
    # reverse part: 0.75 * -(-0.7 + 0.2) on the scored token, the reward's advantage (1.0) on the other
    assert terms.advantages.tolist() == [pytest.approx([1.0, 0.375, 1.0], **FEW_ULPS)]
    means = means_of_sums(terms.metrics)
    assert means["distill/reverse_kl"] == pytest.approx(-0.5, **FEW_ULPS)
    assert means["distill/forward_kl"] == pytest.approx(0.5 * math.log(3), **FEW_ULPS)


def test_forward_without_top_k_is_an_error():
    with pytest.raises(ValueError, match="top_k"):
        distillation_terms(DistillationLoss("forward"), TEACHER, old_logprobs=OLD, advantages=GRPO,
                           mask=torch.ones_like(OLD), student_topk_logprobs=None, loss_config=ClippedPGLossConfig(),
                           count=None, agents=[None, None])


def test_reverse_kl_metrics_per_token_and_per_agent():
    valid = torch.tensor([[False, True, True, True], [False, True, True, False]])
    metrics = means_of_sums(distillation_metrics(OLD, TEACHER, valid, ["math", "code"]))
    # s - q on the scored trained tokens: row 0: 0.5, -1.0; row 1: 0.0, -2.5
    assert metrics["distill/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0 - 2.5) / 4, **FEW_ULPS)
    assert metrics["distill/reverse_kl/math"] == pytest.approx(-0.25, **FEW_ULPS)
    assert metrics["distill/reverse_kl/code"] == pytest.approx(-1.25, **FEW_ULPS)
    assert "distill/forward_kl" not in metrics


def _completion(top_k: bool) -> Completion:
    topk = dict(teacher_topk_ids=((5, 6), (7, 8)), teacher_topk_logprobs=((-0.1, -2.0), (-0.3, -1.5))) if top_k else {}
    return Completion(
        message_log=(
            Message("user", "q", (1, 2, 3)),
            Message("assistant", "a", (4, 5), generation_logprobs=(-0.5, -0.6), teacher_logprobs=(-0.4, -0.9), **topk),
            Message("tool", "r", (9,)),
            Message("assistant", "b", (10, 11), generation_logprobs=(-0.1, -0.2), teacher_logprobs=(-0.2, -0.3),
                    **({"teacher_topk_ids": ((10, 1), (11, 2)), "teacher_topk_logprobs": ((-0.2, -3.0), (-0.3, -2.0))}
                       if top_k else {})),
        ),
        reward=1.0, truncated=False, stop_reason=StopReason.NATURAL, num_turns=2, agent_name="math",
    )


def test_teacher_scores_travel_from_the_record_aligned_with_the_trained_tokens():
    x = completion_to_tensors(_completion(top_k=True))
    assert x.loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert x.teacher_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    assert x.teacher_logprobs.tolist() == pytest.approx([0, 0, 0, -0.4, -0.9, 0, -0.2, -0.3])
    assert x.teacher_topk_ids.tolist() == [[0, 0]] * 3 + [[5, 6], [7, 8], [0, 0], [10, 1], [11, 2]]
    assert x.teacher_topk_logprobs[4].tolist() == pytest.approx([-0.3, -1.5])
    assert x.agent_name == "math"
    plain = completion_to_tensors(_completion(top_k=False))
    assert plain.teacher_topk_ids is None and plain.teacher_mask is not None


def test_a_micro_batch_pads_the_teacher_scores_and_leaves_unscored_items_masked():
    scored = completion_to_tensors(_completion(top_k=True))
    unscored = completion_to_tensors(Completion(
        message_log=(Message("user", "q", (1,)), Message("assistant", "a", (2,), generation_logprobs=(-1.0,))),
        reward=0.0, truncated=False, stop_reason=StopReason.NATURAL, num_turns=1, agent_name="math"))
    batch = teacher_batch([unscored, scored], "cpu")
    assert batch is not None and batch.logprobs.shape == (2, 8) and batch.topk_ids.shape == (2, 8, 2)
    assert not bool(batch.mask[0].any())
    assert batch.mask[1].tolist() == [False] * 3 + [True, True, False, True, True]
    assert teacher_batch([unscored], "cpu") is None
