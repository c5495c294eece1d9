"""What a trainer rank hands over for a refit or a checkpoint: the plain transformers model's tensors, gathered from
their FSDP2 shards a few at a time (the driver asks for one bucket of names per call, so no rank ever holds a second
full copy of the model).

With LoRA the engine needs only what training changes: each target module's weight merged with its adapter
(`W + scale * B @ A`, peft's `get_delta_weight`, computed on the sharded tensors as DTensor operations and then
gathered), never the embeddings, norms or untargeted layers, which stay the base model's. `layout` marks those
tensors, and a refit gathers and sends them alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

ADAPTER = "default"
"""The name of the one adapter peft creates (as `lora.ADAPTER`)."""


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (an all-gather every rank joins), or the tensor itself."""
    from torch.distributed.tensor import DTensor  # lazy: torch.distributed loads only where a rank uses it

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class RefitSource:
    """The plain model's tensors of a rank's (possibly LoRA-wrapped, FSDP2-sharded) policy, by plain name."""

    def __init__(self, model: Any) -> None:
        # local: no cycle; fsdp_workers, this module's user, loads fsdp_wrap anyway; could move up
        from nemo_rl_ext.training.fsdp_wrap import plain_names

        self.model = model
        self.keys = dict(plain_names(model))
        """{plain name: key in `model.state_dict()`}."""
        self.lora = hasattr(model, "get_base_model")
        self.adapted: dict[str, Any] = {}
        """{plain name of a LoRA target module's weight: its peft LoraLayer}."""
        if self.lora:
            from peft.tuners.lora import LoraLayer  # lazy: peft loads only for a LoRA model

            for name, module in model.get_base_model().named_modules():
                if isinstance(module, LoraLayer):
                    self.adapted[f"{name}.weight"] = module

    def layout(self) -> list[tuple[str, int, str | None, bool]]:
        """The plain state dict's entries in order: (name, bytes, the earlier name it is tied to or None, whether
        training changes it: every tensor of a full fine-tune, a LoRA policy's merged target weights alone)."""
        first: dict[int, str] = {}
        alias: dict[str, str] = {}  # tied parameters (an LM head sharing the embedding): two DTensor views of one
        for name, param in self.model.named_parameters(remove_duplicate=False):
            alias[name] = first.setdefault(id(param), name)
        plain_of = {key: name for name, key in self.keys.items()}
        state = self.model.state_dict()
        out = []
        for name, key in self.keys.items():
            tensor = state[key]
            tied = plain_of.get(alias.get(key, key), name)
            changes = name in self.adapted if self.lora else True
            out.append((name, tensor.numel() * tensor.element_size(), None if tied == name else tied, changes))
        return out

    @torch.no_grad()
    def gather(self, names: Sequence[str], keep: bool) -> dict[str, torch.Tensor] | None:
        """The full tensors of `names` (every rank must call it with the same names: each is an all-gather), on
        the CPU where `keep`, else None; a LoRA target's weight comes merged with its adapter."""
        state = self.model.state_dict()
        out = {}
        for name in names:
            module = self.adapted.get(name)
            if module is not None:
                weight = module.get_base_layer().weight
                tensor = weight.detach() + module.get_delta_weight(ADAPTER).to(weight.dtype)
            else:
                tensor = state[self.keys[name]].detach()
            full = _full(tensor)
            if keep:
                out[name] = full.to("cpu", copy=True)
            del full, tensor
        return out if keep else None
