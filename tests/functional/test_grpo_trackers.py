"""GRPO on the tiny model logging to W&B (offline) and MLflow (its default sqlite store), read back from each tracker's
own files / client: every step's loss and the config; a resume continues the same tracker runs; a tracker
server that cannot be reached is one warning and the run finishes."""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest
import yaml

pytest.importorskip("wandb", reason="the wandb extra (make setup installs it)")
pytest.importorskip("mlflow", reason="the mlflow extra (make setup installs it)")

from nemo_rl_ext.config import load_config  # noqa: E402
from nemo_rl_ext.grpo.config import GRPOConfig  # noqa: E402
from nemo_rl_ext.grpo.loop import GRPO  # noqa: E402
from nemo_rl_ext.grpo.metrics_logger import read_metrics  # noqa: E402
from nemo_rl_ext.grpo.trackers import RUN_IDS_FILE, SAMPLE_COLUMNS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def tracker_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B's own settings and caches inside the test's folder; MLflow's HTTP client fails fast."""
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from nemo_rl_ext.models.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("trackers_cfg")
    model = build_tiny_model(folder / "model", seed=0, initializer_range=0.05)
    data = folder / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n"
                            for w in ("apple", "river", "blue", "seven")))
    cfg = {
        "policy": {"model_name": str(model), "max_model_len": 256,
                   "generation": {"max_new_tokens": 8, "temperature": 1.0}},
        "rollouts": {"num_generations_per_prompt": 4, "max_seq_len": 128,
                     "env": {"name": "string_match", "kwargs": {"mode": "similarity"}}},
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 2, "max_num_steps": 3, "seed": 7, "save_period": 3},
        "optimizer": {"lr": 1.0e-3, "micro_batch_size": 8},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
    }
    path = folder / "grpo_trackers.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(config_file: Path, *overrides: str) -> GRPOConfig:
    cfg = load_config(config_file, list(overrides), GRPOConfig)
    with GRPO(cfg) as grpo:
        grpo.run()
    return cfg


def wandb_records(out: Path) -> tuple[set[str], dict[int, dict], dict]:
    """From the offline run folders under out/wandb: the run ids, step -> history row, and the config."""
    from wandb.proto import wandb_internal_pb2

    from nemo_rl_ext.testing.wandb_files import read_records

    ids, history, config = set(), {}, {}
    for file in sorted(out.glob("wandb/offline-run-*/run-*.wandb")):
        for data in read_records(file):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                config.update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                row: dict = {}
                for item in record.history.item:  # a table: nested keys (name, "_type"), (name, "nrows"), ...
                    path = [item.key] if item.key else list(item.nested_key)
                    parent = row
                    for part in path[:-1]:
                        parent = parent.setdefault(part, {})
                    parent[path[-1]] = json.loads(item.value_json)
                history.setdefault(row["_step"], {}).update(row)
    return ids, history, config


def mlflow_run(out: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    run_id = json.loads((out / RUN_IDS_FILE).read_text())["mlflow"]
    return client, run_id


@pytest.mark.timeout(600)
def test_wandb_offline_and_mlflow_get_every_step_the_config_and_a_resume(config_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    on = [f"output_dir={out}", "logger.wandb_enabled=true", "logger.wandb.mode=offline",
          "logger.wandb.project=trackers-test", "logger.mlflow_enabled=true", "logger.num_sample_rollouts=2"]
    cfg = run(config_file, *on)
    steps = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(steps) == [1, 2, 3]
    resolved = cfg.model_dump(mode="json")

    client, run_id = mlflow_run(out)
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert losses == {s: steps[s]["train/loss"] for s in (1, 2, 3)}  # a float64 stored and read back: equal
    assert client.get_run(run_id).info.status == "FINISHED"
    config_file_path = client.download_artifacts(run_id, "config.json", str(tmp_path / "mlflow_config"))
    assert json.loads(Path(config_file_path).read_text()) == resolved
    table = json.loads(Path(client.download_artifacts(run_id, "rollouts/step_000002.json", str(tmp_path))).read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS) and len(table["data"]) == 2
    assert all(isinstance(row[0], str) and row[0].startswith("Say yes.") for row in table["data"])

    ids, history, wb_config = wandb_records(out)
    wandb_id = json.loads((out / RUN_IDS_FILE).read_text())["wandb"]
    assert ids == {wandb_id}
    assert {s: history[s]["train/loss"] for s in (1, 2, 3)} == {s: steps[s]["train/loss"] for s in (1, 2, 3)}
    tables = [history[s]["rollouts/samples"] for s in (1, 2, 3)]
    assert [(t["_type"], t["ncols"], t["nrows"]) for t in tables] == [("table-file", len(SAMPLE_COLUMNS), 2)] * 3
    assert {k: wb_config[k] for k in resolved} == resolved

    run(config_file, *on, "resume=true", "grpo.max_num_steps=6")
    steps = {r["step"]: r for r in read_metrics(out / "metrics.jsonl")}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / RUN_IDS_FILE).read_text()) == {"wandb": wandb_id, "mlflow": run_id}
    losses = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert losses == {s: steps[s]["train/loss"] for s in range(1, 7)}
    experiment = client.get_run(run_id).info.experiment_id
    assert [r.info.run_id for r in client.search_runs([experiment])] == [run_id]  # no second run
    ids, history, _ = wandb_records(out)
    assert ids == {wandb_id} and len(list(out.glob("wandb/offline-run-*"))) == 2  # one folder per process
    assert {s: history[s]["train/loss"] for s in range(1, 7)} == {s: steps[s]["train/loss"] for s in range(1, 7)}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_an_unreachable_tracking_server_is_one_warning_and_the_run_finishes(
    config_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "run"
    uri = f"http://127.0.0.1:{closed_port()}"
    with caplog.at_level(logging.WARNING, logger="nemo_rl_ext"):
        run(config_file, f"output_dir={out}", "logger.mlflow_enabled=true", f"logger.mlflow.tracking_uri={uri}",
            "grpo.max_num_steps=2", "grpo.save_period=0")
    warnings = [r.getMessage() for r in caplog.records if "logger.mlflow" in r.getMessage()]
    assert len(warnings) == 1 and "the run goes on without mlflow" in warnings[0], warnings
    assert uri in warnings[0]  # the failure is the unreachable server (its requests name it)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
