"""Setting up a GRPO run before its loop: the input checks, the checkpoint to resume (and what refuses a resume),
and the policy's parts: tokenizer, trainer (in process, or FSDP2 ranks on Ray), reference model and engine.

Everything here raises `ConfigError` for a user error before any model is loaded; `GRPO.__init__` calls it in
this order: `check_inputs`, `checkpoint_to_resume`, `seed_everything`, `build_policy_parts`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_rl_ext.cluster import loads_model_folder
from nemo_rl_ext.config import ConfigError, config_changes, raise_problems
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.distillation.rank_teacher import teachers_on
from nemo_rl_ext.distillation.scoring import TeacherScorer
from nemo_rl_ext.distillation.teachers import build_scorer, local_teachers, placement
from nemo_rl_ext.experience.build import build_policy
from nemo_rl_ext.experience.input_checks import dataset_agents, distillation_input_problems
from nemo_rl_ext.grpo.config import (
    RESTART,
    RESUME_MAY_CHANGE,
    GRPOConfig,
    input_problems,
    saved_config_settings,
    training_sources,
)
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.grpo.step_seeds import SaltedGeneration
from nemo_rl_ext.grpo.trackers import missing_extras
from nemo_rl_ext.models.loading import device_problem, load_model_and_tokenizer, load_tokenizer
from nemo_rl_ext.models.policy import resolve_model_path
from nemo_rl_ext.objectives.distillation import distillation_loss
from nemo_rl_ext.training.checkpoint import (
    MARKER_FILE,
    Checkpoint,
    latest_checkpoint,
    load_checkpoint,
    resumable_checkpoint,
    step_folders,
)
from nemo_rl_ext.training.distributed_trainer import DistributedTrainer, rank_spec
from nemo_rl_ext.training.lora import lora_target_problem, with_lora
from nemo_rl_ext.training.state import weights_in_model_dir
from nemo_rl_ext.training.trainer import PolicyTrainer

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's padding id (its end-of-sequence id when it has none)."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def check_inputs(cfg: GRPOConfig, train_datums: Sequence[DatumSpec] | None,
                 val_datums: Sequence[DatumSpec] | None) -> None:
    """Raise one `ConfigError` naming every problem of the run's inputs (files, LoRA targets, a device torch does
    not have here)."""
    problems = input_problems(cfg, train=train_datums is None, val=val_datums is None)
    if cfg.trainer.workers == 1:  # the trainer and a local teacher load here on policy.device (else: on the ranks)
        problems += [p for p in (device_problem("policy.device", cfg.policy.device),) if p is not None]
    problems += missing_extras(cfg.logger)  # a tracker's package: before any model loads
    problems += distillation_problems(cfg, train_datums, val_datums)
    lora = cfg.trainer.lora
    if lora is not None and cfg.policy.model_folder_problem() is None:
        problems += [p for p in (lora_target_problem(lora, resolve_model_path(cfg.policy)),) if p]
    raise_problems(problems, "the GRPO run's inputs")


def distillation_problems(cfg: GRPOConfig, train_datums: Sequence[DatumSpec] | None,
                          val_datums: Sequence[DatumSpec] | None) -> list[str]:
    """On-policy distillation's problems (`experience.input_checks.distillation_input_problems`) over the agents
    of the run's rows: the given datums', else those of the training datasets and the validation file."""
    settings = cfg.on_policy_distillation
    if not settings.enabled:
        return []
    agents: set[str] = set()
    for datums in (train_datums, val_datums):
        if datums is not None:
            pairs = getattr(datums, "agent_pairs", None)  # LazyDatums: without tokenizing every row
            agents |= {a for _, a in pairs()} if pairs is not None else {d.agent for d in datums}
    keys = dict(question_key=cfg.data.question_key, answer_key=cfg.data.answer_key)
    if train_datums is None:
        for _, path, rollouts, subset, split in training_sources(cfg):
            agents |= set(dataset_agents(path, rollouts, subset=subset, split=split, **keys))
    if val_datums is None and cfg.data.val_path is not None and (cfg.grpo.val_period > 0 or cfg.grpo.val_at_start):
        agents |= set(dataset_agents(cfg.data.val_path, cfg.rollouts, limit=cfg.validation.num_prompts,
                                     subset=cfg.data.subset, split=cfg.data.val_split, **keys))
    return distillation_input_problems(settings, cfg.policy, sorted(agents))


# ---- the checkpoint to resume -----------------------------------------------------------------------


def checkpoint_to_resume(cfg: GRPOConfig, output_dir: Path, checkpoint_root: Path) -> Checkpoint | None:
    """The verified checkpoint to resume (falling back past damaged ones), after checking its config.

    Neither a fresh run nor a resume destroys an earlier run's outputs: with `resume=false`, checkpoints or
    step folders in output_dir are refused; with `resume=true`, step folders or step metrics without a
    complete checkpoint to continue from are refused, naming what is there. Only `resume=restart` starts
    over in such a folder (its checkpoints are deleted once every other check passed)."""
    resume = cfg.resume
    if resume == RESTART:
        return None
    if resume is False:
        if latest_checkpoint(checkpoint_root) is not None or step_folders(checkpoint_root):
            raise ConfigError(
                f"{output_dir} already holds checkpoints: set resume=true to continue that run, "
                "resume=restart to discard it and start over, or choose another output_dir"
            )
        return None
    checkpoint = resumable_checkpoint(checkpoint_root) if resume is True else load_checkpoint(resume)
    if checkpoint is None:
        found = earlier_outputs(output_dir, checkpoint_root)
        if found:
            raise ConfigError(
                f"resume=true, but {output_dir} holds no complete checkpoint to continue from, only "
                f"{' and '.join(found)}; starting from step 0 would overwrite them. Set resume=restart to "
                "discard them and start over, or choose another output_dir"
            )
        logger.warning("resume=true but %s holds no checkpoint: starting from step 0", checkpoint_root)
        return None
    check_saved_config(cfg, checkpoint)
    return checkpoint


def check_saved_config(cfg: GRPOConfig, checkpoint: Checkpoint) -> None:
    """Refuse to resume `checkpoint` with a config that differs from its own beyond `RESUME_MAY_CHANGE`."""
    saved = checkpoint.extra.get("config")
    if saved:  # a config saved in an older spelling compares by its settings
        try:
            saved = GRPOConfig.model_validate(saved_config_settings(saved)).model_dump(mode="json")
        except ValueError:
            pass
    changes = (
        config_changes(saved, cfg.model_dump(mode="json"), RESUME_MAY_CHANGE, cfg.key_as_written)
        if saved
        else []
    )
    if changes:
        raise ConfigError(
            f"{checkpoint.path} was saved by a run with a different config; resuming would mix two runs. "
            "Changed keys:\n  - " + "\n  - ".join(changes) + "\nRestore these values or use another "
            f"output_dir. Keys that may change on resume: {', '.join(RESUME_MAY_CHANGE)}"
        )


def earlier_outputs(output_dir: Path, checkpoint_root: Path) -> list[str]:
    """What an earlier run left in output_dir besides complete checkpoints: step folders without their
    completeness marker, and step records in metrics.jsonl (empty: nothing to lose)."""
    found = []
    folders = step_folders(checkpoint_root)
    if folders:
        names = ", ".join(p.name for p in folders[:5]) + (", ..." if len(folders) > 5 else "")
        found.append(f"{len(folders)} step folder(s) in {checkpoint_root} ({names}), none of them "
                     f"complete (no {MARKER_FILE}: a save that never finished, or a partial copy)")
    records = read_metrics(output_dir / "metrics.jsonl")
    if records:
        found.append(f"{len(records)} step record(s) in {output_dir / 'metrics.jsonl'}")
    return found


# ---- the policy's parts -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyParts:
    """What `build_policy_parts` builds."""

    tokenizer: Any
    """The policy's tokenizer."""
    trainer: PolicyTrainer | DistributedTrainer
    """The trainer: in this process, or FSDP2 ranks on Ray (`trainer.workers > 1`)."""
    generation: SaltedGeneration
    """The generation backend, its seeds salted by step and rollout batch."""


