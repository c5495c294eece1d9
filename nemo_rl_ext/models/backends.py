"""Generation backends by name: `policy.backend` picks one from this registry, `build_generation` builds it.

    @register_backend("my_engine", loads_model_folder=True)
    def build_my_engine(cfg: PolicyConfig, model, tokenizer, engine_kwargs) -> GenerationInterface: ...

A factory gets the `policy` section, the caller's model and tokenizer (an in-process trainer shares them;
None otherwise) and extra engine arguments (a Ray replica passes its executor settings). A backend that
`loads_model_folder` reads `resolve_model_path(cfg)` itself and is kept in step with the trainer through
`update_weights`; one that does not serves the model object it is handed. `replica_engine_kwargs` gives the
extra engine arguments a backend needs inside a Ray replica (`cluster/`), so a new backend never edits the
cluster code. Built in: "hf" (this package's continuous-batching engine) and "vllm" (needs the `vllm` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation.interfaces import GenerationInterface
from nemo_rl_ext.models.policy import resolve_model_path


class BackendFactory(Protocol):
    """Builds a backend from the `policy` section (see the module docstring)."""

    def __call__(
        self, cfg: PolicyConfig, model: Any, tokenizer: Any, engine_kwargs: Mapping[str, Any] | None
    ) -> GenerationInterface: ...


ReplicaEngineKwargs = Callable[[PolicyConfig], Mapping[str, Any] | None]
"""Extra engine arguments of a backend hosted in a Ray replica actor, given the `policy` section."""


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend."""

    factory: BackendFactory
    """What builds it."""
    loads_model_folder: bool
    """True when it loads the model folder itself (refit with `update_weights`), False when it serves the
    model object it is handed."""
    replica_engine_kwargs: ReplicaEngineKwargs
    """The `engine_kwargs` its factory gets inside a Ray replica, from the `policy` section (None: none)."""


def no_engine_kwargs(cfg: PolicyConfig) -> None:
    """The default `replica_engine_kwargs`: a replica builds the backend as any caller does."""
    return None


_BACKENDS: dict[str, BackendEntry] = {}


def register_backend(
    name: str, *, loads_model_folder: bool, replica_engine_kwargs: ReplicaEngineKwargs = no_engine_kwargs
) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator: make a backend factory available as `policy.backend: name` (see the module docstring)."""

    def decorate(factory: BackendFactory) -> BackendFactory:
        known = _BACKENDS.get(name)
        if known is not None and known.factory is not factory:
            raise ValueError(f"backend {name!r} is already registered to {known.factory!r}")
        _BACKENDS[name] = BackendEntry(factory, loads_model_folder, replica_engine_kwargs)
        return factory

    return decorate


def available_backends() -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_BACKENDS))


def backend_entry(name: str) -> BackendEntry:
    """The registration of `name`; an unknown name lists the known ones (ValueError)."""
    entry = _BACKENDS.get(name)
    if entry is None:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(available_backends())}")
    return entry


def build_generation(
    cfg: PolicyConfig, model: Any = None, tokenizer: Any = None, engine_kwargs: Mapping[str, Any] | None = None
) -> GenerationInterface:
    """The backend `cfg.backend` names; pass `model`/`tokenizer` to share weights with a trainer."""
    return backend_entry(cfg.backend).factory(cfg, model, tokenizer, engine_kwargs)


@register_backend("hf", loads_model_folder=False)
def _build_hf(
    cfg: PolicyConfig, model: Any, tokenizer: Any, engine_kwargs: Mapping[str, Any] | None
) -> GenerationInterface:
    from nemo_rl_ext.models.generation.hf_backend import HfGeneration
    from nemo_rl_ext.models.loading import load_model_and_tokenizer

    if model is None or tokenizer is None:
        model, tokenizer = load_model_and_tokenizer(
            resolve_model_path(cfg), dtype=getattr(torch, cfg.dtype), device=cfg.device
        )
    return HfGeneration(
        model,
        tokenizer,
        max_model_len=cfg.max_model_len,
        max_batch_size=cfg.max_batch_size,
        scheduler=cfg.hf.scheduler,
        max_prefill_tokens=cfg.hf.max_prefill_tokens,
        num_threads=cfg.hf.num_threads,
    )


def _vllm_replica_engine_kwargs(cfg: PolicyConfig) -> Mapping[str, Any] | None:
    """A vLLM engine spanning several GPUs runs its workers as Ray actors in the replica's placement group
    (`cluster.replica.replica_actor_options` packs one GPU bundle per shard). NOT TESTED on GPUs here."""
    return {"distributed_executor_backend": "ray"} if cfg.vllm.tensor_parallel_size > 1 else None


@register_backend("vllm", loads_model_folder=True, replica_engine_kwargs=_vllm_replica_engine_kwargs)
def _build_vllm(
    cfg: PolicyConfig, model: Any, tokenizer: Any, engine_kwargs: Mapping[str, Any] | None
) -> GenerationInterface:
    from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration

    return VllmGeneration(
        resolve_model_path(cfg),
        max_model_len=cfg.max_model_len,
        dtype=cfg.dtype,
        gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
        tensor_parallel_size=cfg.vllm.tensor_parallel_size,
        enforce_eager=cfg.vllm.enforce_eager,
        enable_prefix_caching=cfg.vllm.enable_prefix_caching,
        engine_kwargs=engine_kwargs,
    )
