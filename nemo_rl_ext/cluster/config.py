"""The `cluster` config section: where Ray runs, how many generation replicas, what each one reserves.

Kept free of `ray` imports (and of nemo_rl_ext.config, which may embed it) so a config can be validated on a machine (or in a process) without Ray.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

_HOST_PORT = re.compile(r"^[A-Za-z0-9_.\-]+:\d{1,5}$")


class StrictModel(BaseModel):
    """Unknown keys are errors; frozen (as nemo_rl_ext.config's sections, which may embed this one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


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