def build_policy_parts(cfg: GRPOConfig, checkpoint: Checkpoint | None) -> PolicyParts:
    """The tokenizer, trainer (with its reference model) and engine of a run, from the initial model or
    `checkpoint`'s weights."""
    dtype = getattr(torch, cfg.policy.dtype)
    initial_path = resolve_model_path(cfg.policy)
    # a LoRA checkpoint holds the adapters only, a sharded one its shards: the model comes from the initial folder
    model_path = checkpoint.model_dir if weights_in_model_dir(checkpoint) else initial_path
    if cfg.trainer.workers > 1:  # FSDP2 ranks on Ray load the policy: this process holds no trainer copy
        tokenizer = load_tokenizer(model_path)
        trainer = _distributed_trainer(cfg, checkpoint, model_path, initial_path, tokenizer)
        return PolicyParts(tokenizer, trainer, _engine(cfg, model_path, dtype, tokenizer))
    # bf16 mixed precision keeps float32 master weights (the engine keeps policy.dtype)
    train_dtype = torch.float32 if cfg.trainer.mixed_precision == "bf16" else dtype
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=train_dtype, device=cfg.policy.device)
    reference = None
    if cfg.trainer.lora is not None:  # its reference is itself with the adapters disabled: no copy
        saved = checkpoint.model_dir if checkpoint and not checkpoint.sharded else None
        model = with_lora(model, cfg.trainer.lora, adapter_dir=saved)
    elif cfg.loss.kl_coef > 0:
        reference, _ = load_model_and_tokenizer(initial_path, dtype=train_dtype, device=cfg.policy.device)
    generation = _engine(cfg, model_path, dtype, tokenizer)
    trainer = PolicyTrainer(
        model,
        optimizer=cfg.optimizer,
        loss=cfg.loss.to_loss_config(cfg.policy.generation.max_new_tokens),
        temperature=cfg.policy.generation.temperature,
        pad_token_id=pad_id(tokenizer),
        reference_model=reference,
        mixed_precision=cfg.trainer.mixed_precision,
        activation_checkpointing=cfg.trainer.activation_checkpointing,
        distillation=distillation_loss(cfg.on_policy_distillation),
    )
    return PolicyParts(tokenizer, trainer, generation)


