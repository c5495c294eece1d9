"""LoRA adapters on the policy (peft): the target-module check before any model loads, wrapping (or resuming)
the policy, and the merged weights a refit hands to the generation engine.

With `trainer.lora`, only the adapters train (the optimizer holds them alone), the KL reference is the same
model with its adapters disabled (`PeftModel.disable_adapter()`: no reference copy), a checkpoint holds the
adapters (`adapter_model.safetensors`, `adapter_config.json` naming the base model) and their optimizer
state, and the engine, which serves plain transformers weights, gets `W + scale * B @ A` for each target
module, computed one module at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from nemo_rl_ext.models.adapters import peft_reads_a_deprecated_alias
from nemo_rl_ext.training.config import LoraSettings
from nemo_rl_ext.training.streamed_weights import StreamedWeights

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

# peft is imported where a LoRA model is made or read (with_lora, _lora_layer), not with this module: a run
# without LoRA (and the GRPO CLI's start-up) does without peft's import

ADAPTER = "default"
"""The name of the one adapter peft creates."""


def _meta_model(model_path: str | Path) -> PreTrainedModel:
    """The model folder's architecture built on the meta device from its config.json: no weight is
    allocated or read."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _leaf_names(model: torch.nn.Module, kinds: tuple[type, ...]) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and isinstance(m, kinds)})


def adaptable_modules(model_path: str | Path) -> list[str]:
    """The module names (last part of the dotted name) of the model folder's Linear and Embedding layers."""
    return _leaf_names(_meta_model(model_path), (torch.nn.Linear, torch.nn.Embedding))


def lora_target_problem(settings: LoraSettings, model_path: str | Path) -> str | None:
    """Why `trainer.lora.target_modules` does not fit the model, or None: modules it lacks (named, with those
    it has), or an adapter on an embedding tied to the LM head (the engine holds one tensor for both, so it
    could not serve the merged weights)."""
    model = _meta_model(model_path)
    available = _leaf_names(model, (torch.nn.Linear, torch.nn.Embedding))
    missing = [name for name in settings.target_modules if name not in available]
    if missing:
        return (
            f"trainer.lora.target_modules: the model at {model_path} has no module named {', '.join(missing)} "
            f"(its Linear and Embedding modules: {', '.join(available)})"
        )
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        tied = [m for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None]
        names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if any(m is t for t in tied)}
        clash = sorted(set(settings.target_modules) & set(names))
        if clash:
            return (
                f"trainer.lora.target_modules: {', '.join(clash)}: the model at {model_path} ties its word "
                f"embeddings ({' and '.join(sorted(names))} are one weight in the engine), so an adapter there "
                "could not be served; leave it out"
            )
    return None


def with_lora(model: PreTrainedModel, settings: LoraSettings, adapter_dir: str | Path | None = None) -> PeftModel:
    """`model` with trainable LoRA adapters on the target modules: new ones (B = 0, so the policy starts as the
    base model), or those saved in `adapter_dir` (a checkpoint's policy folder). Every base weight is frozen."""
    from peft import PeftModel, get_peft_model  # lazy: peft loads only for a LoRA model

    with peft_reads_a_deprecated_alias():
        if adapter_dir is not None:
            return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)
        return get_peft_model(model, _lora_config(settings))


def _lora_config(settings: LoraSettings) -> LoraConfig:
    from peft import LoraConfig  # lazy: peft loads only for a LoRA model

    return LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _lora_layer() -> type:
    """peft's LoRA layer class (a LoRA model exists, so peft is imported already: the import is a lookup)."""
    from peft.tuners.lora import LoraLayer  # lazy: peft loads only for a LoRA model

    return LoraLayer


@torch.no_grad()
def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's weights under their transformers names, each target module's weight merged with its
    adapter (`W + scale * B @ A`, peft's `get_delta_weight`, one module at a time); every other tensor is the
    trainer's own (detached, not copied)."""
    base = model.get_base_model()
    out = {
        key.replace(".base_layer.", "."): value.detach()
        for key, value in base.state_dict().items()
        if ".lora_" not in key
    }
    lora_layer = _lora_layer()
    for name, module in base.named_modules():
        if isinstance(module, lora_layer):
            weight = module.get_base_layer().weight
            out[f"{name}.weight"] = weight.detach() + module.get_delta_weight(ADAPTER).to(weight.dtype)
    return out


def streamed_merged_weights(model: PeftModel) -> StreamedWeights:
    """Each target module's merged weight alone, under its transformers name, made one module at a time as the
    engine reads it (`StreamedWeights`): never a copy of every target at once."""
    lora_layer = _lora_layer()
    modules = {f"{name}.weight": module for name, module in model.get_base_model().named_modules()
               if isinstance(module, lora_layer)}

    @torch.no_grad()
    def merge(names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            weight = modules[name].get_base_layer().weight
            out[name] = weight.detach() + modules[name].get_delta_weight(ADAPTER).to(weight.dtype)
        return out

    nbytes = sum(m.get_base_layer().weight.numel() * m.get_base_layer().weight.element_size()
                 for m in modules.values())
    return StreamedWeights([[name] for name in modules], merge, nbytes)


def lora_modules(model: PeftModel) -> list[str]:
    """The dotted names of the modules that carry an adapter."""
    lora_layer = _lora_layer()
    return [name for name, module in model.get_base_model().named_modules() if isinstance(module, lora_layer)]
