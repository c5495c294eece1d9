"""The clipped policy-gradient loss (GRPO/PPO style) over token tensors, and loss masks from completions.

Token convention: every `[B, T]` tensor is indexed by the token it scores; `logprobs[b, t]` is
log pi(token_t | tokens_<t) of sequence b. A trainer that takes logprobs from logits must shift them
(the logits at position t-1 score token t); position 0 is never generated, so its mask is 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nemo_rl_ext.data.records import Completion, StopReason
from nemo_rl_ext.objectives.aggregation import aggregate
from nemo_rl_ext.objectives.importance import ImportanceWeights, importance_weights
from nemo_rl_ext.objectives.loss_settings import ClippedPGLossConfig


def kl_penalty(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    estimator: str = "k3",
    input_clamp_value: float | None = 20.0,
    output_clamp_value: float | None = 10.0,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from x = reference_logprobs - logprobs (Schulman's k1/k2/k3).

    x is clamped to [-input_clamp_value, input_clamp_value] first; the estimate is then multiplied by
    `weights` (if given) and clamped to [-output_clamp_value, output_clamp_value] last (None skips a clamp), as
    NeMo-RL's `calculate_kl`. Where the input clamp bites, the weight is detached: a clamped token passes no
    gradient at all, through the estimate or through its weight; the output clamp, applied after the weight,
    does the same.
    """
    x = reference_logprobs - logprobs
    if input_clamp_value is not None:
        clamped = x.clamp(-input_clamp_value, input_clamp_value)
        if weights is not None:
            weights = torch.where(clamped == x, weights, weights.detach())
        x = clamped
    if estimator == "k1":
        kl = -x
    elif estimator == "k2":
        kl = x.square() / 2
    elif estimator == "k3":
        kl = torch.exp(x) - x - 1.0
    else:
        raise ValueError(f"KL estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")
    if weights is not None:
        kl = weights * kl
    if output_clamp_value is not None:
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl


def kl_weight(
    logprobs: torch.Tensor, generation_logprobs: torch.Tensor | None, config: ClippedPGLossConfig
) -> torch.Tensor:
    """The weight of each token's KL estimate: its value is pi / pi_gen with `on_policy_kl_approximation`, else 1;
    it carries d/dlogp (the score function of the sampled token) unless `kl_gradient` is pathwise."""
    if config.on_policy_kl_approximation:
        if generation_logprobs is None:
            raise ValueError("on_policy_kl_approximation needs generation_logprobs")
        sampled_by = generation_logprobs.detach()
    else:
        sampled_by = logprobs.detach()
    weight = torch.nan_to_num(torch.exp(logprobs - sampled_by), nan=0.0, posinf=0.0, neginf=0.0)
    return weight.detach() if config.kl_gradient == "pathwise" else weight


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> float:
    n = int(valid.sum())
    return float(x[valid].sum() / n) if n else 0.0


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> float:
    return float(x[valid].max()) if bool(valid.any()) else 0.0


