"""Loss aggregation: how a `[B, T]` per-token loss becomes the scalar one micro-batch adds to its minibatch.

Four modes (verl's `loss_agg_mode` names; NeMo-RL's token_level_loss true/false are the first two):
  token-mean               sum over trained tokens / the minibatch's trained tokens
  seq-mean-token-mean      sum over sequences of (its token mean) / the minibatch's sequences with a trained token
  seq-mean-token-sum       sum over sequences of (its token sum) / the minibatch's sequences with a trained token
  seq-mean-token-sum-norm  sum over trained tokens / (the minibatch's sequences * max_tokens_norm)  (Dr. GRPO)
Each is a sum over the micro-batch divided by one count of the whole minibatch (`normalization_count`), so
summing the micro-batches' losses (gradient accumulation, and trainer ranks whose gradients are summed) gives
the minibatch's loss exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nemo_rl_ext.objectives.loss_settings import aggregation_of


def _tokens_norm(cfg: Any) -> int:
    if cfg.max_tokens_norm is None:
        raise ValueError("aggregation seq-mean-token-sum-norm needs loss.max_tokens_norm (the GRPO config sets it to "
                         "policy.generation.max_new_tokens)")
    return int(cfg.max_tokens_norm)


def normalization_count(masks: Sequence[torch.Tensor], cfg: Any) -> float:
    """The divisor of the minibatch whose samples have these loss masks (one per sample), for `cfg`'s aggregation:
    trained tokens (token-mean); sequences with a trained token (seq-mean-token-*); every sequence times
    max_tokens_norm (seq-mean-token-sum-norm, a constant per minibatch size as Dr. GRPO and TRL's dr_grpo)."""
    mode = aggregation_of(cfg)
    if mode == "token-mean":
        return float(sum(float(m.sum()) for m in masks))
    if mode == "seq-mean-token-sum-norm":
        return float(len(masks) * _tokens_norm(cfg))
    return float(sum(1 for m in masks if float(m.sum()) > 0))


def trained_tokens(masks: Sequence[torch.Tensor]) -> float:
    """How many tokens these loss masks train (a minibatch with none takes no optimizer step)."""
    return float(sum(float(m.sum()) for m in masks))


def aggregate(per_token: torch.Tensor, valid: torch.Tensor, cfg: Any, count: float | None) -> torch.Tensor:
    """Reduce a [B, T] per-token quantity over the `valid` tokens by `cfg`'s aggregation, divided by `count`
    (the whole minibatch's `normalization_count`) or, when None, by this batch's own count."""
    mode = aggregation_of(cfg)
    if count is None:
        count = normalization_count(list(valid.to(per_token.dtype)), cfg)
    masked = torch.where(valid, per_token, torch.zeros_like(per_token))
    if mode == "seq-mean-token-mean":
        seq_tokens = valid.sum(dim=-1).clamp(min=1).to(per_token.dtype)
        total = (masked.sum(dim=-1) / seq_tokens).sum()
    else:  # token-mean, seq-mean-token-sum, seq-mean-token-sum-norm: the masked sum, each over its own count
        total = masked.sum()
    return total / max(float(count), 1.0)


def minibatch_count(masks: Sequence[torch.Tensor], cfg: Any) -> float:
    """What a trainer passes as `global_normalization_count` for the minibatch of these loss masks: its
    `normalization_count`, or 0 when it trains no token (0 tells the trainer to take no optimizer step)."""
    return normalization_count(masks, cfg) if trained_tokens(masks) > 0 else 0.0
