"""What `export` writes for each kind of checkpoint (see `export.py`): one function per kind, each filling a folder.

| checkpoint | exported as | how |
| --- | --- | --- |
| full weights, one process (`policy/` is a Hugging Face folder) | the model | `policy/`'s files copied byte for byte |
| full weights, sharded (`shards/`) | the model | the shards consolidated (`read_trained_weights`), written with `save_pretrained` |
| LoRA adapters, either format | the merged model (default) | the base model (`adapter_config.json`'s `base_model_name_or_path`) with the adapters merged in: `W + (alpha / r) B A`, peft's `merge_and_unload` |
| LoRA adapters, either format | `--adapter-only`: the peft adapter folder | copied, or the consolidated adapters written by peft's `save_pretrained` |

Every folder gets the checkpoint's tokenizer files (the chat template included) and, for a model, `config.json` and
`generation_config.json`. Weights keep the dtype they were trained in (float32 master weights with
`trainer.mixed_precision: bf16`); a merged model is computed in that dtype too.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.training.checkpoint import ADAPTER_CONFIG, MARKER_FILE, Checkpoint
from nemo_rl_ext.training.sharded_checkpoint import read_trained_weights

REQUIRED_FILES = ("config.json", "tokenizer_config.json")
"""Files every exported full model has (besides its safetensors weights)."""
ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors", "adapter_model.bin", "README.md")
"""What peft writes into an adapter folder (README.md: its model card)."""


class ExportError(ConfigError):
    """A user error of `export`: no such run or step, a damaged checkpoint, an `--out` that is in the way."""


def listed_model_files(checkpoint: Checkpoint) -> tuple[str, ...]:
    """The files of the checkpoint's `policy/` folder (relative to it) that its marker lists (the verified ones)."""
    listed = json.loads((checkpoint.path / MARKER_FILE).read_text())["files"]
    prefix = checkpoint.model_dir.relative_to(checkpoint.path).as_posix() + "/"
    return tuple(sorted(name.removeprefix(prefix) for name in listed if name.startswith(prefix)))


def _copy(checkpoint: Checkpoint, names: tuple[str, ...], out: Path) -> None:
    for name in names:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkpoint.model_dir / name, out / name)


def _is_weights(name: str) -> bool:
    return name.startswith("model") and (".safetensors" in name or name.endswith(".bin"))


def _tokenizer_files(checkpoint: Checkpoint) -> tuple[str, ...]:
    """`policy/`'s files that are neither weights, nor the model config, nor peft's adapter files."""
    skip = {*ADAPTER_FILES, "config.json"}
    return tuple(n for n in listed_model_files(checkpoint) if n not in skip and not _is_weights(n))


def copy_full_model(checkpoint: Checkpoint, out: Path) -> None:
    """A one-process checkpoint's Hugging Face folder, byte for byte."""
    names = listed_model_files(checkpoint)
    missing = [name for name in REQUIRED_FILES if name not in names]
    if not any(name.endswith(".safetensors") for name in names):
        missing.append("*.safetensors")
    if missing:
        raise ExportError(f"{checkpoint.model_dir} is not a Hugging Face model folder: it has no {', '.join(missing)}")
    _copy(checkpoint, names, out)


def copy_adapters(checkpoint: Checkpoint, out: Path) -> None:
    """A one-process LoRA checkpoint's peft folder (adapters, their config, the tokenizer), byte for byte."""
    _copy(checkpoint, listed_model_files(checkpoint), out)


def _sharded_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    try:
        return read_trained_weights(checkpoint.shards_dir)
    except Exception as exc:  # DCP's own errors: a shard it cannot read
        raise ExportError(f"{checkpoint.shards_dir} can't be read: {type(exc).__name__}: {exc}") from None


def consolidate_full_model(checkpoint: Checkpoint, out: Path) -> None:
    """A sharded full-weight checkpoint as one Hugging Face folder (the model built on the meta device: no weight
    besides the consolidated ones is allocated)."""
    # lazy: transformers loads only when a checkpoint is exported
    from transformers import AutoConfig, AutoModelForCausalLM

    weights = _sharded_weights(checkpoint)
    config = AutoConfig.from_pretrained(checkpoint.model_dir)
    dtype = next(iter(weights.values())).dtype
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    first: dict[int, str] = {}
    for name, param in skeleton.named_parameters(remove_duplicate=False):
        first.setdefault(id(param), name)
    needed = sorted(set(first.values()))
    missing = [name for name in needed if name not in weights]
    if missing:
        raise ExportError(f"{checkpoint.shards_dir} lacks {len(missing)} weight(s) of the model ({', '.join(missing[:3])}"
                          f"{', ...' if len(missing) > 3 else ''}): a checkpoint of a run that froze them can't be "
                          "exported as a full model")
    skeleton.save_pretrained(out, state_dict={name: weights[name] for name in needed})
    _copy(checkpoint, _tokenizer_files(checkpoint), out)


