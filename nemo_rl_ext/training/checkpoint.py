"""Training checkpoints, written atomically: model, optimizer, step, RNG states and data position.

Layout of `<root>/step_<NNNNNNNN>/`, written by one process (`trainer.workers: 1`):

    policy/          the model and tokenizer (`save_pretrained`: loadable as `policy.model_name=<path>`); of a
                     LoRA policy, its adapters and the tokenizer (`adapter_config.json` names the base model)
    optimizer.pt     the optimizer's state_dict

or by FSDP2 ranks (`trainer.workers > 1`, `write_state`: see `sharded_checkpoint`):

    shards/          torch.distributed.checkpoint: the trained parameters and their optimizer state, one file
                     per rank and `.metadata`
    policy/          the model's config (and a LoRA policy's `adapter_config.json`) and the tokenizer; no weights

and in both:

    rng.pt           python, numpy and torch (CPU and CUDA) RNG states
    state.json       {"step": int, "data": {...}, "extra": {...}}
    complete.json    the completeness marker, written last: every other file's size and sha256

Everything is written (and fsynced) into a hidden temporary sibling folder, the marker last, and the
folder is renamed into place, so a run killed mid-save (or a rank that dies while it writes its shards)
leaves only a `.tmp` folder, which the next save removes. A `step_*` folder without the marker (a crash
mid-write on a filesystem without atomic renames, a partial copy) is not a checkpoint. Loading checks every
file against the marker, so a truncated or overwritten file, or a missing one, is a `CheckpointError` naming
it; `resumable_checkpoint` then falls back to the newest checkpoint that is whole. A run never overwrites
step folders it cannot resume from unless told to start over (`GRPO`, `resume=restart`; `discard_checkpoints`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.models.adapters import is_peft_model
from nemo_rl_ext.training.sharded_checkpoint import SHARDS, is_sharded

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "state.json"
ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter file: its presence in `policy/` marks a checkpoint of LoRA adapters."""
MARKER_FILE = "complete.json"
"""Written last: {"step": int, "files": {relative path: {"bytes": int, "sha256": str}}}."""


