"""Building the policy named by a `PolicyConfig`: model folder, tokenizer and generation backend."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation.interfaces import GenerationInterface


def resolve_model_path(cfg: PolicyConfig) -> Path:
    """"smollm2" and "tiny" name offline models built on first use; anything else is a folder."""
    if cfg.model_name == "smollm2":
        from nemo_rl_ext.models.smollm2 import smollm2_path

        return smollm2_path()
    if cfg.model_name == "tiny":
        from nemo_rl_ext.models.smollm2 import default_cache_dir
        from nemo_rl_ext.models.tiny import CHAT_TEMPLATE, build_tiny_model

        # keyed by the chat template too, so a changed builder never serves a stale cached folder
        template = hashlib.sha1(CHAT_TEMPLATE.encode()).hexdigest()[:8]
        folder = default_cache_dir() / f"tiny-qwen2-seed{cfg.seed}-{template}"
        if not (folder / "config.json").exists():
            build_tiny_model(folder, seed=cfg.seed)
        return folder
    problem = cfg.model_folder_problem()
    if problem is not None:
        raise ConfigError(problem)
    return Path(cfg.model_name).expanduser()


def build_generation(
    cfg: PolicyConfig, model=None, tokenizer=None, vllm_engine_kwargs: Mapping[str, Any] | None = None
) -> GenerationInterface:
    """The generation backend for `cfg`; pass `model`/`tokenizer` to share weights with a trainer.

    The vllm backend always loads the model folder itself (its engine runs in other processes); a trainer
    keeps it in step with `update_weights(model.state_dict())`. `vllm_engine_kwargs`: extra engine
    arguments of the vllm backend (a Ray replica sets its executor backend this way).
    """
    if cfg.backend == "vllm":
        from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration

        return VllmGeneration(
            resolve_model_path(cfg),
            max_model_len=cfg.max_model_len,
            dtype=cfg.dtype,
            gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
            tensor_parallel_size=cfg.vllm.tensor_parallel_size,
            enforce_eager=cfg.vllm.enforce_eager,
            enable_prefix_caching=cfg.vllm.enable_prefix_caching,
            engine_kwargs=vllm_engine_kwargs,
        )
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
