"""The tracker plumbing without a model: a missing package is one config problem naming the extra, a failing
tracker is one warning and is then left out, the run ids file, and `logger.tensorboard` as an older spelling."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_rl_ext.config import load_config
from nemo_rl_ext.grpo import trackers
from nemo_rl_ext.grpo.config import GRPOConfig, LoggerSettings
from nemo_rl_ext.grpo.metrics_logger import MetricsLogger


def test_a_missing_tracker_package_is_one_problem_naming_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))
    problems = trackers.missing_extras(LoggerSettings(wandb_enabled=True, mlflow_enabled=True))
    assert problems == [
        "logger.wandb_enabled is true but the wandb package is not installed: pip install -e '.[wandb]'",
        "logger.mlflow_enabled is true but the mlflow package is not installed: pip install -e '.[mlflow]'",
    ]
    assert trackers.missing_extras(LoggerSettings()) == []  # not enabled: not needed


class Flaky:
    """A tracker whose metrics call fails on its second step (like a server going away)."""

    def __init__(self) -> None:
        self.run_id, self.steps, self.closed = "run-1", [], False

    def log_config(self, config: Any) -> None:
        pass

    def log_metrics(self, step: int, metrics: Any) -> None:
        if step == 2:
            raise ConnectionError("server went away")
        self.steps.append(step)

    def log_samples(self, step: int, rows: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_a_failing_tracker_warns_once_and_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flaky = Flaky()
    metrics = MetricsLogger(tmp_path, tensorboard=False)
    metrics.trackers = [trackers.GuardedTracker("mlflow", flaky)]
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3, 4):
            metrics.log(step, {"train/loss": 0.5})
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "logger.mlflow failed (ConnectionError: server went away)" in warnings[0]
    assert flaky.steps == [1] and flaky.closed
    assert [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3, 4]


def test_a_tracker_that_cannot_start_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    def refuse(out: Path, run_id: str | None) -> Any:
        raise OSError("bad uri")

    monkeypatch.setattr(trackers, "_openers", lambda settings: {"mlflow": refuse})
    with caplog.at_level(logging.WARNING):
        opened = trackers.open_trackers(LoggerSettings(mlflow_enabled=True), tmp_path, {}, resumed=False)
    assert [t.alive for t in opened] == [] and len(caplog.records) == 1
    assert not (tmp_path / trackers.RUN_IDS_FILE).exists()


def test_run_ids_are_kept_for_a_resume_and_not_for_a_fresh_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    def opener(out: Path, run_id: str | None) -> Flaky:
        seen.append(run_id)
        tracker = Flaky()
        tracker.run_id = run_id or f"new-{len(seen)}"
        return tracker

    monkeypatch.setattr(trackers, "_openers", lambda settings: {"wandb": opener})
    settings = LoggerSettings(wandb_enabled=True)
    trackers.open_trackers(settings, tmp_path, {}, resumed=False)
    trackers.open_trackers(settings, tmp_path, {}, resumed=True)
    trackers.open_trackers(settings, tmp_path, {}, resumed=False)
    assert seen == [None, "new-1", None]
    assert json.loads((tmp_path / trackers.RUN_IDS_FILE).read_text()) == {"wandb": "new-3"}


def test_logger_tensorboard_is_the_older_spelling_of_tensorboard_enabled(tmp_path: Path) -> None:
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump({"data": {"train_path": "x.jsonl"}, "logger": {"tensorboard": False}}))
    with pytest.warns(DeprecationWarning, match="logger.tensorboard is an older spelling of logger.tensorboard_enabled"):
        cfg = load_config(path, [], GRPOConfig)
    assert cfg.logger.tensorboard_enabled is False


def test_the_run_checks_for_a_missing_tracker_package_before_loading_a_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nemo_rl_ext.config import ConfigError
    from nemo_rl_ext.grpo.build import check_inputs

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump({"data": {"train_path": "x.jsonl"}, "logger": {"wandb_enabled": True},
                                    "policy": {"model_name": str(tmp_path / "model")}}))
    cfg = load_config(path, [], GRPOConfig)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[wandb\]'"):
        check_inputs(cfg, [], [])  # given datums: no data file is read (the missing model folder is listed too)
