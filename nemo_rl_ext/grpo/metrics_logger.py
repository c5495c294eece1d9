"""Step metrics to `metrics.jsonl` (one JSON object per step), TensorBoard (if installed) and the trackers
of `logger.*_enabled` (`grpo.trackers`: W&B, MLflow)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from nemo_rl_ext.grpo.config import LoggerSettings
from nemo_rl_ext.grpo.trackers import GuardedTracker, open_trackers

logger = logging.getLogger(__name__)


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The records of a metrics JSONL file, in order (non-finite values were written as null)."""
    path = Path(path)
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


class MetricsLogger:
    """Appends `{"step": s, **metrics}` lines to `<output_dir>/metrics.jsonl`; mirrors them to TensorBoard.

    TensorBoard is used only when `tensorboard=True` and `torch.utils.tensorboard` imports (the
    `tensorboard` package is optional); events go to `<output_dir>/tensorboard/`.
    """

    def __init__(self, output_dir: str | Path, *, tensorboard: bool = True) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / "metrics.jsonl"
        self._writer = None
        self.trackers: list[GuardedTracker] = []
        """The W&B / MLflow runs of `start_trackers` (a failed one is left out after one warning)."""
        if tensorboard:
            try:
                # optional dependency (tensorboard), loaded only when asked for
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.info("tensorboard is not installed: metrics go to %s only", self.path)
            else:
                self._writer = SummaryWriter(str(self.output_dir / "tensorboard"))

    @property
    def tensorboard_enabled(self) -> bool:
        """True when events are also written to TensorBoard."""
        return self._writer is not None

    def start_trackers(self, settings: LoggerSettings, config: Mapping[str, Any], *, resumed: bool) -> None:
        """Start the trackers `settings` enables (`grpo.trackers.open_trackers`)."""
        self.trackers = open_trackers(settings, self.output_dir, config, resumed=resumed)

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run re-logs the steps after its checkpoint)."""
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in kept))
        tmp.replace(self.path)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Append one record (values are floats; NaN/inf are stored as null)."""
        record = {"step": step, **{k: _finite_or_none(v) for k, v in metrics.items()}}
        with self.path.open("ab") as f:
            f.write(orjson.dumps(record) + b"\n")
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        for tracker in self.trackers:
            tracker.call("log_metrics", step, metrics)

    def log_samples(self, step: int, rows: Sequence[Sequence[Any]]) -> None:
        """A table of sampled rollouts (`trackers.SAMPLE_COLUMNS`) for the trackers; nothing when empty."""
        if rows:
            for tracker in self.trackers:
                tracker.call("log_samples", step, rows)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.call("close")


def _finite_or_none(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None
