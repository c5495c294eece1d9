"""Loading a causal LM folder (tiny, SmolLM2 or any transformers folder) and its tokenizer, and whether this
process has the device to load it on."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, padding on the left (batched prompts end where generation starts): the one
    every backend, replica pool and trainer serves."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return tokenizer


def load_model_and_tokenizer(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM folder (tiny or SmolLM2) in eval mode, with its `load_tokenizer` tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, load_tokenizer(path)


def cache_kwarg(module: torch.nn.Module) -> str:
    """The keyword `module.forward` takes its KV cache under: `cache` from transformers 5.24 on (which deprecates
    `past_key_values` and drops it in 5.40), else `past_key_values`. A peft wrapper (a LoRA policy) takes
    `**kwargs` and hands them to the model it wraps: that model's keyword is the one."""
    base = module.get_base_model() if callable(getattr(module, "get_base_model", None)) else module
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Every decoder layer recomputes its activations in the backward (transformers' non-reentrant
    `torch.utils.checkpoint`); a LoRA policy's base model carries the layers. The method is
    `activation_checkpointing_enable` in newer transformers 5.x (which keeps `gradient_checkpointing_enable` as a
    deprecated alias until v6) and only `gradient_checkpointing_enable` in older 5.x (5.17, on the lent GPU image):
    the newer name where it exists, else the older."""
    plain = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    enable = getattr(plain, "activation_checkpointing_enable", None) or plain.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def device_problem(key: str, device: str) -> str | None:
    """Why torch in this process cannot put a model on `device` (the value of the config key `key`): not a torch
    device, an accelerator this torch was not built with or sees none of, an index past its last; None for the CPU
    (and `meta`) or a device it has."""
    try:
        where = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        return f"{key}={device!r} is not a torch device: {str(exc).strip()}"
    if where.type in ("cpu", "meta"):
        return None
    backend = getattr(torch, where.type, None)  # torch.cuda, torch.xpu, torch.mps, ...
    if backend is None or not callable(getattr(backend, "is_available", None)) or not backend.is_available():
        return (f"{key}={device!r} but torch {torch.__version__} in this process sees no {where.type} device "
                f"(a torch built without it, or none visible): use {key}=cpu, or run where one is")
    count = backend.device_count() if callable(getattr(backend, "device_count", None)) else 1
    if where.index is not None and where.index >= count:
        return f"{key}={device!r} but torch sees {count} {where.type} device(s) here (indices 0 to {count - 1})"
    return None
