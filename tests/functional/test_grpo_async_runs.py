"""Asynchronous GRPO (`grpo.async`) end to end on the tiny model, native rollouts, the in-process hf engine.

The say-"yes" task of test_grpo.py (its module docstring has the synchronous numbers): with max_lag 0 the
asynchronous loop is the synchronous one to the bit; with max_lag 2 it learns the task as well, every
trained group at most 2 versions behind; a failing collector stops the run at once with its error; a group
that never finishes does not stop the steps; a killed run resumes and keeps the bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from nemo_rl_ext.algorithms.async_collector import CollectorError
from nemo_rl_ext.algorithms.checkpoint import latest_checkpoint, load_checkpoint
from nemo_rl_ext.algorithms.grpo import GRPO
from nemo_rl_ext.algorithms.grpo_config import GRPOConfig
from nemo_rl_ext.algorithms.metrics_logger import read_metrics
from nemo_rl_ext.config import load_config
from nemo_rl_ext.testing import FailingEnvironment, Fault

REPO = Path(__file__).resolve().parents[2]
WORDS = ("apple", "river", "blue", "seven", "cat", "hello", "tree", "water")
ASYNC = ("grpo.async.enabled=true",)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """test_grpo.py's say-"yes" config (tiny Qwen2 with initializer_range 0.05); output_dir is set per test."""
    from nemo_rl_ext.models.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("grpo_async")
    model = build_tiny_model(folder / "model", seed=0, initializer_range=0.05)
    data = folder / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n" for w in WORDS))
    cfg = {
        "policy": {
            "model_name": str(model),
            "max_model_len": 256,
            "generation": {"max_new_tokens": 8, "temperature": 1.0, "stop_strings": ["yes"]},
        },
        "rollouts": {
            "env": {"name": "string_match", "kwargs": {"mode": "similarity"}},
            "num_generations_per_prompt": 16,
            "max_seq_len": 128,
        },
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 4, "max_num_steps": 30, "seed": 42},
        "optimizer": {"lr": 3.0e-3, "micro_batch_size": 16, "max_grad_norm": 1.0},
        "logger": {"progress": False, "tensorboard": False, "print_steps": False},
    }
    path = folder / "grpo_tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(config_file: Path, *overrides: str, **kwargs) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Train; returns the metrics file's records and the trained weights."""
    cfg = load_config(config_file, list(overrides), GRPOConfig)
    with GRPO(cfg, **kwargs) as grpo:
        grpo.run()
        weights = {k: v.detach().clone() for k, v in grpo.trainer.state_dict().items()}
    return read_metrics(Path(cfg.output_dir) / "metrics.jsonl"), weights


def lag_max(metrics: list[dict]) -> list[float]:
    return [m["async/lag/max"] for m in metrics if "async/lag/max" in m]


