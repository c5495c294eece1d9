"""The rows of a GRPO run's `data` section: the training set, and the validation set (`data.val_path`, else
`data.split_validation_size` rows held out of the training set by a seeded draw, else the training set)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.sources import split_validation
from nemo_rl_ext.experience.build import load_rollout_rows
from nemo_rl_ext.grpo.config import GRPOConfig

Rows = Sequence[Mapping[str, Any]]


def run_rows(cfg: GRPOConfig, *, train: bool, validates: bool) -> tuple[Rows, Rows]:
    """(training rows, validation rows) of `cfg` (module docstring); what is not asked for (`train`,
    `validates`) is empty, but a held-out validation split is always taken out of the training rows."""
    data = cfg.data
    keys = dict(question_key=data.question_key, answer_key=data.answer_key, subset=data.subset)
    held_out = data.val_path is None and data.split_validation_size > 0
    rows: Rows = ()
    if train or (validates and data.val_path is None):
        rows = load_rollout_rows(cfg.rollouts, data.train_path, split=data.split, **keys)
    val: Rows = ()
    if held_out:
        try:
            rows, val = split_validation(rows, data.split_validation_size, cfg.grpo.seed)
        except ValueError as exc:
            raise ConfigError(f"data.split_validation_size: {exc}") from None
    elif validates:
        val = load_rollout_rows(cfg.rollouts, data.val_path, split=data.val_split, **keys) \
            if data.val_path is not None else rows
    return (rows if train else ()), (val[: cfg.validation.num_prompts] if validates else ())
