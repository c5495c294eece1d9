"""Group-relative advantages (GRPO): each completion's reward against a baseline from its prompt's group.

The defaults are NeMo-RL's (`use_leave_one_out_baseline: true`, `normalize_rewards: true`): a sample's
baseline is the mean of the OTHER valid samples of its group, and its advantage is divided by the std of
those same other rewards, unless that std is 0 (then it is left as it is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

Baseline = Literal["mean", "leave_one_out"]
StdScope = Literal["baseline", "group"]


def _others(r: torch.Tensor) -> torch.Tensor:
    """[m, m-1]: row i holds the rewards of every sample but i, in order."""
    m = r.numel()
    keep = ~torch.eye(m, dtype=torch.bool)
    return r.expand(m, m)[keep].view(m, m - 1)


def _row_std(rows: torch.Tensor) -> torch.Tensor:
    """Sample std (ddof=1) of each row; exactly 0 for a row of equal values or of fewer than two values."""
    if rows.shape[-1] < 2:
        return torch.zeros(rows.shape[0], dtype=rows.dtype)
    equal = (rows == rows[:, :1]).all(dim=-1)
    return torch.where(equal, torch.zeros_like(equal, dtype=rows.dtype), rows.std(dim=-1, correction=1))


def _group_advantages(r: torch.Tensor, baseline: str, normalize_std: bool, std_scope: str, eps: float):
    """Advantages of the valid rewards `r` of one group (float64, at least two of them, not all equal)."""
    m = r.numel()
    if baseline == "leave_one_out":
        others = _others(r)
        base = others.mean(dim=-1)
        std = _row_std(others) if std_scope == "baseline" else _row_std(r[None]).expand(m)
    else:
        base = r.mean().expand(m)
        std = _row_std(r[None]).expand(m)
    adv = r - base
    if normalize_std:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return adv


def compute_group_advantages(
    rewards_per_group: Sequence[Sequence[float]],
    baseline: Baseline = "leave_one_out",
    normalize_std: bool = True,
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float32,
    *,
    std_scope: StdScope = "baseline",
    valid_per_group: Sequence[Sequence[bool]] | None = None,
) -> list[torch.Tensor]:
    """One 1-D tensor of advantages per group, in the group's order (groups may differ in size).

    Only valid samples (`valid_per_group`, default all; the GRPO batch marks failed rollouts invalid)
    enter a baseline or a std; an invalid sample's advantage is 0. With m valid samples in a group:

    - `baseline="leave_one_out"` (default): A_i = r_i - mean(r_j, j != i).
      `baseline="mean"`: A_i = r_i - mean(r).
    - `normalize_std`: where s_i > 0, A_i = A_i / (s_i + eps); where s_i = 0, A_i stays unscaled.
      `std_scope="baseline"` (default, NeMo-RL): s_i is the sample std (ddof=1) of the rewards the
      baseline averages: the other m-1 (0 when fewer than two others) with leave_one_out, all m with
      mean. `std_scope="group"`: s_i is the sample std of all m valid rewards, for every sample (so a
      sample whose siblings all agree is scaled like the rest of its group).
    - m < 2 (a group of one, or one valid sample) or all valid rewards equal: every advantage is exactly 0.
    - An empty group gives an empty tensor.

    Arithmetic runs in float64; the result is cast to `dtype`. `torch.cat` the list for a flat tensor in
    completion order.
    """
    _check_settings(baseline, std_scope, eps, len(rewards_per_group), valid_per_group)
    out: list[torch.Tensor] = []
    problems: list[str] = []
    for i, group in enumerate(rewards_per_group):
        r = torch.as_tensor(list(group), dtype=torch.float64)
        if r.ndim != 1:
            problems.append(f"group {i}: rewards must be a flat sequence of numbers")
            continue
        valid = (
            torch.ones(r.numel(), dtype=torch.bool)
            if valid_per_group is None
            else torch.as_tensor(list(valid_per_group[i]), dtype=torch.bool)
        )
        if valid.shape != r.shape:
            problems.append(f"group {i}: {r.numel()} rewards but {valid.numel()} valid flags")
            continue
        if not bool(torch.isfinite(r[valid]).all()):
            problems.append(f"group {i}: rewards must be finite, got {r.tolist()}")
            continue
        adv = torch.zeros(r.numel(), dtype=torch.float64)
        rv = r[valid]
        if rv.numel() >= 2 and not bool((rv == rv[0]).all()):
            adv[valid] = _group_advantages(rv, baseline, normalize_std, std_scope, eps)
        out.append(adv.to(dtype))
    if problems:
        raise ValueError("; ".join(problems))
    return out


def _check_settings(
    baseline: str, std_scope: str, eps: float, num_groups: int, valid_per_group: Sequence[Sequence[bool]] | None
) -> None:
    """`compute_group_advantages`' settings are known, and there is one valid-mask group per reward group."""
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    if std_scope not in ("baseline", "group"):
        raise ValueError(f"std_scope must be 'baseline' or 'group', got {std_scope!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if valid_per_group is not None and len(valid_per_group) != num_groups:
        raise ValueError(f"{num_groups} reward groups but {len(valid_per_group)} valid-mask groups")


def flatten_group_advantages(advantages: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-group advantages: (flat advantages [N], group index of each entry [N] as int64)."""
    if len(advantages) == 0:
        return torch.zeros(0), torch.zeros(0, dtype=torch.int64)
    group_ids = torch.cat([torch.full((a.numel(),), g, dtype=torch.int64) for g, a in enumerate(advantages)])
    return torch.cat(list(advantages)), group_ids


def compute_gdpo_advantages(
    components_per_group: Sequence[Sequence[Mapping[str, float]]],
    reward_weights: Mapping[str, float],
    baseline: Baseline = "leave_one_out",
    normalize_std: bool = True,
    eps: float = 1e-6,
    dtype: torch.dtype = torch.float32,
    *,
    std_scope: StdScope = "baseline",
    valid_per_group: Sequence[Sequence[bool]] | None = None,
) -> list[torch.Tensor]:
    """GDPO's advantages (NeMo-RL's `GDPOAdvantageEstimator`, arXiv 2601.05242): one tensor per group.

    For each component n of `reward_weights` (every valid sample must carry all of them): A_n is that
    component's group advantage exactly as `compute_group_advantages` computes the scalar's (same baseline,
    std and eps). Then A = sum_n w_n * A_n, and A is whitened over the valid samples of the whole batch:
    A = (A - mean(A)) / std(A) (sample std, ddof=1; where that std is 0 or there are fewer than two valid
    samples, A - mean(A) only). Invalid samples keep advantage 0. A missing component raises `KeyError`
    naming it; the caller names the environment.
    """
    valid = valid_per_group or [[True] * len(g) for g in components_per_group]
    total = [torch.zeros(len(g), dtype=torch.float64) for g in components_per_group]
    for name, weight in sorted(reward_weights.items()):
        rewards = [
            [c[name] if ok else 0.0 for c, ok in zip(group, flags, strict=True)]
            for group, flags in zip(components_per_group, valid, strict=True)
        ]
        parts = compute_group_advantages(
            rewards, baseline, normalize_std, eps, torch.float64, std_scope=std_scope, valid_per_group=valid
        )
        total = [t + float(weight) * a for t, a in zip(total, parts, strict=True)]
    return [a.to(dtype) for a in _whiten(total, valid)]


def _whiten(advantages: list[torch.Tensor], valid: Sequence[Sequence[bool]]) -> list[torch.Tensor]:
    """Zero mean and unit sample std over the valid entries of every group together; invalid entries stay 0."""
    masks = [torch.as_tensor(list(v), dtype=torch.bool) for v in valid]
    if not advantages:
        return []
    flat = torch.cat([a[m] for a, m in zip(advantages, masks, strict=True)])
    if flat.numel() == 0:
        return advantages
    mean = flat.mean()
    std = flat.std(correction=1) if flat.numel() > 1 else torch.zeros((), dtype=flat.dtype)
    scale = std if bool(std > 0) else torch.ones((), dtype=flat.dtype)
    return [torch.where(m, (a - mean) / scale, torch.zeros_like(a)) for a, m in zip(advantages, masks, strict=True)]
