"""The model folder a `PolicyConfig` names: a built-in offline model built on first use, or a folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.models.adapters import adapter_base, is_adapter_folder, merged_adapter_folder
from nemo_rl_ext.models.config import PolicyConfig


def resolve_model_path(cfg: PolicyConfig) -> Path:
    """"smollm2" and "tiny" name offline models built on first use; anything else is a folder: a model folder as it
    is, a peft LoRA adapter folder as its base model with the adapters merged in (`models.adapters`, cached)."""
    if cfg.model_name == "smollm2":
        # local: smollm2 is light; only for model_name=smollm2 (could move up)
        from nemo_rl_ext.models.smollm2 import smollm2_path

        return smollm2_path()
    if cfg.model_name == "tiny":
        # lazy: tiny.py loads torch and transformers only for model_name=tiny (smollm2 is light)
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
    folder = Path(cfg.model_name).expanduser()
    if is_adapter_folder(folder):  # a LoRA adapter folder: its base model with the adapters merged in
        from nemo_rl_ext.models.smollm2 import default_cache_dir

        base = resolve_model_path(cfg.model_copy(update={"model_name": adapter_base(folder)}))
        return merged_adapter_folder(folder, base, default_cache_dir())
    return folder