class CheckpointError(ConfigError):
    """A checkpoint that can't be used (a damaged or missing file); the message names the file."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read back from disk."""

    path: Path
    """The checkpoint folder."""
    step: int
    """Training steps completed when it was written."""
    data_state: dict[str, Any]
    """The data position (whatever the prompt stream's `state_dict()` returned)."""
    extra: dict[str, Any]
    """Anything else the loop stored (JSON)."""

    @property
    def model_dir(self) -> Path:
        """The `save_pretrained` folder of the policy (model + tokenizer; with shards: config + tokenizer)."""
        return self.path / "policy"

    @property
    def sharded(self) -> bool:
        """The weights and optimizer state are `torch.distributed.checkpoint` shards (`shards_dir`)."""
        return is_sharded(self.path)

    @property
    def adapters(self) -> bool:
        """The policy is LoRA adapters over a base model (peft's `adapter_config.json` in `policy/`)."""
        return (self.model_dir / ADAPTER_CONFIG).is_file()

    @property
    def shards_dir(self) -> Path:
        """The `torch.distributed.checkpoint` folder of a sharded checkpoint."""
        return self.path / SHARDS

    def optimizer_state(self, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """The optimizer's state_dict (of a checkpoint written by one process; a sharded one holds it in shards)."""
        if self.sharded:
            raise CheckpointError(f"{self.path} is sharded: its optimizer state is in {self.shards_dir}")
        return torch.load(self.path / "optimizer.pt", map_location=map_location, weights_only=True)

    def restore_rng(self) -> None:
        """Set the python, numpy and torch RNGs to their states at save time."""
        set_rng_state(torch.load(self.path / "rng.pt", weights_only=True))


def get_rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states, as plain lists and tensors (loadable with weights_only)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `get_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return Path(root) / f"step_{step:08d}"


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    tokenizer: Any,
    data_state: dict[str, Any],
    model: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    write_state: Callable[[Path], None] | None = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
    rng_state: dict[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of `step` atomically (replacing an existing one); returns its folder.

    The weights and optimizer state: `model.save_pretrained` and `optimizer.state_dict()`, or `write_state(folder)`
    (sharded: `shards/` and `policy/`'s config, see `sharded_checkpoint`), called with the temporary folder.
    With `keep_last`, older complete checkpoints beyond the newest `keep_last` are deleted afterwards.
    `rng_state` (a `get_rng_state()` taken earlier, e.g. when the step ended) replaces the RNG states of now.
    """
    if write_state is None and (model is None or optimizer is None):
        raise ValueError("save_checkpoint needs model and optimizer, or write_state")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".step_*.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = checkpoint_dir(root, step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp", dir=root))
    try:
        if write_state is not None:
            write_state(tmp)
        else:
            write_whole_state(tmp, model, optimizer)
        tokenizer.save_pretrained(tmp / "policy")
        torch.save(rng_state if rng_state is not None else get_rng_state(), tmp / "rng.pt")
        state = {"step": int(step), "data": data_state, "extra": extra or {}}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
        files = {}
        for file in sorted(f for f in tmp.rglob("*") if f.is_file()):
            fsync_path(file)
            files[file.relative_to(tmp).as_posix()] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
        (tmp / MARKER_FILE).write_text(json.dumps({"step": int(step), "files": files}, indent=2))
        fsync_path(tmp / MARKER_FILE)
        tmp.chmod(0o755)
        if final.exists():  # replacing a checkpoint of the same step: move the old one aside first
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-old", dir=root))
            final.rename(old / final.name)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep_last is not None:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def write_whole_state(folder: Path, model: Any, optimizer: torch.optim.Optimizer) -> None:
    """One process's weights (`policy/`: a Hugging Face folder, or a LoRA policy's adapters) and optimizer state
    (`optimizer.pt`) into the checkpoint `folder`."""
    if is_peft_model(model):  # the adapters alone: never the base's embeddings or LM head
        model.save_pretrained(folder / "policy", save_embedding_layers=False)
    else:
        model.save_pretrained(folder / "policy")
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_folders(root: str | Path) -> list[Path]:
    """Every `step_*` folder under `root`, complete or not, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under `root` whose completeness marker exists, oldest first (not yet verified)."""
    return [p for p in step_folders(root) if (p / MARKER_FILE).is_file()]


def discard_checkpoints(root: str | Path) -> list[Path]:
    """Delete every step folder under `root` (complete or not) and any temporary one, logging what goes (a run
    that starts over); returns the step folders deleted."""
    folders = step_folders(root)
    if folders:
        logger.warning("starting over: deleting the %d step folder(s) of the earlier run in %s (%s)",
                       len(folders), root, ", ".join(p.name for p in folders))
    for path in [*folders, *Path(root).glob(".step_*.tmp*")]:
        shutil.rmtree(path, ignore_errors=True)
    return folders


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` with its completeness marker, or None."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def verify_checkpoint(path: str | Path) -> None:
    """Check every file of a checkpoint against its marker; raise CheckpointError naming the first bad one."""
    path = Path(path)
    marker = path / MARKER_FILE
    if not marker.is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint: it has no {MARKER_FILE} (a save that never finished)"
        )
    try:
        files = json.loads(marker.read_text())["files"]
        expected = {str(name): (int(f["bytes"]), str(f["sha256"])) for name, f in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{marker} is damaged: {type(exc).__name__}: {exc}") from None
    for name, (size, digest) in expected.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file} is damaged: {file.stat().st_size} bytes, {size} when saved")
        if _sha256(file) != digest:
            raise CheckpointError(f"{file} is damaged: its contents changed since the save (sha256 differs)")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Verify a checkpoint folder and read its metadata (the model, optimizer and RNG are read on demand)."""
    path = Path(path)
    verify_checkpoint(path)
    state = json.loads((path / STATE_FILE).read_text())
    return Checkpoint(path=path, step=int(state["step"]), data_state=state["data"], extra=state.get("extra", {}))


def resumable_checkpoint(root: str | Path) -> Checkpoint | None:
    """The newest checkpoint under `root` that is whole; None when there is none at all.

    Damaged ones are skipped with one warning naming each damaged file; when every checkpoint is damaged,
    a CheckpointError lists them instead (starting over would silently discard the run).
    """
    damaged: list[str] = []
    for path in reversed(list_checkpoints(root)):
        try:
            checkpoint = load_checkpoint(path)
        except CheckpointError as err:
            damaged.append(str(err))
            continue
        if damaged:
            logger.warning("%s; resuming from the previous whole checkpoint, %s", "; ".join(damaged), path)
        return checkpoint
    if damaged:
        raise CheckpointError(f"no usable checkpoint in {root}:\n  - " + "\n  - ".join(damaged))
    return None
