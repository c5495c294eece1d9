"""Sharded checkpoints of the trained state with `torch.distributed.checkpoint` (DCP): each rank writes its shards.

What is saved is the same rule for a full fine-tune and for LoRA: the parameters that require grad (every
weight; or the adapters alone, nothing of the frozen base model) under their names in the model, and their
optimizer state (`torch.distributed.checkpoint.state_dict`: keyed by parameter name, not by position). A
checkpoint's `shards/` folder holds DCP's files: `.metadata` (what every tensor is, and which file holds which
piece) and `__<rank>_0.distcp` per rank. Loading reshards: any number of ranks (or one process without a process
group) reads the pieces of the shards it holds, so a checkpoint written by 2 ranks resumes on 1 and one written
by 1 process resumes on 2, bit for bit. `read_trained_weights` consolidates the full tensors without any model
(`export`). Rank 0 also writes the model's metadata into the checkpoint's `policy/` folder: `config.json`,
`generation_config.json`, and for a LoRA policy peft's `adapter_config.json` (no weights there).

The checkpoint folder must be one filesystem that every rank writes (local on one node; shared across nodes).
Atomicity and the completeness marker are `checkpoint.save_checkpoint`'s: the ranks write into its temporary
folder, and only after every rank returned does the driver write `complete.json` and rename the folder.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from nemo_rl_ext.config import ConfigError

SHARDS = "shards"
"""The DCP folder inside a checkpoint."""
POLICY = "policy"
"""The checkpoint's model folder: with shards, the model's config, tokenizer and (LoRA) adapter config only."""
MODEL_KEY, OPTIM_KEY = "model", "optim"
"""The two parts of the saved state: the trained parameters, and their optimizer state."""


class ShardedCheckpointError(ConfigError):
    """A sharded checkpoint that does not fit the model (other parameters than the ones it holds)."""


def _single_process() -> bool:
    import torch.distributed as dist  # lazy: torch.distributed loads only where a rank uses it

    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it runs in one process when there is no process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def trained_names(model: torch.nn.Module) -> set[str]:
    """The state-dict names of the parameters that require grad (a tied weight under each of its names)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def _trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """{"model": the parameters that require grad (sharded where they are), "optim": their optimizer state}."""
    # lazy: torch.distributed loads only where a rank uses it
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(ignore_frozen_params=True)
    trained = trained_names(model)
    # not buffers, and not a frozen weight tied to another name (`ignore_frozen_params` keeps a tied LM head)
    weights = {k: v for k, v in get_model_state_dict(model, options=options).items() if k in trained}
    return {MODEL_KEY: weights, OPTIM_KEY: get_optimizer_state_dict(model, optimizer, options=options)}


def save_trained_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                       metadata: bool = True) -> None:
    """Write the trained parameters and their optimizer state to `folder/shards` (every rank calls it; one process
    without a process group writes one shard); with `metadata`, also the model's config files to `folder/policy`
    (rank 0 only: one writer per file)."""
    import torch.distributed.checkpoint as dcp  # lazy: torch.distributed loads only where a rank uses it

    folder = Path(folder)
    with _quiet():
        dcp.save(_trained_state(model, optimizer), checkpoint_id=folder / SHARDS, no_dist=_single_process())
    if metadata:
        write_model_metadata(model, folder / POLICY)


def load_trained_state(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load `save_trained_state`'s shards into `model` and `optimizer`, resharded onto however they are sharded now
    (every rank calls it); `ShardedCheckpointError` when the checkpoint holds other parameters than the model
    trains (e.g. adapters for a full fine-tune)."""
    import torch.distributed.checkpoint as dcp  # lazy: torch.distributed loads only where a rank uses it
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    shards = Path(folder) / SHARDS
    problem = _key_problem(shards, model)
    if problem:
        raise ShardedCheckpointError(f"{shards} does not fit the model: {problem}")
    state = _trained_state(model, optimizer)
    with _quiet():
        dcp.load(state, checkpoint_id=shards, no_dist=_single_process())
    options = StateDictOptions(ignore_frozen_params=True)
    set_model_state_dict(model, state[MODEL_KEY], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    set_optimizer_state_dict(model, optimizer, state[OPTIM_KEY], options=options)


def _key_problem(shards: Path, model: torch.nn.Module) -> str | None:
    """Which trained parameters the checkpoint lacks or has in excess, or None."""
    trained, saved = trained_names(model), set(saved_parameter_names(shards))
    parts = []
    for what, names in (("lacks {} trained parameter(s)", sorted(trained - saved)),
                        ("holds {} parameter(s) the model does not train", sorted(saved - trained))):
        if names:
            parts.append(f"it {what.format(len(names))} ({', '.join(names[:3])}{', ...' * (len(names) > 3)})")
    return "; ".join(parts) or None


def _metadata(shards: Path) -> Any:
    # lazy: torch.distributed loads only where a rank uses it
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(shards).read_metadata()


def check_shards_visible(folder: str | Path) -> None:
    """ShardedCheckpointError unless this process sees `.metadata` and every shard file it names in `folder/shards`:
    ranks on other nodes that wrote to their own disk (not a shared filesystem) would otherwise leave a checkpoint
    marked whole that no run can load."""
    shards = Path(folder) / SHARDS
    try:
        files = {item.relative_path for item in _metadata(shards).storage_data.values()}
    except Exception as exc:  # no .metadata here (rank 0 wrote it elsewhere), or unreadable
        files, missing = set(), [f"{shards / '.metadata'} ({type(exc).__name__}: {exc})"]
    else:
        missing = sorted(str(shards / name) for name in files if not (shards / name).is_file())
    if missing:
        listed = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ShardedCheckpointError(f"the trainer ranks wrote a checkpoint this process can't see all of: {listed} "
                                     "missing. output_dir must be a filesystem every node of the ranks shares")


def saved_parameter_names(shards: str | Path) -> list[str]:
    """The names of the model tensors a `shards/` folder holds (from its `.metadata`)."""
    prefix = MODEL_KEY + "."
    return sorted(key.removeprefix(prefix) for key in _metadata(Path(shards)).state_dict_metadata
                  if key.startswith(prefix))


def read_trained_weights(shards: str | Path) -> dict[str, torch.Tensor]:
    """The full (consolidated) model tensors of a `shards/` folder, on the CPU, in this process: no model, no
    process group (what `export` writes, and what tests compare)."""
    import torch.distributed.checkpoint as dcp  # lazy: torch.distributed loads only where a rank uses it
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    shards = Path(shards)
    meta = _metadata(shards).state_dict_metadata
    prefix = MODEL_KEY + "."
    weights = {}
    for key, entry in meta.items():
        if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata):
            weights[key.removeprefix(prefix)] = torch.empty(entry.size, dtype=entry.properties.dtype)
    with _quiet():
        dcp.load({MODEL_KEY: weights}, checkpoint_id=shards, no_dist=True)
    return weights


def write_model_metadata(model: torch.nn.Module, folder: Path) -> None:
    """The model's `config.json` and `generation_config.json`, and a peft model's `adapter_config.json`."""
    from peft import PeftModel  # lazy: peft loads only when a checkpoint's metadata is written

    folder.mkdir(parents=True, exist_ok=True)
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    base.config.save_pretrained(folder)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(folder)
    if isinstance(model, PeftModel):
        for config in model.peft_config.values():
            config.save_pretrained(folder)


def is_sharded(checkpoint_path: str | Path) -> bool:
    """Whether a checkpoint folder holds DCP shards (else the model's weights are a Hugging Face folder)."""
    return (Path(checkpoint_path) / SHARDS).is_dir()
