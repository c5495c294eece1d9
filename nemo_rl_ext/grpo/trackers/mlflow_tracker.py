"""MLflow (`logger.mlflow`): step metrics, the config (artifact `config.json`) and the sampled rollouts of each
step (artifact `rollouts/step_<n>.json`, `{"columns": [...], "data": [[...], ...]}`).

Through `MlflowClient` (no global active run). Without `tracking_uri` the store is `output_dir/mlflow.db`
(sqlite) with artifacts in `output_dir/mlartifacts`. A resumed GRPO run logs to the run whose id is in
`trackers.json`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_rl_ext.grpo.config import MlflowSettings
from nemo_rl_ext.grpo.trackers.samples import SAMPLE_COLUMNS

MAX_BATCH = 1000
"""Most metrics MLflow takes in one log_batch call."""


class MlflowTracker:
    """One MLflow run, created (with its experiment, if absent) or continued by id."""

    def __init__(self, settings: MlflowSettings, output_dir: Path, run_id: str | None) -> None:
        from mlflow.tracking import MlflowClient  # the mlflow extra; checked by `missing_extras`

        uri, artifacts = settings.tracking_uri, None
        if uri is None:
            uri = f"sqlite:///{(output_dir / 'mlflow.db').resolve()}"
            artifacts = (output_dir / "mlartifacts").resolve().as_uri()  # else ./mlartifacts of the cwd
        self._client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiment = self._client.get_experiment_by_name(settings.experiment_name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self._client.create_experiment(settings.experiment_name, artifacts))
            run_id = self._client.create_run(experiment_id, run_name=settings.run_name).info.run_id
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._client.log_dict(self.run_id, dict(config), "config.json")

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric  # the mlflow extra (optional dependency)

        now = int(time.time() * 1000)
        values = [Metric(k, float(v), now, step) for k, v in metrics.items()
                  if isinstance(v, int | float) and math.isfinite(v)]
        for start in range(0, len(values), MAX_BATCH):
            self._client.log_batch(self.run_id, metrics=values[start:start + MAX_BATCH])

    def log_samples(self, step: int, rows: Sequence[Sequence[Any]]) -> None:
        table = {"columns": list(SAMPLE_COLUMNS), "data": [list(r) for r in rows]}
        self._client.log_dict(self.run_id, table, f"rollouts/step_{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
