"""From scored prompt groups to what the trainer consumes: completions as tensors, with group advantages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.records import Completion, PromptGroupRecord, StopReason, check_reward_components
from nemo_rl_ext.grpo.config import GRPOSettings
from nemo_rl_ext.objectives.advantages import (
    Baseline,
    StdScope,
    compute_gdpo_advantages,
    compute_group_advantages,
    flatten_group_advantages,
)
from nemo_rl_ext.objectives.kl_reward import reinforce_pp_advantages, whiten_by_tokens
from nemo_rl_ext.objectives.loss import CompletionTensors, completion_to_tensors


@dataclass(frozen=True, eq=False)
class TrainingBatch:
    """Every completion of a step's groups, in group order, with its advantage."""

    items: tuple[CompletionTensors, ...]
    """Token ids, loss mask and engine logprobs of each completion."""
    advantages: torch.Tensor
    """[N] float32: the advantage of each completion (shared by all its trained tokens)."""
    group_ids: torch.Tensor
    """[N] int64: index of each completion's group in the step."""
    valid: torch.Tensor
    """[N] bool: False for failed rollouts (stop_reason error): no baseline, no std, no loss, no count."""


def is_valid(completion: Completion) -> bool:
    """A completion that counts in its group's baseline and std: every one but a failed rollout."""
    return completion.stop_reason != StopReason.ERROR


def has_reward_variance(record: PromptGroupRecord) -> bool:
    """True when the rewards of the group's valid completions are not all equal (it can teach something)."""
    rewards = [c.reward for c in record.completions if is_valid(c)]
    return len(rewards) > 1 and any(r != rewards[0] for r in rewards)


def has_signal(record: PromptGroupRecord, grpo: GRPOSettings | None = None) -> bool:
    """What dynamic sampling keeps: a group whose advantages (before GDPO's whitening over the step) are not all
    zero. `grpo.adv_estimator` grpo (or `grpo` None): its valid rewards differ (`has_reward_variance`). gdpo:
    sum_n w_n A_n of the group (each weighted component's group advantage under `grpo`'s baseline and std, as
    `compute_gdpo_advantages` computes it) is not all zero, so tied scalar rewards over varying components are
    kept and a varying scalar over constant components is not. A group whose valid completions do not all carry
    every component is kept: building the batch then names the environment and the field."""
    if grpo is None or grpo.adv_estimator != "gdpo":
        return has_reward_variance(record)
    done = [c for c in record.completions if is_valid(c)]
    if len(done) < 2:
        return False
    weights = grpo.reward_weights or dict.fromkeys({n for c in done for n in c.reward_components}, 1.0)
    if not all(name in c.reward_components for name in weights for c in done):
        return True
    settings = dict(baseline=grpo.baseline, normalize_std=grpo.normalize_std, std_scope=grpo.std_scope)
    total = torch.zeros(len(done), dtype=torch.float64)
    size = torch.zeros(len(done), dtype=torch.float64)
    for name, weight in weights.items():
        values = [[float(c.reward_components[name]) for c in done]]
        part = float(weight) * compute_group_advantages(values, dtype=torch.float64, **settings)[0]
        total, size = total + part, size + part.abs()
    # terms that cancel in exact arithmetic leave float64 rounding: a few ulps of each term, summed
    return bool((total.abs() > _CANCELLED * size).any())


_CANCELLED = 64 * torch.finfo(torch.float64).eps
"""A weighted sum of GDPO advantages this small against the sum of its terms' sizes is a cancellation to
rounding (each term is a handful of float64 operations, each within an ulp; 64 ulps covers them)."""


