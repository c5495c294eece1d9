"""The `trainer:` and `optimizer:` sections of a GRPO config: how many ranks train, how the model is sharded, and what saves memory.

    trainer:
      workers: 1                  # ranks; 1 keeps the in-process trainer, bit for bit
      sharding: fsdp2             # none | fsdp2 (fully_shard per decoder layer, then the root module)
      mixed_precision: null       # null | bf16: bf16 compute, fp32 master weights and fp32 gradient reduction
      activation_checkpointing: false
      cpu_offload: false          # FSDP2's CPU offload of parameters and optimizer state (GPU runs)
      lora: null                  # {r: 16, alpha: 32, dropout: 0.0, target_modules: [q_proj, v_proj]} (peft)
      worker: {num_cpus: 1, num_gpus: 0}

The names are fixed so that a config written today keeps working as the features behind them land. A value
whose feature is not built yet is refused by `trainer_rule_problems`, with the other config problems, naming
the key; it is never accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from nemo_rl_ext.config import INVALID, RuleProblem, StrictModel, raw_field


class LoraSettings(StrictModel):
    """Low-rank adapters (peft's LoRA) on the named modules; the base weights stay frozen."""

    r: int = Field(default=16, ge=1, description="Adapter rank.")
    alpha: float = Field(default=32.0, gt=0.0, description="Scaling numerator: the update is (alpha / r) B A.")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: tuple[str, ...] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj"),
        min_length=1,
        description="Module names (the last part of the dotted name, as peft matches them) that get adapters.",
    )


class TrainerWorkerSettings(StrictModel):
    """What each trainer rank asks Ray for when `trainer.workers > 1`."""

    num_cpus: float = Field(default=1.0, ge=0.0, description="CPUs reserved per rank.")
    num_gpus: float = Field(default=0.0, ge=0.0, description="GPUs reserved per rank (1 on a GPU cluster).")


class TrainerSettings(StrictModel):
    """Where and how the policy trains: one in-process trainer, or FSDP2 ranks on Ray."""

    workers: int = Field(default=1, ge=1, description="Trainer ranks; 1 keeps the in-process trainer, bit for bit.")
    sharding: Literal["none", "fsdp2"] = Field(
        default="fsdp2",
        description="With workers > 1: fsdp2 shards parameters, gradients and optimizer state (fully_shard per "
        "decoder layer, then the root module); none replicates them on every rank.",
    )
    mixed_precision: Literal["bf16"] | None = Field(
        default=None,
        description="bf16: compute in bfloat16 with float32 master weights and float32 gradient reduction; "
        "null: compute in the policy's dtype.",
    )
    activation_checkpointing: bool = Field(
        default=False, description="Recompute each decoder layer's activations in the backward pass."
    )
    cpu_offload: bool = Field(
        default=False, description="FSDP2's CPU offload of parameters and optimizer state (GPU runs only)."
    )
    lora: LoraSettings | None = Field(default=None, description="Train LoRA adapters instead of every weight.")
    worker: TrainerWorkerSettings = Field(default_factory=TrainerWorkerSettings)


WITH_WORKERS_UNBUILT: dict[str, tuple[Any, str]] = {}
"""Settings not built yet for `workers > 1` (FSDP2 ranks): the only value accepted there, and the feature."""

UNBUILT: dict[str, tuple[Any, str]] = {}
"""Settings whose feature is not built yet: the only value accepted, and what the feature is. A feature that
lands removes its entry."""


def trainer_rule_problems(data: Mapping[str, Any], device: str) -> list[RuleProblem]:
    """Cross-field rules of the `trainer` section: features not built yet, and CPU offload only off the CPU
    (`device`: the policy's torch device)."""
    trainer = data.get("trainer")
    if not isinstance(trainer, Mapping):
        return []
    problems: list[RuleProblem] = []
    for name, (accepted, feature) in UNBUILT.items():
        value = raw_field(TrainerSettings, trainer, name)
        if value is not INVALID and value != accepted:
            problems.append((("trainer", name), f"{feature} is not built yet: only {accepted!r} is accepted", value))
    workers = raw_field(TrainerSettings, trainer, "workers")
    if workers is not INVALID and workers > 1:
        for name, (accepted, feature) in WITH_WORKERS_UNBUILT.items():
            value = raw_field(TrainerSettings, trainer, name)
            if value is not INVALID and value != accepted and name not in UNBUILT:
                problems.append((("trainer", name), f"{feature} with trainer.workers > 1 is not built yet: only "
                                 f"{accepted!r} is accepted there", value))
    offload = raw_field(TrainerSettings, trainer, "cpu_offload")
    if offload is True and str(device).startswith("cpu") and "cpu_offload" not in UNBUILT:
        problems.append(
            (("trainer", "cpu_offload"), "needs a GPU policy (policy.device): on the CPU there is nothing to offload",
             offload)
        )
    elif offload is True and workers is not INVALID and workers == 1:
        problems.append((("trainer", "cpu_offload"), "is FSDP2's CPU offload: it needs trainer.workers > 1 (the "
                         "in-process trainer of trainer.workers: 1 is not sharded)", offload))
    return problems


