"""How a trainer rank wraps its model before training: LoRA adapters (peft), activation checkpointing on the
decoder layers, then FSDP2 (`fully_shard` per decoder layer, then the root module) with the mixed-precision and
CPU-offload policies of the `trainer:` section; or, with `sharding: none`, replicated ranks (FSDP2's hybrid
sharding over a (workers, 1) mesh: every rank holds every parameter, gradients are all-reduced, DDP-like).

The order is torchtitan's and verl's: adapters first (so each decoder layer's FSDP unit holds its adapters next
to the frozen base weights), activation checkpointing next, sharding last.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl_ext.objectives.logprobs import token_logprobs


@dataclass(frozen=True)
class WrapSettings:
    """The `trainer:` settings that decide how a rank's model is wrapped."""

    mixed_precision: str | None = None
    """None: compute in the weights' dtype; "bf16": FSDP2 casts the gathered weights to bfloat16 for compute,
    reduces gradients in float32 and keeps float32 master weights and optimizer state."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass."""
    cpu_offload: bool = False
    """FSDP2's CPUOffloadPolicy: parameter shards, their gradients and the optimizer state live in CPU memory
    (GPU ranks only; the config refuses it on the CPU)."""
    replicate: bool = False
    """`sharding: none`: every rank holds every parameter (gradients all-reduced) instead of a shard."""


class LogprobPass(torch.nn.Module):
    """The FSDP root module: one forward = the scored-token logprobs of a micro-batch; it always runs the
    decoder once and the LM head (every rank runs the same collectives, whatever its micro-batch holds)."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature

    def forward(self, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor, entropy: str | None = None,
                topk_ids: torch.Tensor | None = None) -> Any:
        """[B, T] logprobs, or with `entropy` ("detached" or "grad") the pair (logprobs, entropies); with `topk_ids`
        ([B, T, k]) the triple (logprobs, entropies or None, [B, T, k] logprobs of those ids)."""
        if ids.shape[1] >= 2 and bool((mask[:, 1:] != 0).any()):
            return token_logprobs(self.model, ids, attention, self.temperature, score_mask=mask, entropy=entropy,
                                  topk_ids=topk_ids)
        states = self.model.get_decoder()(input_ids=ids, attention_mask=attention, use_cache=False)
        head = self.model.get_output_embeddings()(states.last_hidden_state[:, :1])
        zeros = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device) + 0.0 * head.float().sum()
        if topk_ids is not None:
            return zeros, (zeros if entropy else None), torch.zeros(topk_ids.shape, device=ids.device)
        return (zeros, zeros) if entropy else zeros


def _fsdp_kwargs(settings: WrapSettings, device: torch.device, world_size: int) -> dict[str, Any]:
    # lazy: torch.distributed.fsdp loads only when a model is sharded
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs: dict[str, Any] = {}
    if settings.mixed_precision == "bf16":
        # bf16 weights for the forward and backward, float32 gradient reduction; the sharded parameters (the
        # master weights the optimizer steps) stay in their float32 dtype
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif settings.mixed_precision is not None:
        raise ValueError(f"mixed_precision must be None or 'bf16', not {settings.mixed_precision!r}")
    if settings.cpu_offload:
        if device.type == "cpu":
            raise ValueError("cpu_offload needs GPU ranks: on the CPU there is nothing to offload")
        kwargs["offload_policy"] = CPUOffloadPolicy()
    # lazy: torch.distributed loads only when a model is sharded
    from torch.distributed.device_mesh import init_device_mesh

    # Always the rank's own device type: fully_shard's default mesh takes the machine's accelerator, which puts a
    # CPU rank's shards on the GPU of a machine that has one (seen on a lent H100: cuda and cpu tensors in the loss)
    if settings.replicate:
        kwargs["mesh"] = init_device_mesh(device.type, (world_size, 1), mesh_dim_names=("replicate", "shard"))
    else:
        kwargs["mesh"] = init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    return kwargs


def shard_model(model: torch.nn.Module, temperature: float, settings: WrapSettings | None = None,
                device: torch.device | None = None, world_size: int = 1) -> LogprobPass:
    """FSDP2: `fully_shard` on each decoder layer, then on the root (the logprob pass around the model);
    gradients summed over ranks (each rank's loss is already divided by the global count)."""
    # lazy: torch.distributed.fsdp loads only when a model is sharded
    from torch.distributed.fsdp import fully_shard

    kwargs = _fsdp_kwargs(settings or WrapSettings(), device or torch.device("cpu"), world_size)
    units = [fully_shard(layer, **kwargs) for layer in _decoder_layers(model)]
    root = fully_shard(LogprobPass(model, temperature), **kwargs)
    for unit in [*units, root]:  # per module: a root's setting does not reach its children
        unit.set_gradient_divide_factor(1.0)
        if hasattr(unit, "set_force_sum_reduction_for_comms"):  # torch >= 2.8
            unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return root


def _decoder_layers(model: torch.nn.Module) -> Any:
    """The decoder layers FSDP2 shards one by one; ValueError for a model without them."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder `layers` to shard")
    return layers


def shard_frozen(model: torch.nn.Module, settings: WrapSettings, device: torch.device, world_size: int
                 ) -> torch.nn.Module:
    """A model that is never trained (a distillation teacher), frozen and sharded as the reference model is
    (`fully_shard` per decoder layer, then the root, with the run's mixed precision, offload and replication;
    no activation checkpointing): the model itself, whose forward returns its logits."""
    # lazy: torch.distributed.fsdp loads only when a model is sharded
    from torch.distributed.fsdp import fully_shard

    model = model.eval().requires_grad_(False)
    kwargs = _fsdp_kwargs(settings, device, world_size)
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """A LoRA policy computes as its base model inside (the KL reference). Not peft's `disable_adapter()`: that
    also sets the adapters' `requires_grad` to False and back, and under FSDP2 it reaches whichever tensors the
    module holds at that moment (the root unit's stay unsharded after a forward), so the LM head's adapters
    silently stopped training. This flips peft's per-layer switch alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # lazy: peft loads only for a LoRA model

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, value in zip(layers, before, strict=True):
            m._disable_adapters = value


def shard_group(param: torch.Tensor) -> Any:
    """The process group over which `param`'s shards add up to the whole parameter (None: the default group,
    every rank); the `shard` mesh dimension of replicated ranks (`sharding: none`), whose size is 1."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is not None and mesh.ndim == 2:
        return mesh.get_group("shard")
    return None


def plain_names(model: Any) -> Mapping[str, str]:
    """{state-dict key of the plain transformers model: key in `model.state_dict()`} (a LoRA policy's keys carry
    peft's prefix and `.base_layer.`; its adapter tensors have no plain name and are left out)."""
    if not hasattr(model, "get_base_model"):
        return {key: key for key in model.state_dict()}
    prefix = "base_model.model."
    return {key[len(prefix):].replace(".base_layer.", "."): key
            for key in model.state_dict() if ".lora_" not in key}
