"""The learning rate of each GRPO step (`optimizer.scheduler`): a linear warm-up, then constant, linear or cosine
decay to `min_lr` at the horizon T.

    s <= W:      lr x s / W                                  (W warm-up steps; step 1 already trains, at lr / W)
    W < s <= T:  min_lr + (lr - min_lr) x f(p),  p = (s - P) / (T - P), P = max(W, 1) the step at lr
                 f = 1 (constant), 1 - p (linear), (1 + cos(pi p)) / 2 (cosine)
    s > T:       min_lr (constant: lr)

It is a pure function of the step: a resumed run computes the same lr for the same step, so the schedule needs
no state of its own in a checkpoint beyond the step and the horizon (`GRPO` saves `schedule_steps`). This is
transformers' `get_{linear,cosine}_schedule_with_warmup` (and `cosine_with_min_lr`) counted from step 1 instead
of 0, so that no step is spent at lr 0; NeMo-RL's `policy.scheduler` steps once per GRPO step as well.
"""

from __future__ import annotations

import math

from nemo_rl_ext.training.config import OptimizerSettings


def warmup_steps(optimizer: OptimizerSettings, total: int) -> int:
    """W for a horizon of `total` steps: `warmup_steps`, or ceil(`warmup_ratio` x total), else 0."""
    sched = optimizer.scheduler
    if sched.warmup_steps is not None:
        return sched.warmup_steps
    if sched.warmup_ratio is not None:
        return math.ceil(sched.warmup_ratio * total)
    return 0


def scheduled_lr(optimizer: OptimizerSettings, step: int, total: int) -> float:
    """The learning rate of GRPO step `step` (1-based) of a run whose schedule spans `total` steps."""
    if step < 1 or total < 1:
        raise ValueError(f"step ({step}) and total ({total}) count from 1")
    sched, peak = optimizer.scheduler, optimizer.lr
    warm = warmup_steps(optimizer, total)
    if step <= warm:
        return peak * step / warm
    peak_step = max(warm, 1)
    if sched.type == "constant" or step <= peak_step:
        return peak
    if step >= total:
        return sched.min_lr
    progress = (step - peak_step) / (total - peak_step)
    shape = 1.0 - progress if sched.type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return sched.min_lr + (peak - sched.min_lr) * shape


__all__ = ["scheduled_lr", "warmup_steps"]