def trained_weights(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """The trained tensors of a checkpoint of either format, under the names one process's files use: a full
    model's transformers names (shards also hold a tied weight under its second name), or peft's adapter names
    (`...q_proj.lora_A.weight`, without the adapter's name)."""
    # lazy: safetensors loads only when a checkpoint's weights are read
    from safetensors.torch import load_file

    if checkpoint.sharded:
        weights = _sharded_weights(checkpoint)
        if checkpoint.adapters:  # what peft's get_peft_model_state_dict does to the names
            return {re.sub(r"\.default(?=\.|$)", "", name): value for name, value in weights.items()}
        return weights
    pattern = "adapter_model.safetensors" if checkpoint.adapters else "model*.safetensors"
    weights = {}
    for file in sorted(checkpoint.model_dir.glob(pattern)):
        weights.update(load_file(file))
    return weights


def train_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The dtype the run trained in (its saved config): float32 with bf16 mixed precision, else `policy.dtype`."""
    config = checkpoint.extra.get("config") or {}
    if (config.get("trainer") or {}).get("mixed_precision") == "bf16":
        return torch.float32
    return getattr(torch, (config.get("policy") or {}).get("dtype") or "float32")


def _lora_config(checkpoint: Checkpoint) -> Any:
    from peft import LoraConfig  # lazy: peft (LoRA only) loads only when a LoRA checkpoint is exported

    return LoraConfig.from_pretrained(checkpoint.model_dir)


def _base_model_path(checkpoint: Checkpoint) -> Path:
    base = _lora_config(checkpoint).base_model_name_or_path
    if not base or not (Path(base) / "config.json").is_file():
        raise ExportError(f"the base model of {checkpoint.path}'s adapters, {base!r} ({checkpoint.model_dir / ADAPTER_CONFIG}"
                          "'s base_model_name_or_path), is not a model folder here: restore it to export the merged "
                          "model, or export the adapters alone with --adapter-only")
    return Path(base)


def _adapted(checkpoint: Checkpoint, base: Any) -> Any:
    """`base` with the checkpoint's adapters (peft's folder, or the consolidated shards)."""
    # lazy: peft (LoRA only) loads only when adapters are applied
    from peft import PeftModel, get_peft_model

    from nemo_rl_ext.training.lora import peft_reads_a_deprecated_alias  # lazy: lora.py imports peft

    with peft_reads_a_deprecated_alias():
        if not checkpoint.sharded:
            return PeftModel.from_pretrained(base, checkpoint.model_dir)
        model = get_peft_model(base, _lora_config(checkpoint))
    weights = _sharded_weights(checkpoint)
    adapters = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, extra = sorted(adapters - set(weights)), sorted(set(weights) - adapters)
    if missing or extra:
        raise ExportError(f"{checkpoint.shards_dir} does not hold the adapters its {ADAPTER_CONFIG} describes "
                          f"(missing: {missing[:3]}, unexpected: {extra[:3]})")
    model.load_state_dict(weights, strict=False)
    return model


def merge_adapters(checkpoint: Checkpoint, out: Path) -> None:
    """The base model with the checkpoint's adapters merged into its weights, as a Hugging Face folder."""
    from transformers import AutoModelForCausalLM  # lazy: transformers loads only when adapters are merged

    base = AutoModelForCausalLM.from_pretrained(_base_model_path(checkpoint), dtype=train_dtype(checkpoint))
    merged = _adapted(checkpoint, base).merge_and_unload()
    merged.save_pretrained(out)
    _copy(checkpoint, _tokenizer_files(checkpoint), out)


def write_adapters(checkpoint: Checkpoint, out: Path) -> None:
    """The peft adapter folder of a sharded LoRA checkpoint (peft's `save_pretrained` of the consolidated adapters,
    over the base architecture built on the meta device: no base weight is read)."""
    # lazy: peft and transformers load only when adapters are written
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from nemo_rl_ext.training.lora import peft_reads_a_deprecated_alias  # lazy: lora.py imports peft

    weights = _sharded_weights(checkpoint)
    config = _lora_config(checkpoint)
    with torch.device("meta"), peft_reads_a_deprecated_alias():
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(checkpoint.model_dir))
        base.name_or_path = config.base_model_name_or_path  # what peft writes as the base model (not this folder)
        model = get_peft_model(base, config)
    model.save_pretrained(out, state_dict=weights, save_embedding_layers=False)
    _copy(checkpoint, _tokenizer_files(checkpoint), out)


def write_export(checkpoint: Checkpoint, out: Path, *, adapter_only: bool) -> None:
    """Fill `out` with the checkpoint's export (see the module docstring's table); `adapter_only` of a checkpoint
    without adapters is the caller's error to refuse (it exports the full model here)."""
    if not checkpoint.adapters:
        (consolidate_full_model if checkpoint.sharded else copy_full_model)(checkpoint, out)
    elif adapter_only:
        (write_adapters if checkpoint.sharded else copy_adapters)(checkpoint, out)
    else:
        merge_adapters(checkpoint, out)

