"""Weights & Biases (`logger.wandb`): step metrics, the config and a table of sampled rollouts per step.

Files go to `output_dir/wandb/` (offline mode: only there, `wandb sync` uploads them later). The run id is
given to `wandb.init` with `resume="allow"`, so a resumed GRPO run continues the same W&B run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_rl_ext.grpo.config import WandbSettings
from nemo_rl_ext.grpo.trackers.samples import SAMPLE_COLUMNS


class WandbTracker:
    """One W&B run (a `wandb.Run` of its own, not the global `wandb.run`)."""

    def __init__(self, settings: WandbSettings, output_dir: Path, run_id: str | None) -> None:
        import wandb  # the wandb extra; checked by `missing_extras` before the run starts

        self._wandb = wandb
        self._run = wandb.init(
            project=settings.project, name=settings.name, entity=settings.entity, mode=settings.mode,
            dir=str(output_dir), id=run_id, resume="allow", reinit="create_new",
        )
        self.run_id: str = self._run.id

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        values = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        self._run.log(values, step=step)

    def log_samples(self, step: int, rows: Sequence[Sequence[Any]]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[list(r) for r in rows])
        self._run.log({"rollouts/samples": table}, step=step)

    def close(self) -> None:
        self._run.finish()
