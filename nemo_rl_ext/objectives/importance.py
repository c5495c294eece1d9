"""The importance-sampling weight against the engine (pi_trainer_old / pi_engine) and its truncation.

NeMo-RL's `ClippedPGLossFn` off-policy correction: per token w = exp(old - gen), or per sample (GSPO,
`sequence_level_importance_ratios`) w = exp(sum over its trained tokens of old - gen); then, by
`truncated_importance_sampling_type` with the band [min, max]:
  tis           w = clamp(w, min or 0, max)
  icepop        w = 0 on tokens whose w is outside the band
  seq-mask-tis  w = 0 on every token of a sample whose geometric-mean token w, exp(mean log w), is outside
A masked token keeps its place in the normalisation counts (its loss is 0, it still counts), as in NeMo-RL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl_ext.objectives.loss_settings import truncation_of


@dataclass(frozen=True, eq=False)
class ImportanceWeights:
    """The pg term's weight per token and what the metrics read; all detached, [B, T]."""

    raw: torch.Tensor
    """exp(old - gen) per token (per sample with GSPO), untruncated; 1 without generation logprobs."""
    weight: torch.Tensor
    """The weight the pg term is multiplied by: `raw` truncated or masked; 1 without the correction."""
    masked: torch.Tensor
    """bool: trained tokens whose weight icepop or seq-mask-tis set to 0."""
    truncated: torch.Tensor
    """bool: trained tokens whose weight tis moved into its band."""


def _seq_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the mean of x over each row's valid entries (0 for a row without any)."""
    n = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(x.dtype)
    return torch.where(valid, x, torch.zeros_like(x)).sum(dim=-1, keepdim=True) / n


def importance_weights(
    old: torch.Tensor, generation_logprobs: torch.Tensor | None, valid: torch.Tensor, cfg: Any
) -> ImportanceWeights:
    """The engine IS weight of each token (see the module docstring) under `cfg`."""
    zero = torch.zeros_like(old)
    no_mask = torch.zeros_like(valid)
    if generation_logprobs is None:
        raw = torch.ones_like(old)
        return ImportanceWeights(raw, raw, no_mask, no_mask)
    log_w = torch.where(valid, old - generation_logprobs.to(old.dtype).detach(), zero)
    if cfg.sequence_level_importance_ratios:
        raw = torch.exp(log_w.sum(dim=-1, keepdim=True)).expand_as(old)
    else:
        raw = torch.exp(log_w)
    if not cfg.importance_sampling_correction:
        return ImportanceWeights(raw, torch.ones_like(old), no_mask, no_mask)
    kind, high, low = truncation_of(cfg)
    if kind is None:
        return ImportanceWeights(raw, raw, no_mask, no_mask)
    if kind == "tis":
        weight = raw.clamp(min=low or 0.0, max=high)
        return ImportanceWeights(raw, weight, no_mask, valid & (weight != raw))
    if kind == "icepop":
        keep = (raw >= low) & (raw <= high)
    else:  # seq-mask-tis: the band on each sample's geometric-mean token weight
        geo = torch.exp(_seq_mean(log_w, valid))
        keep = ((geo >= low) & (geo <= high)).expand_as(old)
    return ImportanceWeights(raw, torch.where(keep, raw, zero), valid & ~keep, no_mask)
