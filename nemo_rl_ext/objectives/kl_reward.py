"""Reinforce++ advantages and the KL in the reward (NeMo-RL's `ReinforcePlusPlusAdvantageEstimator` with
`loss_fn.use_kl_in_reward`): the per-token KL to the reference is subtracted from the advantage instead of added
to the loss, then the advantages are whitened over every trained token of the step.

    A_i    = r_i - mean of the valid r of i's group   (minus_baseline; else r_i)
    A_i,t  = A_i - kl_coef * kl(prev_i,t, ref_i,t)    (use_kl_in_reward; kl: `loss.kl_penalty` with the loss's
                                                        estimator and clamps, prev = the trainer's logprobs
                                                        before the update, ref = the reference policy's)
    A_i,t  = (A_i,t - mean) / sqrt(max(var, 1e-8))    (mean and population var over the step's trained tokens)

Without the KL every token of a sample has the same advantage, so the whitening needs only each sample's
trained-token count (the driver does it, `whiten_by_tokens`); with it, the trainer does it once it has the
logprobs (`kl_in_reward_advantages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_rl_ext.objectives.advantages import compute_group_advantages
from nemo_rl_ext.objectives.loss import kl_penalty

VAR_FLOOR = 1e-8
"""NeMo-RL's `adv_var.clamp(min=1e-8)` before the reciprocal square root."""


def reinforce_pp_advantages(
    rewards_per_group: Sequence[Sequence[float]],
    minus_baseline: bool = True,
    *,
    valid_per_group: Sequence[Sequence[bool]] | None = None,
) -> list[torch.Tensor]:
    """Per group, float64: r_i - the mean of the group's valid rewards (`minus_baseline`), else r_i; 0 for an
    invalid sample. Not yet whitened (`whiten_by_tokens`, `kl_in_reward_advantages`)."""
    if minus_baseline:
        return compute_group_advantages(rewards_per_group, "mean", normalize_std=False, dtype=torch.float64,
                                        valid_per_group=valid_per_group)
    valid = valid_per_group or [[True] * len(g) for g in rewards_per_group]
    return [torch.tensor([float(r) if ok else 0.0 for r, ok in zip(g, v, strict=True)], dtype=torch.float64)
            for g, v in zip(rewards_per_group, valid, strict=True)]


def whiten_by_tokens(advantages: torch.Tensor, trained_tokens: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages [N] whitened over the step's trained tokens (a sample's advantage counts once per
    trained token, `trained_tokens` [N]): (A - mean) / sqrt(max(var, 1e-8)); all zero without trained tokens."""
    weights = trained_tokens.to(torch.float64)
    total = weights.sum()
    if not bool(total > 0):
        return torch.zeros_like(advantages)
    a = advantages.to(torch.float64)
    mean = (a * weights).sum() / total
    var = ((a - mean) ** 2 * weights).sum() / total
    return ((a - mean) * var.clamp(min=VAR_FLOOR).rsqrt()).to(advantages.dtype)


def kl_in_reward_advantages(
    advantages: torch.Tensor,
    masks: Sequence[torch.Tensor],
    prev_logprobs: Sequence[torch.Tensor],
    reference_logprobs: Sequence[torch.Tensor],
    cfg: Any,
) -> torch.Tensor:
    """[N, L_max] float32 per-token advantages (0 past a sample's end and off its mask): each sample's
    advantage minus `cfg.kl_coef` times the per-token KL estimate of its trained tokens (`cfg.kl_estimator`,
    `cfg.kl_input_clamp_value`, `cfg.kl_output_clamp_value`, as the loss computes it), whitened over every
    trained token of the step (module docstring). `prev_logprobs` and `reference_logprobs` are the trainer's
    and the reference's, one [L_i] tensor per sample, aligned with `masks`."""
    n = len(masks)
    if not (advantages.shape[0] == n == len(prev_logprobs) == len(reference_logprobs)):
        raise ValueError(f"{advantages.shape[0]} advantages, {n} masks, {len(prev_logprobs)} logprobs and "
                         f"{len(reference_logprobs)} reference logprobs: one each per sample")
    width = max((int(m.numel()) for m in masks), default=0)
    out = torch.zeros(n, width, dtype=torch.float64)
    valid = torch.zeros(n, width, dtype=torch.bool)
    for i, mask in enumerate(masks):
        on = mask.to(torch.bool)
        prev = prev_logprobs[i].to(torch.float64)
        ref = reference_logprobs[i].to(torch.float64)
        kl = kl_penalty(prev, ref, cfg.kl_estimator, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
        out[i, : on.numel()] = torch.where(on, float(advantages[i]) - cfg.kl_coef * kl, 0.0)
        valid[i, : on.numel()] = on
    count = valid.sum()
    if not bool(count > 0):
        return out.to(torch.float32)
    mean = out[valid].mean()
    var = ((out[valid] - mean) ** 2).sum() / count
    return torch.where(valid, (out - mean) * var.clamp(min=VAR_FLOOR).rsqrt(), 0.0).to(torch.float32)


def fit_to(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A micro-batch's advantages for its `[B, T]` mask: per-sample [B] as they are, per-token [B, L_max]
    (`kl_in_reward_advantages`) cut to the micro-batch's T (its longest sample: every column past it is 0)."""
    return advantages[:, : mask.shape[1]] if advantages.ndim == 2 else advantages