def clipped_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: ClippedPGLossConfig | None = None,
    *,
    generation_logprobs: torch.Tensor | None = None,
    reference_logprobs: torch.Tensor | None = None,
    global_normalization_count: float | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with optional dual clip, KL penalty and truncated IS correction.

    Inputs (all `[B, T]` unless said): `logprobs` of the current policy (carries the gradient); `old_logprobs`
    of the trainer's policy before this update; `advantages` per sequence `[B]` (or per token `[B, T]`); `mask`
    0/1 (or bool), 1 on tokens that are trained; `generation_logprobs` from the engine (needed by
    `importance_sampling_correction`, `on_policy_kl_approximation`); `reference_logprobs` (when kl_coef != 0).

    Per valid token, with r = exp(logprobs - old) (GSPO, `sequence_level_importance_ratios`: the sample's
    exp(mean of logprobs - old) on each token), w the engine IS weight (`importance.importance_weights`: exp(old -
    gen) per token or per sample, truncated or masked by `truncated_importance_sampling_type`; 1 without the
    correction) and u = exp(logprobs - g), g = gen with `on_policy_kl_approximation` else sg(logprobs) (so u = 1):
      pg = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), then for A < 0: pg = min(pg, -A * clip_c)
      (policy_loss cispo: pg = -A * sg(clip(r, 1 - clip_low, 1 + clip_high)) * logprobs)
      kl = clamp(u * k(clamp(log ref - log pi, +-kl_input_clamp_value)), +-kl_output_clamp_value)  (k: estimator)
      loss_token = w * pg + kl_coef * kl - entropy_coef * H   (w weights only the pg term, as in NeMo-RL;
                   no KL term with use_kl_in_reward: it is in the advantages, `objectives.kl_reward`)
    with H = `entropy` ([B, T] entropies under the generation temperature; with its gradient if entropy_coef).
    u carries a gradient (kl_gradient "score_function", NeMo-RL's since 2026: d kl/d logp gains u * k, the
    sampled token's score function) unless kl_gradient is "pathwise"; where a clamp bites, no KL gradient.
    Reduction: `aggregation.aggregate` by `loss.aggregation`, divided by `global_normalization_count` (the whole
    minibatch's `aggregation.normalization_count`, for gradient accumulation and trainer ranks) if given, else by
    this batch's own count. Sequences without masked tokens contribute nothing.

    Metrics (over this batch's masked tokens; 0.0 without any): `loss`, `loss/pg`, `loss/kl`, `loss/entropy` (the
    three terms), `kl/mean` (kl before kl_coef), `clip_fraction` (+ `/low`, `/high`), `dual_clip_fraction`,
    `policy_ratio/mean|max`, `importance_ratio/mean|max` (exp(old - gen), untruncated), `is_weight/mean`,
    `is_weight/truncated_fraction` (tis), `is/masked_tokens`, `is/masked_sequences` (counts: tokens icepop or
    seq-mask-tis zeroed, samples all of whose tokens were), `num_tokens`, `num_sequences`, `entropy` (mean H).
    """
    cfg = config or ClippedPGLossConfig()
    _check_loss_inputs(logprobs, old_logprobs, advantages, mask, cfg, generation_logprobs, reference_logprobs,
                       global_normalization_count, entropy)
    valid = mask.to(torch.bool)
    pg = _clipped_pg_terms(logprobs, old_logprobs, advantages, valid, cfg)
    iw = importance_weights(pg.old, generation_logprobs, valid, cfg)
    kl = _kl_terms(logprobs, generation_logprobs, reference_logprobs, valid, cfg)
    count = global_normalization_count
    pg_loss = aggregate(iw.weight * pg.pg, valid, cfg, count)  # the IS weight: the pg term only (as NeMo-RL's)
    in_loss = kl is not None and cfg.kl_coef != 0.0 and not cfg.use_kl_in_reward  # else in the advantages
    kl_loss = aggregate(cfg.kl_coef * kl, valid, cfg, count) if in_loss else None
    # the entropy bonus: `entropy` carries its gradient when entropy_coef != 0 (the trainer computes it so)
    entropy_loss = -cfg.entropy_coef * aggregate(entropy, valid, cfg, count) if cfg.entropy_coef != 0.0 else None
    loss = sum(x for x in (kl_loss, entropy_loss) if x is not None) + pg_loss
    with torch.no_grad():
        metrics = _loss_metrics(loss, pg_loss, kl_loss, pg, iw, kl, valid)
        metrics["loss/entropy"] = float(entropy_loss) if entropy_loss is not None else 0.0
        metrics.update({"entropy": _masked_mean(entropy.detach(), valid)} if entropy is not None else {})
    return loss, metrics


def _check_loss_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: ClippedPGLossConfig,
    generation_logprobs: torch.Tensor | None,
    reference_logprobs: torch.Tensor | None,
    global_normalization_count: float | None,
    entropy: torch.Tensor | None = None,
) -> None:
    """`clipped_pg_loss`' inputs have matching shapes and carry what its settings need."""
    shape = logprobs.shape
    if logprobs.ndim != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
    named = {
        "old_logprobs": old_logprobs,
        "mask": mask,
        "generation_logprobs": generation_logprobs,
        "reference_logprobs": reference_logprobs,
    }
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if advantages.shape not in (shape, shape[:1], (shape[0], 1)):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected [B], [B, 1] or [B, T]")
    if cfg.importance_sampling_correction and generation_logprobs is None:
        raise ValueError("importance_sampling_correction needs generation_logprobs (or disable it)")
    if cfg.on_policy_kl_approximation and reference_logprobs is not None and generation_logprobs is None:
        raise ValueError("on_policy_kl_approximation needs generation_logprobs (or disable it)")
    if cfg.entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy (with its gradient)")
    if entropy is not None and entropy.shape != shape:
        raise ValueError(f"entropy has shape {tuple(entropy.shape)}, expected {tuple(shape)}")
    if cfg.kl_coef != 0.0 and reference_logprobs is None:
        raise ValueError("kl_coef != 0 needs reference_logprobs")
    if global_normalization_count is not None and global_normalization_count < 0:
        raise ValueError(f"global_normalization_count must be >= 0, got {global_normalization_count}")


@dataclass(frozen=True, eq=False)
class _PGTerms:
    """The per-token clipped policy-gradient term of `clipped_pg_loss` and what its metrics read."""

    adv: torch.Tensor
    """[B, T] advantages, detached, in the logprobs' dtype."""
    old: torch.Tensor
    """[B, T] old logprobs, detached, in the logprobs' dtype."""
    ratio: torch.Tensor
    """[B, T] pi / pi_old (1 outside the mask)."""
    loss_unclipped: torch.Tensor
    """[B, T] -A * ratio."""
    loss_clipped: torch.Tensor
    """[B, T] -A * clip(ratio, 1 - clip_low, 1 + clip_high)."""
    pg: torch.Tensor
    """[B, T] the per-token policy-gradient loss: ppo_clip's larger of the two, dual-clipped where `dual`; cispo's
    -A sg(clip(ratio)) logprob."""
    dual: torch.Tensor
    """[B, T] bool: where the dual clip bit (all False without `clip_c`)."""
    clipped: torch.Tensor
    """[B, T] bool: trained tokens where the clip bit (ppo_clip: the clipped term won, not dual; cispo: the ratio
    left the band)."""


def _clipped_pg_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    cfg: ClippedPGLossConfig,
) -> _PGTerms:
    """pg = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), then for A < 0: pg = min(pg, -A * clip_c);
    cispo: pg = -A * sg(clip(r, 1 - clip_low, 1 + clip_high)) * logprobs. r = exp(logprobs - old) per token, or
    with `sequence_level_importance_ratios` (GSPO) exp(mean over the sample's trained tokens of logprobs - old)
    on each of its tokens (the gradient flows through the mean)."""
    shape, dtype = logprobs.shape, logprobs.dtype
    zero = torch.zeros_like(logprobs)
    adv = advantages.to(dtype).detach()
    adv = (adv.reshape(-1, 1) if adv.ndim == 1 else adv).expand(shape)
    old = old_logprobs.to(dtype).detach()
    log_ratio = torch.where(valid, logprobs - old, zero)
    if cfg.sequence_level_importance_ratios:
        n = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(dtype)
        log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / n).expand(shape)
    ratio = torch.exp(log_ratio)
    clamped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * clamped
    dual = torch.zeros_like(valid)
    if cfg.policy_loss == "cispo":
        pg = -adv * clamped.detach() * torch.where(valid, logprobs, zero)
        return _PGTerms(adv, old, ratio, loss_unclipped, loss_clipped, pg, dual, valid & (clamped != ratio))
    pg = torch.maximum(loss_unclipped, loss_clipped)
    if cfg.clip_c is not None:
        loss_dual = -adv * cfg.clip_c
        dual = (adv < 0) & (loss_dual < pg)
        pg = torch.where(dual, loss_dual, pg)
    clipped = (loss_clipped > loss_unclipped) & valid & ~dual
    return _PGTerms(adv, old, ratio, loss_unclipped, loss_clipped, pg, dual, clipped)


