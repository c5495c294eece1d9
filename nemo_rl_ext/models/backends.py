"""Generation backends by name: `policy.backend` picks one from the registry, `build_generation` builds it.

    @register_backend("my_engine", loads_model_folder=True, settings=MyEngineSettings)
    def build_my_engine(cfg: PolicyConfig, model, tokenizer, engine_kwargs) -> GenerationInterface: ...

A factory gets the `policy` section, the caller's model and tokenizer (an in-process trainer shares them;
None otherwise) and extra engine arguments (a Ray replica passes its executor settings). A backend that
`loads_model_folder` reads `resolve_model_path(cfg)` itself and is kept in step with the trainer through
`update_weights`; one that does not serves the model object it is handed. `replica_engine_kwargs` gives the
extra engine arguments a backend needs inside a Ray replica (`cluster/`), so a new backend never edits the
cluster code. A backend's own settings are a pydantic model it registers: the section `policy.<name>` is then
validated by it (`cfg.my_engine.<key>`), defaults where the config leaves it out. Built in: "hf" (this
package's continuous-batching engine, `policy.hf`) and "vllm" (needs the `vllm` extra, `policy.vllm`); their
names and settings are registered in `models.backend_registry`, which the config validation reads without
importing this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from pydantic import BaseModel

from nemo_rl_ext.models.backend_registry import (
    _BACKENDS,
    BackendEntry,
    add_backend,
    available_backends,
    backend_entry,
    no_engine_kwargs,
)
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation.interfaces import GenerationInterface
from nemo_rl_ext.models.policy import resolve_model_path

__all__ = [
    "_BACKENDS", "BackendEntry", "BackendFactory", "ReplicaEngineKwargs", "available_backends", "backend_entry",
    "build_generation", "build_hf", "build_vllm", "no_engine_kwargs", "register_backend",
]


class BackendFactory(Protocol):
    """Builds a backend from the `policy` section (see the module docstring)."""

    def __call__(
        self, cfg: PolicyConfig, model: Any, tokenizer: Any, engine_kwargs: Mapping[str, Any] | None
    ) -> GenerationInterface: ...


ReplicaEngineKwargs = Callable[[PolicyConfig], Mapping[str, Any] | None]
"""Extra engine arguments of a backend hosted in a Ray replica actor, given the `policy` section."""


def register_backend(
    name: str,
    *,
    loads_model_folder: bool,
    replica_engine_kwargs: ReplicaEngineKwargs = no_engine_kwargs,
    settings: type[BaseModel] | None = None,
) -> Callable[[BackendFactory], BackendFactory]:
    """Decorator: make a backend factory available as `policy.backend: name`, its `settings` model (if any)
    owning the section `policy.<name>` (see the module docstring)."""
    if settings is not None and name in PolicyConfig.model_fields:
        raise ValueError(f"backend {name!r} can't own policy.{name}: that key is a policy setting")

    def decorate(factory: BackendFactory) -> BackendFactory:
        add_backend(name, BackendEntry(factory, loads_model_folder, replica_engine_kwargs, settings))
        return factory

    return decorate


def build_generation(
    cfg: PolicyConfig, model: Any = None, tokenizer: Any = None, engine_kwargs: Mapping[str, Any] | None = None
) -> GenerationInterface:
    """The backend `cfg.backend` names; pass `model`/`tokenizer` to share weights with a trainer."""
    return backend_entry(cfg.backend).factory(cfg, model, tokenizer, engine_kwargs)


def build_hf(
    cfg: PolicyConfig, model: Any, tokenizer: Any, engine_kwargs: Mapping[str, Any] | None
) -> GenerationInterface:
    """The hf backend (registered as "hf" in `models.backend_registry`)."""
    # lazy: a backend loads torch and transformers only when it is built
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


def vllm_replica_engine_kwargs(cfg: PolicyConfig) -> Mapping[str, Any] | None:
    """A vLLM engine spanning several GPUs runs its workers as Ray actors in the replica's placement group
    (`cluster.replica.replica_actor_options` packs one GPU bundle per shard). NOT TESTED on GPUs here."""
    return {"distributed_executor_backend": "ray"} if cfg.vllm.tensor_parallel_size > 1 else None


def build_vllm(
    cfg: PolicyConfig, model: Any, tokenizer: Any, engine_kwargs: Mapping[str, Any] | None
) -> GenerationInterface:
    """The vLLM backend (registered as "vllm" in `models.backend_registry`)."""
    # optional dependency: vllm loads only for policy.backend=vllm
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
