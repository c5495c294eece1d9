"""Experiment trackers beside `metrics.jsonl`: W&B (`wandb_tracker`) and MLflow (`mlflow_tracker`).

`open_trackers` starts the ones `logger.*_enabled` asks for. Each is wrapped in `GuardedTracker`: a tracker
that fails (no network, a bad URI, a full disk) is one warning and is then left out; training never dies for
logging. The tracker run ids are kept in `output_dir/trackers.json`, so that a resumed run continues the same
W&B and MLflow runs. A missing package is found before any model loads (`missing_extras`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from nemo_rl_ext.grpo.config import LoggerSettings
from nemo_rl_ext.grpo.trackers.samples import SAMPLE_COLUMNS, sample_rows

__all__ = ["SAMPLE_COLUMNS", "GuardedTracker", "missing_extras", "open_trackers", "sample_rows"]

logger = logging.getLogger(__name__)

RUN_IDS_FILE = "trackers.json"
"""In output_dir: {"wandb": run id, "mlflow": run id} of the trackers this run logs to."""

EXTRAS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""tracker -> (module it needs, the project's extra that installs it)."""


class Tracker(Protocol):
    """What a tracker does; `run_id` is saved in `RUN_IDS_FILE` to continue the run on resume."""

    run_id: str

    def log_config(self, config: Mapping[str, Any]) -> None: ...
    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def log_samples(self, step: int, rows: Sequence[Sequence[Any]]) -> None: ...
    def close(self) -> None: ...


def missing_extras(settings: LoggerSettings) -> list[str]:
    """One config problem per enabled tracker whose package is not installed, naming the extra to install."""
    return [
        f"logger.{name}_enabled is true but the {module} package is not installed: pip install -e '.[{extra}]'"
        for name, (module, extra) in EXTRAS.items()
        if getattr(settings, f"{name}_enabled") and importlib.util.find_spec(module) is None
    ]


class GuardedTracker:
    """Calls a tracker; its first failure is one warning, after which it is left out for the rest of the run."""

    def __init__(self, name: str, tracker: Tracker | None) -> None:
        self.name = name
        self.tracker = tracker

    @property
    def alive(self) -> bool:
        return self.tracker is not None

    def call(self, method: str, *args: Any) -> None:
        if self.tracker is None:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as e:  # noqa: BLE001 - any tracker failure: warn once, train on
            self.fail(e)

    def fail(self, error: BaseException) -> None:
        logger.warning("logger.%s failed (%s: %s); the run goes on without %s (metrics.jsonl has every step)",
                       self.name, type(error).__name__, error, self.name)
        tracker, self.tracker = self.tracker, None
        if tracker is not None:
            try:
                tracker.close()
            except Exception:  # noqa: BLE001 - already warned about this tracker
                pass


def _openers(settings: LoggerSettings) -> dict[str, Callable[[Path, str | None], Tracker]]:
    openers: dict[str, Callable[[Path, str | None], Tracker]] = {}
    if settings.wandb_enabled:
        # optional dependency: the module imports wandb, loaded only when the tracker is enabled
        from nemo_rl_ext.grpo.trackers.wandb_tracker import WandbTracker

        openers["wandb"] = lambda out, run_id: WandbTracker(settings.wandb, out, run_id)
    if settings.mlflow_enabled:
        # optional dependency: the module imports mlflow, loaded only when the tracker is enabled
        from nemo_rl_ext.grpo.trackers.mlflow_tracker import MlflowTracker

        openers["mlflow"] = lambda out, run_id: MlflowTracker(settings.mlflow, out, run_id)
    return openers


def open_trackers(settings: LoggerSettings, output_dir: Path, config: Mapping[str, Any],
                  *, resumed: bool) -> list[GuardedTracker]:
    """Start the enabled trackers; a resumed run continues the runs named in `RUN_IDS_FILE`, a fresh one starts
    new runs and logs `config` to them. A tracker that cannot start is one warning and is left out."""
    ids_path = output_dir / RUN_IDS_FILE
    ids = json.loads(ids_path.read_text()) if resumed and ids_path.exists() else {}
    trackers = []
    for name, opener in _openers(settings).items():
        guarded = GuardedTracker(name, None)
        try:
            guarded.tracker = opener(output_dir, ids.get(name))
        except Exception as e:  # noqa: BLE001 - a tracker that cannot start: warn once, train on
            guarded.fail(e)
            continue
        if ids.get(name) is None:
            guarded.call("log_config", config)
        if guarded.tracker is not None:
            ids[name] = guarded.tracker.run_id
        trackers.append(guarded)
    if trackers:
        ids_path.write_text(json.dumps(ids, indent=1) + "\n")
    return trackers