def _kl_terms(
    logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor | None,
    reference_logprobs: torch.Tensor | None,
    valid: torch.Tensor,
    cfg: ClippedPGLossConfig,
) -> torch.Tensor | None:
    """The per-token weighted KL estimate (see `kl_penalty`, `kl_weight`); None without reference logprobs."""
    if reference_logprobs is None:
        return None
    dtype = logprobs.dtype
    zero = torch.zeros_like(logprobs)
    current = torch.where(valid, logprobs, zero)
    gen = torch.where(valid, generation_logprobs.to(dtype), zero) if generation_logprobs is not None else None
    return kl_penalty(
        current,
        torch.where(valid, reference_logprobs.to(dtype).detach(), zero),
        cfg.kl_estimator,
        cfg.kl_input_clamp_value,
        cfg.kl_output_clamp_value,
        weights=kl_weight(current, gen, cfg),
    )


def _loss_metrics(
    loss: torch.Tensor,
    pg_loss: torch.Tensor,
    kl_loss: torch.Tensor | None,
    pg: _PGTerms,
    iw: ImportanceWeights,
    kl: torch.Tensor | None,
    valid: torch.Tensor,
) -> dict[str, float]:
    """`clipped_pg_loss`' metrics (see its docstring), over the valid tokens."""
    dtype = pg.ratio.dtype
    clipped, raw_is, is_weight = pg.clipped, iw.raw, iw.weight
    seq_tokens = valid.sum(dim=-1)
    seq_masked = iw.masked.sum(dim=-1)
    metrics = {
        "loss": float(loss),
        "loss/pg": float(pg_loss),
        "loss/kl": float(kl_loss) if kl_loss is not None else 0.0,
        "clip_fraction": _masked_mean(clipped.to(dtype), valid),
        "clip_fraction/low": _masked_mean((clipped & (pg.adv < 0)).to(dtype), valid),
        "clip_fraction/high": _masked_mean((clipped & (pg.adv > 0)).to(dtype), valid),
        "dual_clip_fraction": _masked_mean(pg.dual.to(dtype), valid),
        "policy_ratio/mean": _masked_mean(pg.ratio, valid),
        "policy_ratio/max": _masked_max(pg.ratio, valid),
        "importance_ratio/mean": _masked_mean(raw_is, valid),
        "importance_ratio/max": _masked_max(raw_is, valid),
        "is_weight/mean": _masked_mean(is_weight, valid),
        "is_weight/truncated_fraction": _masked_mean(iw.truncated.to(dtype), valid),
        "is/masked_tokens": float(iw.masked.sum()),
        "is/masked_sequences": float(((seq_tokens > 0) & (seq_masked == seq_tokens)).sum()),
        "num_tokens": float(valid.sum()),
        "num_sequences": float((valid.sum(dim=-1) > 0).sum()),
    }
    if kl is not None:
        metrics["kl/mean"] = _masked_mean(kl, valid)
    return metrics