def build_training_batch(
    records: Sequence[PromptGroupRecord],
    *,
    baseline: Baseline = "leave_one_out",
    normalize_std: bool = True,
    std_scope: StdScope = "baseline",
    overlong_filtering: bool = False,
    adv_estimator: str = "grpo",
    reward_weights: Mapping[str, float] | None = None,
    minus_baseline: bool = True,
    kl_in_reward: bool = False,
) -> TrainingBatch:
    """Group-relative advantages of every completion (see `compute_group_advantages`), and its tensors.

    Failed rollouts are left out of their group's baseline and std (advantage 0) and get an all-zero loss
    mask, so they count in neither the token nor the sequence normalization of the loss. With
    `overlong_filtering`, truncated completions get an all-zero loss mask too, but keep their place in the
    baseline (as NeMo-RL's overlong filtering). `adv_estimator="gdpo"`: the advantages of the completions'
    `reward_components` (`compute_gdpo_advantages`, weights from `gdpo_weights`) instead of their `reward`.
    `"reinforce_plus_plus"`: r - the group mean (`minus_baseline`), whitened over the step's trained tokens
    (`objectives.kl_reward`); with `kl_in_reward` not yet whitened: the trainer subtracts the KL, then whitens.
    """
    valid = [[is_valid(c) for c in r.completions] for r in records]
    settings = dict(baseline=baseline, normalize_std=normalize_std, std_scope=std_scope, valid_per_group=valid)
    items = tuple(
        completion_to_tensors(c, overlong_filtering=overlong_filtering) for r in records for c in r.completions
    )
    rewards = [[c.reward for c in r.completions] for r in records]
    if adv_estimator == "gdpo":
        weights = gdpo_weights(records, reward_weights)
        components = [[c.reward_components for c in r.completions] for r in records]
        per_group = compute_gdpo_advantages(components, weights, **settings)
    elif adv_estimator == "reinforce_plus_plus":
        per_group = reinforce_pp_advantages(rewards, minus_baseline, valid_per_group=valid)
    else:
        per_group = compute_group_advantages(rewards, **settings)
    advantages, group_ids = flatten_group_advantages(per_group)
    if adv_estimator == "reinforce_plus_plus" and not kl_in_reward:
        advantages = whiten_by_tokens(advantages, torch.tensor([float(x.loss_mask.sum()) for x in items]))
    return TrainingBatch(
        items=items,
        advantages=advantages.to(torch.float32),
        group_ids=group_ids,
        valid=torch.tensor([v for group in valid for v in group], dtype=torch.bool),
    )


def gdpo_weights(
    records: Sequence[PromptGroupRecord], reward_weights: Mapping[str, float] | None
) -> dict[str, float]:
    """The weight of each reward component of the step's valid completions: `reward_weights`, or 1 each when
    None. `ConfigError` naming `grpo.adv_estimator` when fewer than two components were reported, or
    `grpo.reward_weights` when it names one no completion has or misses one; `RewardComponentError` naming the
    environment and the field when a valid completion lacks a component the others have."""
    done = [(r, c) for r in records for c in r.completions if is_valid(c)]
    names = sorted({n for _, c in done for n in c.reward_components})
    if len(names) < 2:
        raise ConfigError(
            f"grpo.adv_estimator: gdpo needs two or more named reward components, but the environments of this "
            f"step reported {names or 'none'} (an environment reports them in EnvironmentReturn.reward_components, "
            "NeMo Gym through rollouts.gym.reward_components); with one reward use grpo.adv_estimator: grpo"
        )
    if reward_weights is not None and set(reward_weights) != set(names):
        unknown = sorted(set(reward_weights) - set(names))
        missing = sorted(set(names) - set(reward_weights))
        raise ConfigError(
            f"grpo.reward_weights: names {unknown} that no environment reported and has no weight for "
            f"{missing}; the reported components are {names}"
        )
    for record, c in done:
        check_reward_components(record.agent_name or c.agent_name, c.reward_components, required=names)
    return dict(reward_weights) if reward_weights is not None else dict.fromkeys(names, 1.0)


def training_batch_metrics(batch: TrainingBatch, records: Sequence[PromptGroupRecord]) -> dict[str, float]:
    """Metrics of what is trained on: advantages, sequence lengths, groups with reward variance."""
    adv = batch.advantages
    lengths = torch.tensor([float(x.token_ids.numel()) for x in batch.items])
    trained = torch.tensor([float(x.loss_mask.sum()) for x in batch.items])
    return {
        "batch/num_groups": float(len(records)),
        "batch/num_samples": float(len(batch.items)),
        "batch/excluded_samples": float((~batch.valid).sum()),
        "batch/groups_with_variance": float(sum(has_reward_variance(r) for r in records)),
        "batch/reward/mean": float(torch.tensor([c.reward for r in records for c in r.completions]).mean()),
        "batch/advantage/mean": float(adv.mean()) if adv.numel() else 0.0,
        "batch/advantage/abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0,
        "batch/seq_len/mean": float(lengths.mean()),
        "batch/seq_len/max": float(lengths.max()),
        "batch/trained_tokens/mean": float(trained.mean()),
        **reward_component_metrics(records),
    }


def reward_component_metrics(records: Sequence[PromptGroupRecord]) -> dict[str, float]:
    """`reward/<name>`: the mean of each named reward component over the valid completions that report it."""
    values: dict[str, list[float]] = {}
    for c in (c for r in records for c in r.completions if is_valid(c)):
        for name, value in c.reward_components.items():
            values.setdefault(name, []).append(float(value))
    return {f"reward/{name}": sum(v) / len(v) for name, v in sorted(values.items())}
