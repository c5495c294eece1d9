"""The on-policy distillation update: how a teacher's per-token scores enter the policy loss.

Token convention as `loss.py`: every `[B, T]` tensor is indexed by the token it scores. For a trained token t
that the teacher scored, with s_t the student's logprob of the sampled token under the policy before this update
(the trainer's `old_logprobs`, detached) and q_t the teacher's:

  reverse (sampled tokens, tinker-cookbook's `incorporate_kl_penalty`): per-token advantage
      A_t = c_rev * -(s_t - q_t) + reward_weight * A_grpo
  forward over the teacher's top-k ids K_t (NeMo-RL's `DistillationLossFn`, renormalised within k):
      p_hat = softmax over K_t of the teacher's logprobs, s_hat = softmax over K_t of the student's (with its gradient)
      fkl_t = sum_{i in K_t} p_hat_i * (log p_hat_i - log s_hat_i), added to the loss as c_fwd * aggregate(fkl)
  c_rev, c_fwd = (1, 0) for reverse, (0, 1) for forward, (1 - w, w) for mixed (w = mixed_kl_weight).

A trained token the teacher did not score (an agent without a teacher under strict_agent_name_match: false) keeps
the reward's advantage A_grpo alone. With the teacher equal to the student, s_t = q_t and the reverse advantage is
0; the forward term's gradient is 0 too (its minimum).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl_ext.objectives.aggregation import aggregate


@dataclass(frozen=True)
class DistillationLoss:
    """How the update combines a teacher's scores with the reward (from `on_policy_distillation`)."""

    kl_type: str = "reverse"
    """reverse, forward or mixed (see the module docstring)."""
    mixed_kl_weight: float = 0.5
    """w: the forward term's weight when kl_type is mixed; the reverse advantage gets 1 - w."""
    reward_weight: float = 0.0
    """Weight of the GRPO advantage added to the reverse-KL advantage; 0: pure distillation."""

    def __post_init__(self) -> None:
        if self.kl_type not in ("reverse", "forward", "mixed"):
            raise ValueError(f"kl_type must be reverse, forward or mixed, got {self.kl_type!r}")
        if not 0.0 <= self.mixed_kl_weight <= 1.0 or self.reward_weight < 0:
            raise ValueError(f"mixed_kl_weight must be in [0, 1] and reward_weight >= 0, got {self}")

    @property
    def reverse_weight(self) -> float:
        """c_rev: the reverse-KL advantage's weight."""
        return {"reverse": 1.0, "forward": 0.0}.get(self.kl_type, 1.0 - self.mixed_kl_weight)

    @property
    def forward_weight(self) -> float:
        """c_fwd: the forward-KL loss term's weight."""
        return {"reverse": 0.0, "forward": 1.0}.get(self.kl_type, self.mixed_kl_weight)


@dataclass(frozen=True, eq=False)
class TeacherBatch:
    """A micro-batch's teacher scores, right-padded like its token ids."""

    logprobs: torch.Tensor
    """[B, T] float32: the teacher's logprob of each token; 0 where it scored none."""
    mask: torch.Tensor
    """[B, T] bool: True on the tokens the teacher scored."""
    topk_ids: torch.Tensor | None
    """[B, T, k] int64: the teacher's top-k ids per token (0 where it scored none); None without top-k."""
    topk_logprobs: torch.Tensor | None
    """[B, T, k] float32: the teacher's logprobs of `topk_ids`; None without top-k."""


def teacher_batch(items: Sequence[Any], device: torch.device | str) -> TeacherBatch | None:
    """The teacher tensors of these `CompletionTensors`, right-padded to the longest item, on `device`; None when
    no item carries teacher scores. Top-k only when every scored item has it (all of one width)."""
    if not any(x.teacher_mask is not None for x in items):
        return None
    width = max(int(x.token_ids.numel()) for x in items)
    logprobs = torch.zeros(len(items), width, dtype=torch.float32)
    mask = torch.zeros(len(items), width, dtype=torch.bool)
    scored = [x for x in items if x.teacher_mask is not None]
    with_topk = all(x.teacher_topk_ids is not None for x in scored)
    k = int(scored[0].teacher_topk_ids.shape[-1]) if with_topk else 0
    topk_ids = torch.zeros(len(items), width, k, dtype=torch.int64) if with_topk else None
    topk_lp = torch.zeros(len(items), width, k, dtype=torch.float32) if with_topk else None
    for b, x in enumerate(items):
        if x.teacher_mask is None:
            continue
        n = x.token_ids.numel()
        logprobs[b, :n], mask[b, :n] = x.teacher_logprobs, x.teacher_mask.bool()
        if topk_ids is not None and topk_lp is not None:
            topk_ids[b, :n], topk_lp[b, :n] = x.teacher_topk_ids, x.teacher_topk_logprobs
    moved = [t.to(device) if t is not None else None for t in (logprobs, mask, topk_ids, topk_lp)]
    return TeacherBatch(*moved)


def distillation_advantages(
    old_logprobs: torch.Tensor,
    teacher: TeacherBatch,
    advantages: torch.Tensor,
    settings: DistillationLoss,
) -> torch.Tensor:
    """[B, T] per-token advantages: c_rev * -(old - teacher) + reward_weight * A where the teacher scored the
    token, A elsewhere (`advantages`: [B] per sequence or [B, T]); detached."""
    shape = old_logprobs.shape
    adv = advantages.detach().to(torch.float32)
    adv = (adv.reshape(-1, 1) if adv.ndim == 1 else adv).expand(shape)
    reverse = -(old_logprobs.detach().float() - teacher.logprobs.float())
    distilled = settings.reverse_weight * reverse + settings.reward_weight * adv
    return torch.where(teacher.mask, distilled, adv)


