"""Which checkpoint format a trainer writes, and restoring a trainer from either format.

One process (`PolicyTrainer`, `trainer.workers: 1`) writes a Hugging Face folder and `optimizer.pt`: it holds the
whole model anyway, and the folder loads as is (`policy.model_name=<step>/policy`, transformers, vLLM). FSDP2
ranks (`DistributedTrainer`) write `torch.distributed.checkpoint` shards, each rank its own, so no process ever
gathers the model to save it. Either trainer restores either format: one process reads shards without a process
group (consolidated by DCP), ranks read a Hugging Face checkpoint's weights when they load the model (the caller
passes its `policy/` folder as the model path) and its optimizer state here, each keeping its shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from nemo_rl_ext.training.checkpoint import Checkpoint, write_whole_state
from nemo_rl_ext.training.distributed_trainer import DistributedTrainer
from nemo_rl_ext.training.sharded_checkpoint import load_trained_state
from nemo_rl_ext.training.trainer import PolicyTrainer


def state_writer(trainer: PolicyTrainer | DistributedTrainer) -> Callable[[Path], None]:
    """`save_checkpoint`'s `write_state` for this trainer: the ranks' shards, or one process's files."""
    if isinstance(trainer, DistributedTrainer):
        return trainer.save_sharded
    return functools.partial(write_whole_state, model=trainer.model, optimizer=trainer.optimizer)


def weights_in_model_dir(checkpoint: Checkpoint | None) -> bool:
    """Whether the checkpoint's `policy/` folder holds the full weights (so the model loads from it)."""
    return checkpoint is not None and not checkpoint.sharded and not checkpoint.adapters


def restore_trainer_state(trainer: PolicyTrainer | DistributedTrainer, checkpoint: Checkpoint) -> None:
    """Load the checkpoint's trained state into the trainer: sharded weights and optimizer state, or (a Hugging Face
    checkpoint, whose weights the model was loaded from) the optimizer state."""
    if not checkpoint.sharded:
        trainer.optimizer.load_state_dict(checkpoint.optimizer_state(trainer.device))
    elif isinstance(trainer, DistributedTrainer):
        trainer.load_sharded(checkpoint.path)
    else:
        load_trained_state(checkpoint.path, trainer.model, trainer.optimizer)
