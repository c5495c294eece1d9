"""Export a GRPO run's checkpoint as a Hugging Face model folder that `transformers` and `run_eval.py` load.

    python examples/run_grpo.py export RUN_DIR [--step N] [--out DIR] [--force] [--adapter-only]

The folder holds the weights (safetensors), `config.json`, `generation_config.json` (when the model has one) and
the tokenizer with its chat template, written after every file of the checkpoint was checked against its
completeness marker (`checkpoint.py`). By default the newest whole
checkpoint is exported (`resumable_checkpoint`: a damaged newest one falls back to the previous whole one);
`--step N` picks one and refuses it when it is missing or damaged. The folder is written into a temporary sibling
and renamed into place, so an interrupted export leaves no half-written `--out`; an existing non-empty `--out` is
replaced only with `--force`.

What the checkpoint holds decides what is written (`export_weights`): a one-process checkpoint's Hugging Face
folder is copied byte for byte; a sharded one (`trainer.workers > 1`, `torch.distributed.checkpoint`) is
consolidated into one; LoRA adapters (either format) are merged into their base model, or with `--adapter-only`
written as peft's adapter folder (which loads with `PeftModel.from_pretrained(base, DIR)`).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from nemo_rl_ext.training.checkpoint import (
    Checkpoint,
    CheckpointError,
    checkpoint_dir,
    fsync_path,
    list_checkpoints,
    load_checkpoint,
    resumable_checkpoint,
)
from nemo_rl_ext.training.export_weights import ExportError, write_export

CHECKPOINTS = "checkpoints"
"""Where a run keeps its checkpoints, under its `output_dir`."""
PolicyKind = Literal["full", "adapters"]


@dataclass(frozen=True)
class ExportResult:
    """What `export_checkpoint` wrote."""

    out: Path
    """The exported folder."""
    checkpoint: Path
    """The checkpoint folder it came from."""
    step: int
    """The training step of that checkpoint."""
    files: tuple[str, ...]
    """The exported files, relative to `out`, sorted."""
    total_bytes: int
    """Their total size."""


def select_checkpoint(run_dir: str | Path, step: int | None = None) -> Checkpoint:
    """The verified checkpoint to export: `step`'s, else the newest whole one (falling back past damaged ones)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir} is not a folder (pass a GRPO run's output_dir)")
    root = run_dir / CHECKPOINTS
    if step is not None:
        path = checkpoint_dir(root, step)
        if not path.is_dir():
            steps = [int(p.name.removeprefix("step_")) for p in list_checkpoints(root)]
            raise ExportError(f"{run_dir} has no checkpoint of step {step} ({path} does not exist); "
                              f"complete checkpoints: {steps or 'none'}")
        try:
            return load_checkpoint(path)
        except CheckpointError as err:
            raise ExportError(f"the checkpoint of step {step} can't be exported: {err}") from None
    try:
        checkpoint = resumable_checkpoint(root)
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    if checkpoint is None:
        raise ExportError(f"{run_dir} holds no complete checkpoint under {root} (is it a GRPO run's output_dir? "
                          "checkpoints are written every grpo.save_period steps and at the last step)")
    return checkpoint


def policy_kind(checkpoint: Checkpoint) -> PolicyKind:
    """What the checkpoint's `policy/` folder holds: a full model, or LoRA adapters over a base model."""
    return "adapters" if checkpoint.adapters else "full"


def default_out(run_dir: str | Path, step: int) -> Path:
    """Where `export` writes without `--out`: `RUN_DIR/export/step_<N>`."""
    return Path(run_dir) / "export" / f"step_{step}"


def export_checkpoint(
    run_dir: str | Path,
    *,
    step: int | None = None,
    out: str | Path | None = None,
    force: bool = False,
    adapter_only: bool = False,
) -> ExportResult:
    """Write a checkpoint of the run in `run_dir` as a Hugging Face folder (see the module docstring)."""
    checkpoint = select_checkpoint(run_dir, step)
    kind = policy_kind(checkpoint)
    if adapter_only and kind == "full":
        raise ExportError(f"--adapter-only: this run has no adapters ({checkpoint.path} holds full weights; "
                          "trainer.lora was off). Export it without --adapter-only")
    out = Path(out) if out is not None else default_out(run_dir, checkpoint.step)
    _check_out(out, force, Path(run_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.tmp*"):  # left by an export that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp", dir=out.parent))
    try:
        write_export(checkpoint, tmp, adapter_only=adapter_only)
        for file in tmp.rglob("*"):
            if file.is_file():
                fsync_path(file)
        tmp.chmod(0o755)
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    names = tuple(sorted(f.relative_to(out).as_posix() for f in out.rglob("*") if f.is_file()))
    total = sum((out / name).stat().st_size for name in names)
    return ExportResult(out=out, checkpoint=checkpoint.path, step=checkpoint.step, files=names, total_bytes=total)


def _check_out(out: Path, force: bool, run_dir: Path) -> None:
    """Refuse an `--out` that is a file, that holds the run's checkpoints or lies among them (`--force` would
    delete them), or that is a non-empty folder without `force`."""
    checkpoints, target = (run_dir / CHECKPOINTS).resolve(), out.resolve()
    if checkpoints.is_relative_to(target) or target.is_relative_to(checkpoints):
        raise ExportError(f"--out {out} would overwrite the run's checkpoints ({run_dir / CHECKPOINTS}); "
                          "pick a folder outside them")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; pass a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"--out {out} already exists and is not empty; pass --force to replace it")


def _replace(tmp: Path, out: Path) -> None:
    """Rename `tmp` to `out`, moving an existing `out` aside first and deleting it after."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-old", dir=out.parent))
        out.rename(old / out.name)
    tmp.rename(out)
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