def topk_forward_kl(student_topk_logprobs: torch.Tensor, teacher_topk_logprobs: torch.Tensor) -> torch.Tensor:
    """[B, T] KL(p_hat || s_hat) over the k ids of each token, both renormalised within k (log_softmax over the last
    dimension of the full-vocabulary logprobs): sum_i p_hat_i (log p_hat_i - log s_hat_i). The student's carries the
    gradient."""
    student = torch.log_softmax(student_topk_logprobs.float(), dim=-1)
    teacher = torch.log_softmax(teacher_topk_logprobs.float().detach(), dim=-1)
    return (teacher.exp() * (teacher - student)).sum(dim=-1)


def forward_kl_loss(
    student_topk_logprobs: torch.Tensor | None,
    teacher: TeacherBatch,
    valid: torch.Tensor,
    loss_config: Any,
    settings: DistillationLoss,
    count: float | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(c_fwd * the aggregated forward KL over the trained tokens the teacher scored, the per-token forward KL);
    (None, None) when kl_type is reverse. Aggregated as the policy loss (`loss.aggregation`, divided by `count`)."""
    if settings.forward_weight == 0.0:
        return None, None
    if student_topk_logprobs is None or teacher.topk_logprobs is None:
        raise ValueError(f"kl_type {settings.kl_type} needs the teacher's top-k (on_policy_distillation.top_k > 0)")
    fkl = topk_forward_kl(student_topk_logprobs, teacher.topk_logprobs)
    scored = valid & teacher.mask
    return settings.forward_weight * aggregate(fkl, scored, loss_config, count), fkl


@torch.no_grad()
def distillation_metrics(
    old_logprobs: torch.Tensor,
    teacher: TeacherBatch,
    valid: torch.Tensor,
    agents: Sequence[str | None],
    forward_kl: torch.Tensor | None = None,
) -> dict[str, float]:
    """Sums and counts of the per-token reverse KL estimate s - q (tinker's `teacher_kl`) over the trained tokens
    the teacher scored, overall and per agent (`agents[b]`: sequence b's agent), and of the forward KL when given:
    `sum:<key>` and `n:<key>` pairs that the trainers' metric sums turn into the mean `<key>`
    (`distill/reverse_kl`, `distill/reverse_kl/<agent>`, `distill/forward_kl`)."""
    scored = valid & teacher.mask
    gap = torch.where(scored, old_logprobs.detach().float() - teacher.logprobs.float(), 0.0)
    out: dict[str, float] = {}
    _add_mean(out, "distill/reverse_kl", float(gap.sum()), float(scored.sum()))
    for agent in sorted({a for a in agents if a}):
        rows = torch.tensor([a == agent for a in agents], device=scored.device)
        _add_mean(out, f"distill/reverse_kl/{agent}", float(gap[rows].sum()), float(scored[rows].sum()))
    if forward_kl is not None:
        _add_mean(out, "distill/forward_kl", float(torch.where(scored, forward_kl.detach(), 0.0).sum()),
                  float(scored.sum()))
    return out


def _add_mean(out: dict[str, float], key: str, total: float, count: float) -> None:
    out[f"sum:{key}"] = out.get(f"sum:{key}", 0.0) + total
    out[f"n:{key}"] = out.get(f"n:{key}", 0.0) + count


def means_of_sums(sums: Mapping[str, float]) -> dict[str, float]:
    """`<key>`: sum / n for every `sum:<key>` with its `n:<key>` (0.0 over no token)."""
    return {
        key[4:]: (value / sums[f"n:{key[4:]}"] if sums.get(f"n:{key[4:]}") else 0.0)
        for key, value in sums.items()
        if key.startswith("sum:")
    }


@dataclass(frozen=True, eq=False)
class DistillationTerms:
    """What distillation changes in one micro-batch's loss."""

    advantages: torch.Tensor
    """[B, T] per-token advantages for the policy loss (`distillation_advantages`)."""
    extra_loss: torch.Tensor | None
    """The forward-KL term to add to the policy loss; None for reverse."""
    metrics: dict[str, float]
    """`distillation_metrics`' sums and counts."""


def distillation_terms(
    settings: DistillationLoss,
    teacher: TeacherBatch,
    *,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    student_topk_logprobs: torch.Tensor | None,
    loss_config: Any,
    count: float | None,
    agents: Sequence[str | None],
) -> DistillationTerms:
    """The per-token advantages, forward term and metrics of a micro-batch (both trainers call this)."""
    valid = mask.bool()
    extra, fkl = forward_kl_loss(student_topk_logprobs, teacher, valid, loss_config, settings, count)
    return DistillationTerms(
        advantages=distillation_advantages(old_logprobs, teacher, advantages, settings),
        extra_loss=extra,
        metrics=distillation_metrics(old_logprobs, teacher, valid, agents, fkl),
    )


def distillation_loss(settings: Any) -> DistillationLoss | None:
    """The update's settings from an `on_policy_distillation` section (`DistillationSettings`); None when it is
    not enabled."""
    if settings is None or not settings.enabled:
        return None
    return DistillationLoss(settings.kl_type, settings.mixed_kl_weight, settings.reward_weight)
