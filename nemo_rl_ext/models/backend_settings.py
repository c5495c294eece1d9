"""The settings sections of the built-in backends: `policy.hf` and `policy.vllm` (registered in
`models.backend_registry`, each validated only as its backend's section)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nemo_rl_ext.config import StrictModel


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