def build_loss_mask(
    completion: Completion, overlong_filtering: bool = False, only_generated: bool = True
) -> torch.Tensor:
    """0/1 float32 mask over `completion.token_ids` (all messages' ids, concatenated): 1 on assistant tokens.

    With `only_generated` (default) an assistant message counts only when it carries
    `generation_logprobs`, i.e. it came from the engine (few-shot assistant turns in the prompt do not).
    Everything is 0 when the completion errored (stop_reason "error") or, with `overlong_filtering`, when
    it was truncated.
    """
    n = sum(len(m.token_ids) for m in completion.message_log)
    if completion.stop_reason == StopReason.ERROR or (overlong_filtering and completion.truncated):
        return torch.zeros(n, dtype=torch.float32)
    parts = []
    for m in completion.message_log:
        trained = m.role == "assistant" and (m.generation_logprobs is not None or not only_generated)
        parts.append(torch.full((len(m.token_ids),), 1.0 if trained else 0.0, dtype=torch.float32))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)


@dataclass(frozen=True, eq=False)
class CompletionTensors:
    """A completion as the trainer consumes it: one entry per token of its full token sequence."""

    token_ids: torch.Tensor
    """[L] int64: all token ids of the completion, in context order."""
    loss_mask: torch.Tensor
    """[L] float32 0/1: see `build_loss_mask`."""
    generation_logprobs: torch.Tensor
    """[L] float32: the engine's logprob of each generated token; 0 where the token was not generated."""
    teacher_logprobs: torch.Tensor | None = None
    """[L] float32: a distillation teacher's logprob of each token it scored, 0 elsewhere; None: not scored."""
    teacher_mask: torch.Tensor | None = None
    """[L] float32 0/1: 1 on the tokens the teacher scored; None when it scored none."""
    teacher_topk_ids: torch.Tensor | None = None
    """[L, k] int64: the teacher's top-k ids per token (0 where it scored none); None without top-k."""
    teacher_topk_logprobs: torch.Tensor | None = None
    """[L, k] float32: the teacher's logprobs of `teacher_topk_ids`; None without top-k."""
    agent_name: str | None = None
    """The completion's agent (per-agent distillation metrics); None when unknown."""