class SchedulerSettings(StrictModel):
    """The learning rate over the run's GRPO steps s = 1..T: a linear warm-up, then constant or a decay to `min_lr`
    (`training.schedule.scheduled_lr` has the formula)."""

    type: Literal["constant", "linear", "cosine"] = Field(
        default="constant",
        description="After the warm-up: `constant` (lr), `linear` (min_lr + (lr - min_lr)(1 - p)) or `cosine` "
        "(min_lr + (lr - min_lr)(1 + cos(pi p))/2), p = (s - P)/(T - P) the fraction of the decay done, P = max(W, 1) the step at lr.",
    )
    warmup_steps: int | None = Field(
        default=None, ge=0, description="W: GRPO steps of linear warm-up, lr x s/W at step s <= W; None: "
        "`warmup_ratio`, else no warm-up.",
    )
    warmup_ratio: float | None = Field(
        default=None, ge=0.0, le=1.0, description="W = ceil(warmup_ratio x T) (TRL's `warmup_ratio`); give it or "
        "`warmup_steps`, not both.",
    )
    min_lr: float = Field(default=0.0, ge=0.0, description="The lr a decay ends at, at step T (at most `lr`).")
    total_steps: int | None = Field(
        default=None, ge=1, description="T: the schedule's horizon in GRPO steps; None: `grpo.max_num_steps` of the "
        "run's start (a resumed run keeps the horizon it started with, even if `grpo.max_num_steps` grows; "
        "steps past T train at `min_lr`).",
    )


class OptimizerSettings(StrictModel):
    """AdamW, gradient clipping and micro-batching of the policy update."""

    lr: float = Field(
        default=1e-6, ge=0.0,
        description="Learning rate (the peak, with `scheduler`). 0: no update at all, the whole loop still runs (a "
        "control run, e.g. bench/learning.py's: any gain it shows is the pipeline's noise, not learning).",
    )
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    eps: float = Field(default=1e-8, gt=0.0, description="AdamW epsilon.")
    max_grad_norm: float | None = Field(default=1.0, gt=0.0, description="Clip the global grad norm; None: no.")
    micro_batch_size: int = Field(default=4, ge=1, description="Sequences per forward/backward pass.")
    minibatches_per_step: int = Field(
        default=1, ge=1, description="Optimizer steps per GRPO step (the step's samples split evenly)."
    )
    share_prompt_prefix: bool = Field(
        default=True,
        description="Run the decoder once over a prompt that several samples of a micro-batch share, the samples "
        "continuing from copies of its KV cache (the same logprobs and gradients up to float rounding); false: "
        "one forward over every sample's full sequence.",
    )
    skip_zero_advantage: bool = Field(
        default=True,
        description="Skip the forward and backward of a micro-batch whose every advantage is 0 when the loss has no "
        "KL term (kl_coef 0): it adds exactly 0 to the gradient, its tokens still count in the normalisation, so "
        "the update is bit for bit the same (one-process trainer; FSDP2 ranks run every micro-batch). Sparse "
        "rewards make most groups all-0 or all-1: this is most of a step's training time then.",
    )
    scheduler: SchedulerSettings = Field(
        default_factory=SchedulerSettings,
        description="The learning-rate schedule over GRPO steps (NeMo-RL's `policy.scheduler`, TRL's "
        "`lr_scheduler_type` + `warmup_ratio`); the default keeps `lr` constant. Every optimizer step of a GRPO "
        "step (`minibatches_per_step`) uses that step's lr.",
    )


def optimizer_rule_problems(data: Mapping[str, Any]) -> list[RuleProblem]:
    """Cross-field rules of the `optimizer` section: one warm-up setting, and a decay that ends at or below lr."""
    optimizer = data.get("optimizer")
    scheduler = optimizer.get("scheduler") if isinstance(optimizer, Mapping) else None
    if not isinstance(scheduler, Mapping):
        return []
    problems: list[RuleProblem] = []
    steps, ratio = (raw_field(SchedulerSettings, scheduler, k) for k in ("warmup_steps", "warmup_ratio"))
    if steps not in (None, INVALID) and ratio not in (None, INVALID):
        problems.append((("optimizer", "scheduler", "warmup_ratio"), "give warmup_steps or warmup_ratio, not both "
                         f"(warmup_steps is {steps})", ratio))
    min_lr, lr = raw_field(SchedulerSettings, scheduler, "min_lr"), raw_field(OptimizerSettings, optimizer, "lr")
    if INVALID not in (min_lr, lr) and min_lr > lr:
        problems.append((("optimizer", "scheduler", "min_lr"), f"must be at most optimizer.lr ({lr})", min_lr))
    return problems
