"""The backend registry: the names `policy.backend` selects, the settings model that owns each `policy.<name>`
section, and what builds each backend (the built-ins' factories are named as "module:function" and imported
on first use).

It sits below `models.config` and imports no backend: validating a config reads this registry only, and
`models.backends` (which builds engines, and whose `register_backend` is the public way to add one) sits above
the config. Built in: "hf" (settings `policy.hf`) and "vllm" (settings `policy.vllm`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from nemo_rl_ext.models.backend_settings import HfConfig, VllmConfig


@dataclass(frozen=True)
class LazyCallable:
    """A function named by "package.module:function", imported when first called."""

    target: str
    """Where the function is: "package.module:function"."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


def no_engine_kwargs(cfg: Any) -> None:
    """The default `replica_engine_kwargs`: a replica builds the backend as any caller does."""
    return None


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend."""

    factory: Callable[..., Any]
    """What builds it: `(cfg: PolicyConfig, model, tokenizer, engine_kwargs) -> GenerationInterface`."""
    loads_model_folder: bool
    """True when it loads the model folder itself (refit with `update_weights`), False when it serves the
    model object it is handed."""
    replica_engine_kwargs: Callable[[Any], Mapping[str, Any] | None] = no_engine_kwargs
    """The `engine_kwargs` its factory gets inside a Ray replica, from the `policy` section (None: none)."""
    settings: type[BaseModel] | None = None
    """The model of its own section, `policy.<name>` (every registered section is validated, defaults where
    absent); None: the backend has no settings of its own."""


_BACKENDS: dict[str, BackendEntry] = {}


def add_backend(name: str, entry: BackendEntry) -> None:
    """Register `entry` as `name`; a name already registered to another factory is a ValueError."""
    known = _BACKENDS.get(name)
    if known is not None and known.factory is not entry.factory:
        raise ValueError(f"backend {name!r} is already registered to {known.factory!r}")
    _BACKENDS[name] = entry


def available_backends() -> tuple[str, ...]:
    """The registered names, sorted."""
    return tuple(sorted(_BACKENDS))


def backend_entry(name: str) -> BackendEntry:
    """The registration of `name`; an unknown name lists the known ones (ValueError)."""
    entry = _BACKENDS.get(name)
    if entry is None:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(available_backends())}")
    return entry


def backend_settings_models() -> dict[str, type[BaseModel]]:
    """Each backend's settings model by backend name (the `policy.<name>` sections), in registration order."""
    return {name: entry.settings for name, entry in _BACKENDS.items() if entry.settings is not None}


add_backend("hf", BackendEntry(LazyCallable("nemo_rl_ext.models.backends:build_hf"), False, settings=HfConfig))
add_backend(
    "vllm",
    BackendEntry(
        LazyCallable("nemo_rl_ext.models.backends:build_vllm"),
        True,
        LazyCallable("nemo_rl_ext.models.backends:vllm_replica_engine_kwargs"),
        settings=VllmConfig,
    ),
)