def completion_to_tensors(
    completion: Completion, overlong_filtering: bool = False, only_generated: bool = True
) -> CompletionTensors:
    """Token ids, loss mask and per-token generation logprobs of a completion, aligned."""
    ids = torch.tensor(completion.token_ids, dtype=torch.int64)
    gen = [
        torch.tensor(m.generation_logprobs, dtype=torch.float32)
        if m.generation_logprobs is not None
        else torch.zeros(len(m.token_ids), dtype=torch.float32)
        for m in completion.message_log
    ]
    return CompletionTensors(
        token_ids=ids,
        loss_mask=build_loss_mask(completion, overlong_filtering, only_generated),
        generation_logprobs=torch.cat(gen) if gen else torch.zeros(0, dtype=torch.float32),
        **teacher_tensors(completion),
        agent_name=completion.agent_name,
    )


def teacher_tensors(completion: Completion) -> dict[str, torch.Tensor | None]:
    """`CompletionTensors`' teacher fields of a completion, aligned with its token ids: the scores of the messages
    that carry `teacher_logprobs` (their top-k when every one of them has it), 0 / mask 0 on the others; all None
    when no message was scored."""
    scored = [m for m in completion.message_log if m.teacher_logprobs is not None]
    none = dict.fromkeys(("teacher_logprobs", "teacher_mask", "teacher_topk_ids", "teacher_topk_logprobs"))
    if not scored:
        return none
    with_topk = all(m.teacher_topk_ids is not None and m.teacher_topk_logprobs is not None for m in scored)
    widths = {len(row) for m in scored if with_topk for row in (m.teacher_topk_ids or ())}
    if len(widths) > 1:
        raise ValueError(f"teacher top-k rows of one completion have different widths {sorted(widths)}")
    k = widths.pop() if widths else 0
    lp, mask, ids, tlp = [], [], [], []
    for m in completion.message_log:
        n = len(m.token_ids)
        has = m.teacher_logprobs is not None
        lp.append(torch.tensor(m.teacher_logprobs, dtype=torch.float32) if has else torch.zeros(n))
        mask.append(torch.full((n,), 1.0 if has else 0.0))
        if with_topk:
            ids.append(torch.tensor(m.teacher_topk_ids, dtype=torch.int64).reshape(n, k) if has
                       else torch.zeros(n, k, dtype=torch.int64))
            tlp.append(torch.tensor(m.teacher_topk_logprobs, dtype=torch.float32).reshape(n, k) if has
                       else torch.zeros(n, k))
    return {
        "teacher_logprobs": torch.cat(lp),
        "teacher_mask": torch.cat(mask),
        "teacher_topk_ids": torch.cat(ids) if with_topk else None,
        "teacher_topk_logprobs": torch.cat(tlp) if with_topk else None,
    }


def pad_completion_tensors(
    items: Sequence[CompletionTensors], pad_token_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad to `[B, T_max]`: (token ids, loss mask, generation logprobs); padding has mask 0."""
    if len(items) == 0:
        raise ValueError("nothing to pad")
    t_max = max(int(x.token_ids.numel()) for x in items)
    ids = torch.full((len(items), t_max), pad_token_id, dtype=torch.int64)
    mask = torch.zeros(len(items), t_max, dtype=torch.float32)
    gen = torch.zeros(len(items), t_max, dtype=torch.float32)
    for b, x in enumerate(items):
        n = x.token_ids.numel()
        ids[b, :n], mask[b, :n], gen[b, :n] = x.token_ids, x.loss_mask, x.generation_logprobs
    return ids, mask, gen
