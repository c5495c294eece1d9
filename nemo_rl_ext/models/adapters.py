"""A peft LoRA adapter folder as the policy's model: `policy.model_name=<step>/policy` of a one-process LoRA run, or
an `export --adapter-only` folder (`adapter_config.json`, the adapter weights, the tokenizer beside them).

The base model is `adapter_config.json`'s `base_model_name_or_path` (a model folder, or "tiny" / "smollm2"); the
adapters are merged into it (`W + (alpha / r) B A`, peft's `merge_and_unload`, in float32) and the result is written
once, with the adapter folder's tokenizer (else the base's), to a cache folder keyed by the adapter's and the base's
files (`merged_adapter_folder`). Every backend, replica and the policy server then loads a plain model folder, the
same arithmetic as `export`'s merged model of a float32 run, so the two generate alike. A folder with
`adapter_config.json` but no adapter weights (the `policy/` of a LoRA run on FSDP2 ranks: its adapters are in
`shards/`) and a base model that is not here are user errors saying to `export` instead (`adapter_folder_problem`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


def is_peft_model(model: object) -> bool:
    """`model` is a peft `PeftModel`, without importing peft for the answer (a peft model means peft is imported
    already; a run without LoRA, or an export, then starts without peft's import, about half a second)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PEFT_FILES = (ADAPTER_CONFIG, *ADAPTER_WEIGHTS, "README.md")
"""What peft writes into an adapter folder (README.md: its model card)."""
MERGED_DIR = "merged-adapters"
"""The cache's sub-folder of merged adapter folders."""
_EXPORT_HINT = "export the run's merged model (python examples/run_grpo.py export RUN_DIR [--step N]) and load that"


def is_adapter_folder(folder: str | Path) -> bool:
    """Whether `folder` is a peft adapter folder (it holds `adapter_config.json`)."""
    return (Path(folder).expanduser() / ADAPTER_CONFIG).is_file()


def adapter_base(folder: str | Path) -> str:
    """`base_model_name_or_path` of the adapter folder's `adapter_config.json` ("" when it names none)."""
    try:
        config = json.loads((Path(folder).expanduser() / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):
        return ""
    base = config.get("base_model_name_or_path") if isinstance(config, dict) else None
    return str(base) if base else ""


def adapter_folder_problem(folder: str | Path, builtin: tuple[str, ...]) -> str | None:
    """Why the adapter folder cannot be the policy's model (no adapter weights; a base model that is neither one of
    `builtin` nor a model folder here), or None. Reads `adapter_config.json` alone."""
    folder = Path(folder).expanduser()
    if not any((folder / name).is_file() for name in ADAPTER_WEIGHTS):
        return (f"policy.model_name={str(folder)!r} holds {ADAPTER_CONFIG} but no adapter weights "
                f"({' or '.join(ADAPTER_WEIGHTS)}; a LoRA checkpoint of FSDP2 ranks keeps them in shards/): "
                + _EXPORT_HINT)
    base = adapter_base(folder)
    if base in builtin or (base and (Path(base).expanduser() / "config.json").is_file()):
        return None
    return (f"policy.model_name={str(folder)!r} is a LoRA adapter folder whose base model {base!r} ({ADAPTER_CONFIG}'s "
            f"base_model_name_or_path) is not a model folder here: restore it there, or {_EXPORT_HINT}")


@contextlib.contextmanager
def peft_reads_a_deprecated_alias() -> Iterator[None]:
    """peft 0.21.2 (the newest release) reads `model.is_gradient_checkpointing` in `PeftModel.__init__`, an alias
    transformers 5.x deprecates with a FutureWarning (the value is `is_activation_checkpointing`'s, so nothing is
    wrong); that one warning, by its message, is not shown. Nothing of ours reads the alias."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def _fingerprint(folder: Path, base: Path) -> str:
    """sha256 of the adapter folder's files and of the base model's config, with its weight files' sizes and times."""
    digest = hashlib.sha256(str(base.resolve()).encode())
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for path in sorted(p for p in base.iterdir() if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    digest.update((base / "config.json").read_bytes())
    return digest.hexdigest()[:16]


def _copy_tokenizer(folder: Path, base: Path, out: Path) -> None:
    """The adapter folder's tokenizer files (else the base model's): every file but weights, configs and peft's."""
    source = folder if (folder / "tokenizer_config.json").is_file() else base
    skip = {*PEFT_FILES, "config.json", "generation_config.json"}
    for path in source.iterdir():
        weights = path.name.startswith(("model", "pytorch_model")) and path.suffix in (".safetensors", ".bin", ".json")
        if path.is_file() and path.name not in skip and not weights:
            shutil.copyfile(path, out / path.name)


def merged_adapter_folder(folder: str | Path, base: str | Path, cache_root: str | Path) -> Path:
    """The model folder of `base` with the adapters of `folder` merged in, written under `cache_root` on first use
    (atomically: a folder in the cache is whole) and reused while neither folder changes."""
    folder, base = Path(folder).expanduser(), Path(base).expanduser()
    out = Path(cache_root) / MERGED_DIR / f"{folder.resolve().parent.name}-{folder.name}-{_fingerprint(folder, base)}"
    if (out / "config.json").is_file():
        return out
    # lazy: peft and transformers load only when an adapter folder is the policy
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with peft_reads_a_deprecated_alias():
            merged = PeftModel.from_pretrained(model, folder).merge_and_unload()
        merged.save_pretrained(tmp)
        _copy_tokenizer(folder, base, tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process merged it meanwhile: theirs is the same
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("policy.model_name %s: LoRA adapters merged into %s, written to %s", folder, base, out)
    return out


__all__ = ["ADAPTER_CONFIG", "adapter_base", "adapter_folder_problem", "is_adapter_folder", "merged_adapter_folder",
           "peft_reads_a_deprecated_alias"]