@pytest.fixture
def one_torch_thread():
    """One torch thread while the test runs: with two, step 1's train/loss differed by one ulp in 1 of 8 runs on a
    loaded 2-core machine (cause not pinned down; one thread takes the thread count out of the kernels)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.timeout(120)
def test_max_lag_0_gives_the_synchronous_weights_and_metrics_to_the_bit(
    config_file: Path, tmp_path: Path, one_torch_thread: None
) -> None:
    # the static scheduler: a step's requests share one batch whatever the timing (see test_grpo.py's resume test)
    common = ("grpo.max_num_steps=4", "policy.hf.scheduler=static")
    sync, sync_weights = run(config_file, f"output_dir={tmp_path / 'sync'}", *common)
    lagged, lagged_weights = run(config_file, f"output_dir={tmp_path / 'async'}", *common, *ASYNC,
                                 "grpo.async.max_lag=0")
    assert [m["step"] for m in lagged] == [1, 2, 3, 4]
    for expected, got in zip(sync, lagged, strict=True):
        keys = [k for k in expected if not k.startswith("timing/") and "wall_time" not in k]
        assert {"train/loss", "train/grad_norm", "rollout/reward/mean", "train/importance_ratio/mean"} <= set(keys)
        assert {k: got[k] for k in keys} == {k: expected[k] for k in keys}  # exact equality, every metric
        assert got["async/lag/0"] == 4.0 and got["async/lag/max"] == 0.0
    assert sync_weights.keys() == lagged_weights.keys()
    assert all(torch.equal(sync_weights[k], lagged_weights[k]) for k in sync_weights)
    assert any(not torch.equal(sync_weights[k], v) for k, v in _initial_weights(config_file).items())


def _initial_weights(config_file: Path) -> dict[str, torch.Tensor]:
    from nemo_rl_ext.models.loading import load_model_and_tokenizer

    model_dir = yaml.safe_load(config_file.read_text())["policy"]["model_name"]
    model, _ = load_model_and_tokenizer(model_dir, dtype=torch.float32, device="cpu")
    return model.state_dict()


@pytest.mark.timeout(300)
def test_max_lag_2_learns_the_task_within_the_bound(config_file: Path, tmp_path: Path) -> None:
    metrics, _ = run(config_file, f"output_dir={tmp_path}", *ASYNC, "grpo.async.max_lag=2")
    assert [m["step"] for m in metrics] == list(range(1, 31))
    rewards = [m["rollout/reward/mean"] for m in metrics]
    # one run (timing decides each lag, so runs differ): first 5 steps 0.112, last 5 0.996 (sync: 0.114, 0.998)
    assert sum(rewards[:5]) / 5 < 0.2, rewards
    assert sum(rewards[-5:]) / 5 >= 0.95, rewards
    assert max(lag_max(metrics)) == 2.0  # the bound is reached (the run really is asynchronous) ...
    for m in metrics:  # ... and never passed: every trained group's lag is in the histogram
        assert m["async/lag/max"] <= 2.0
        assert m["async/lag/0"] + m["async/lag/1"] + m["async/lag/2"] == 4.0
        assert not any(k.startswith("async/lag/") and k.rsplit("/", 1)[1].isdigit() and int(k.rsplit("/", 1)[1]) > 2
                       for k in m)
        for key in ("async/trainer_wait_s", "async/generation_idle_s", "async/groups/dropped_stale",
                    "async/groups/discarded", "async/groups/cancelled_stale", "async/groups/deadline_expired"):
            assert key in m, key


@pytest.mark.timeout(60)
def test_a_failing_collector_stops_the_run_at_once_with_its_error(config_file: Path, tmp_path: Path) -> None:
    cfg = load_config(config_file, [f"output_dir={tmp_path}", *ASYNC, "grpo.async.max_lag=1"], GRPOConfig)
    with GRPO(cfg) as grpo:
        rollout = grpo.manager.run_rollout
        calls = 0
        failed_at: list[float] = []

        async def flaky(datum):
            nonlocal calls
            calls += 1
            if calls == 7:  # in step 2's groups (4 per step)
                failed_at.append(time.monotonic())
                raise RuntimeError("the environment's database is gone")
            return await rollout(datum)

        grpo.manager.run_rollout = flaky
        with pytest.raises(CollectorError, match="database is gone") as err:
            grpo.run()
        stopped = time.monotonic()
    assert isinstance(err.value.__cause__, RuntimeError)
    assert stopped - failed_at[0] < 5.0  # no polling: the trainer's next await raised it
    assert grpo.step <= 2


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "knobs",
    [("grpo.async.max_lag=1", "grpo.async.oversample=1"),  # a spare slot; the hung group is cancelled as stale
     ("grpo.async.max_lag=0", "grpo.async.group_deadline_s=2")],  # no slack: the deadline frees the step
    ids=["oversample", "deadline"],
)
def test_a_group_that_never_finishes_does_not_stop_the_steps(config_file: Path, tmp_path: Path, knobs) -> None:
    hang = FailingEnvironment(Fault.HANG, when=lambda s: "river" in s.question,
                              reward=lambda s: float(s.reply.strip().lower().startswith("yes")))
    metrics, _ = run(config_file, f"output_dir={tmp_path}", "grpo.max_num_steps=6", *ASYNC, *knobs,
                     task_to_env={"string_match": hang})
    assert [m["step"] for m in metrics] == list(range(1, 7))
    discarded = sum(m["async/groups/cancelled_stale"] + m["async/groups/deadline_expired"] for m in metrics)
    assert discarded >= 1
    if "deadline" in " ".join(knobs):
        assert sum(m["async/groups/deadline_expired"] for m in metrics) >= 1
    assert all(m["async/lag/max"] <= (1.0 if "max_lag=1" in knobs[0] else 0.0) for m in metrics)


def _start(config_file: Path, output_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "examples" / "run_grpo.py"), "--config", str(config_file),
           f"output_dir={output_dir}", *overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(proc: subprocess.Popen, marker: Path, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run_grpo.py exited early:\n{proc.stdout.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {marker} after {timeout_s} s")
        time.sleep(0.02)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_stopped_run_resumes_within_the_bound(config_file: Path, tmp_path: Path, sig: signal.Signals) -> None:
    knobs = (*ASYNC, "grpo.async.max_lag=2", "grpo.async.in_flight=abort", "grpo.save_period=2",
             "keep_last_checkpoints=null")
    proc = _start(config_file, tmp_path, *knobs, "grpo.max_num_steps=100")
    try:
        _wait_for(proc, tmp_path / "checkpoints" / f"step_{2:08d}" / "state.json")
        proc.send_signal(sig)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # an orderly stop: exit 143, one line, no traceback
        assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
        assert "stopped by SIGTERM" in out and "Traceback" not in out, out[-3000:]
    assert not list((tmp_path / "checkpoints").glob(".step_*"))  # no half-written checkpoint
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    k = checkpoint.step
    saved = checkpoint.extra["async"]
    assert saved["policy_version"] == k
    # rows in flight or waiting at the checkpoint were drawn (data_state counts them) and are skipped
    assert checkpoint.data_state["consumed"] >= 4 * k + len(saved["skipped_rows"])

    again = _start(config_file, tmp_path, *knobs, "resume=true", f"grpo.max_num_steps={k + 3}")
    out = again.communicate(timeout=120)[0].decode()
    assert again.returncode == 0, out[-3000:]
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, k + 4))
    assert all(0.0 <= lag <= 2.0 for lag in lag_max(metrics))
    assert max(lag_max(metrics[k:])) >= 1.0  # the resumed run is asynchronous again