def _distributed_trainer(cfg: GRPOConfig, checkpoint: Checkpoint | None, model_path: Path, initial_path: Path,
                         tokenizer: Any) -> DistributedTrainer:
    """FSDP2 trainer ranks on Ray; a LoRA run resumed from an unsharded checkpoint loads its adapters."""
    adapters = checkpoint.model_dir if checkpoint and cfg.trainer.lora is not None and not checkpoint.sharded else None
    return DistributedTrainer(
        rank_spec(cfg, model_path, initial_path if cfg.loss.kl_coef > 0 else None, pad_id(tokenizer),
                  adapter_dir=adapters),
        cfg.trainer, cfg.policy.cluster,
    )


def teacher_scorer(cfg: GRPOConfig, trainer: Any) -> TeacherScorer | None:
    """The distillation teachers of a run (None unless distilling): with `trainer.workers > 1` a local teacher is
    loaded on the trainer ranks (`distillation.rank_teacher`), never in this process; else in this process, on
    the trainer's device in its reference model's precision. A URL is a teacher over HTTP either way."""
    settings = cfg.on_policy_distillation
    if cfg.trainer.workers > 1:
        return build_scorer(settings, teachers_on(trainer))
    return build_scorer(settings, local_teachers(
        placement(cfg.policy.device, cfg.policy.dtype, cfg.trainer.mixed_precision)))


def _engine(cfg: GRPOConfig, model_path: Path, dtype: torch.dtype, tokenizer: Any) -> SaltedGeneration:
    """The generation backend: an in-process hf engine gets its own copy of the weights at `model_path`."""
    if not loads_model_folder(cfg.policy):
        engine_model, _ = load_model_and_tokenizer(model_path, dtype=dtype, device=cfg.policy.device)
        _, engine = build_policy(cfg.policy, model=engine_model, tokenizer=tokenizer)
    else:  # vllm, or a Ray pool, loads the initial model folder itself; a resumed run refits it
        _, engine = build_policy(cfg.policy, tokenizer=tokenizer)
    return SaltedGeneration(engine)
