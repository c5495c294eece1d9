"""Asynchronous GRPO (`grpo.async`) end to end on the tiny model, native rollouts, the in-process hf engine.

The say-"yes" task of test_grpo.py (its module docstring has the synchronous numbers): with max_lag 0 the
asynchronous loop is the synchronous one to the bit; with max_lag 2 it learns the task as well, every
trained group at most 2 versions behind, validating as it goes; dynamic sampling works through it; a
failing collector stops the run at once with its error, while the trainer waits or while it trains; a group
that never finishes does not stop the steps; a killed or stopped run resumes and keeps the bound, and a
stopped run never replays the group that was in flight; the Ray replica pool serves it too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from child_env import one_thread_env

from nemo_rl_ext.config import load_config
from nemo_rl_ext.environments.string_match import match_reward
from nemo_rl_ext.grpo.async_collector import CollectorError
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.testing import FailingEnvironment, Fault
from nemo_rl_ext.training.checkpoint import latest_checkpoint, load_checkpoint

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
        # the loss these runs were measured with (before the defaults became NeMo-RL's: KL 0.01, IS off)
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
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


@pytest.mark.timeout(120)
def test_max_lag_0_gives_the_synchronous_weights_and_metrics_to_the_bit(
    config_file: Path, tmp_path: Path, one_torch_thread: None, caplog: pytest.LogCaptureFixture
) -> None:
    # the static scheduler: batches of equal-length prompts, so no row's logprobs depend on its batch mates
    common = ("grpo.max_num_steps=4", "policy.hf.scheduler=static")
    sync, sync_weights = run(config_file, f"output_dir={tmp_path / 'sync'}", *common)
    with caplog.at_level(logging.WARNING, logger="nemo_rl_ext.grpo.loop"):
        lagged, lagged_weights = run(config_file, f"output_dir={tmp_path / 'async'}", *common, *ASYNC,
                                     "grpo.async.max_lag=0")
    # no slack: a group that never finishes would stop this run, and the run says so
    assert any("a group that never finishes" in r.getMessage() for r in caplog.records)
    assert [m["step"] for m in lagged] == [1, 2, 3, 4]
    for expected, got in zip(sync, lagged, strict=True):
        keys = [k for k in expected if not k.startswith("timing/") and "wall_time" not in k]
        assert {"train/loss", "train/grad_norm", "rollout/reward/mean", "train/importance_ratio/mean"} <= set(keys)
        assert {k: got[k] for k in keys} == {k: expected[k] for k in keys}  # exact equality, every metric
        assert got["async/lag/0"] == 4.0 and got["async/lag/max"] == 0.0
    assert sync_weights.keys() == lagged_weights.keys()
    # bit-exact by construction: one machine and torch thread, and the static scheduler gives both runs the same shapes
    assert all(torch.equal(sync_weights[k], lagged_weights[k]) for k in sync_weights)
    assert any(not torch.equal(sync_weights[k], v) for k, v in _initial_weights(config_file).items())


def _initial_weights(config_file: Path) -> dict[str, torch.Tensor]:
    from nemo_rl_ext.models.loading import load_model_and_tokenizer

    model_dir = yaml.safe_load(config_file.read_text())["policy"]["model_name"]
    model, _ = load_model_and_tokenizer(model_dir, dtype=torch.float32, device="cpu")
    return model.state_dict()


@pytest.mark.timeout(300)
def test_max_lag_2_learns_the_task_within_the_bound(config_file: Path, tmp_path: Path) -> None:
    # a batch of 256 rows: the 12 groups started at once (3 steps' worth) all decode before the first refit
    metrics, _ = run(config_file, f"output_dir={tmp_path}", *ASYNC, "grpo.async.max_lag=2",
                     "policy.max_batch_size=256", "grpo.val_period=10", "validation.num_prompts=4")
    train = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in train] == list(range(1, 31))
    rewards = [m["rollout/reward/mean"] for m in train]
    # one run (timing decides each lag, so runs differ): first 5 steps 0.112, last 5 0.996 (sync: 0.114, 0.998)
    assert sum(rewards[:5]) / 5 < 0.2, rewards
    assert sum(rewards[-5:]) / 5 >= 0.95, rewards
    # the bound is reached: step 3 trains the last 4 of the 12 groups generated at version 0 ...
    assert train[2]["async/lag/2"] >= 1.0, train[:3]
    for m in train:  # ... and never passed: every trained group's lag is in the histogram
        assert m["async/lag/max"] <= 2.0
        assert m["async/lag/0"] + m["async/lag/1"] + m["async/lag/2"] == 4.0
        assert not any(k.startswith("async/lag/") and k.rsplit("/", 1)[1].isdigit() and int(k.rsplit("/", 1)[1]) > 2
                       for k in m)
        assert m["async/trainer_wait_s"] >= 0.0 and m["async/generation_idle_s"] >= 0.0
        assert m["async/groups/discarded"] == (m["async/groups/dropped_stale"] + m["async/groups/cancelled_stale"]
                                               + m["async/groups/deadline_expired"])
    # groups the run started and never trained: 12 in flight at the start, one step's worth more at each step
    assert train[-1]["async/groups/oversampled_discarded"] >= 1.0
    # validation during the asynchronous run, with the same prompts and seeds each time
    assert [m["step"] for m in metrics if "val/mean_reward" in m] == [10, 20, 30]
    assert metrics[-1]["val/mean_reward"] > 0.8


@pytest.mark.timeout(120)
def test_dynamic_sampling_through_the_asynchronous_loop(config_file: Path, tmp_path: Path) -> None:
    # exact-match rewards are all 0 at first: every group has zero variance, a step takes what it has
    metrics, _ = run(config_file, f"output_dir={tmp_path / 'exact'}", "grpo.max_num_steps=2", "rollouts.env.kwargs.mode=exact",
                     "grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.max_gen_batches=2", *ASYNC)
    for m in metrics:
        assert m["dynamic_sampling/kept_groups"] == 0.0 and m["dynamic_sampling/zero_variance_fraction"] == 1.0
        assert m["dynamic_sampling/gen_batches"] >= 2.0 and m["rollout/num_prompts"] >= 8.0
        assert m["train/optimizer_steps"] == 0.0 and "train/loss" not in m
    # similarity rewards: every group has variance, every step trains on a full step
    metrics, _ = run(config_file, f"output_dir={tmp_path / 'sim'}", "grpo.max_num_steps=3",
                     "grpo.dynamic_sampling.enabled=true", *ASYNC)
    for m in metrics:
        assert m["dynamic_sampling/kept_groups"] == 4.0 and m["train/optimizer_steps"] == 1.0
        assert m["async/lag/max"] <= 1.0


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


@pytest.mark.timeout(60)
def test_a_rollout_failing_during_a_train_step_stops_the_run_after_that_step(config_file: Path, tmp_path: Path) -> None:
    cfg = load_config(config_file, [f"output_dir={tmp_path}", *ASYNC, "grpo.async.max_lag=1"], GRPOConfig)
    with GRPO(cfg) as grpo:
        rollout, train = grpo.manager.run_rollout, grpo._train_records
        training = threading.Event()
        calls = 0
        failed_at: list[float] = []

        def slow_train(records, metrics):  # the trainer's thread: a train step of at least 2 s
            training.set()
            time.sleep(2.0)
            return train(records, metrics)

        async def flaky(datum):
            nonlocal calls
            calls += 1
            if calls > 4:  # every group but step 1's fails, once the trainer is training
                while not training.is_set():
                    await asyncio.sleep(0.01)
                failed_at.append(time.monotonic())
                raise RuntimeError("the environment's database is gone")
            return await rollout(datum)

        grpo.manager.run_rollout, grpo._train_records = flaky, slow_train
        with pytest.raises(CollectorError, match="database is gone"):
            grpo.run()
        stopped = time.monotonic()
    # the failure cut the trainer's wait for its thread; the step it was training never counted
    assert grpo.step == 0 and not (tmp_path / "checkpoints").exists()
    assert stopped - failed_at[0] < 2.0 + 3.0  # the train step in flight finishes (a thread), nothing after it


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "knobs",
    # max_lag 0 leaves no slack (without one of these the first step waits forever: test_grpo_async.py)
    [("grpo.async.max_lag=0", "grpo.async.oversample=1"),  # a spare slot; the hung group is cancelled as stale
     ("grpo.async.max_lag=0", "grpo.async.group_deadline_s=2")],  # the deadline frees the step
    ids=["oversample", "deadline"],
)
def test_a_group_that_never_finishes_does_not_stop_the_steps(config_file: Path, tmp_path: Path, knobs) -> None:
    hang = FailingEnvironment(Fault.HANG, when=lambda s: "river" in s.question,
                              reward=lambda s: float(s.reply.strip().lower().startswith("yes")))
    metrics, _ = run(config_file, f"output_dir={tmp_path}", "grpo.max_num_steps=6", *ASYNC, *knobs,
                     task_to_env={"string_match": hang})
    assert [m["step"] for m in metrics] == list(range(1, 7))
    expired = "deadline_expired" if "deadline" in " ".join(knobs) else "cancelled_stale"
    assert sum(m[f"async/groups/{expired}"] for m in metrics) >= 1
    assert all(m["async/lag/max"] == 0.0 for m in metrics)


def _start(config_file: Path, output_dir: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "examples" / "run_grpo.py"), "--config", str(config_file),
           f"output_dir={output_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=one_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(proc: subprocess.Popen, marker: Path, timeout_s: float = 90.0) -> None:
    _wait_until(proc, marker.exists, str(marker), timeout_s)


def _logged_steps(output_dir: Path) -> int:
    path = output_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_stopped_run_resumes_within_the_bound(config_file: Path, tmp_path: Path, sig: signal.Signals) -> None:
    """SIGKILL right after the step-2 checkpoint (save_period 2); SIGTERM after step 2 with no periodic
    checkpoints at all (save_period 0): the stop itself checkpoints the last whole step."""
    knobs = (*ASYNC, "grpo.async.max_lag=2", "grpo.async.in_flight=abort", "keep_last_checkpoints=null",
             f"grpo.save_period={2 if sig == signal.SIGKILL else 0}")
    proc = _start(config_file, tmp_path, *knobs, "grpo.max_num_steps=100")
    try:
        if sig == signal.SIGKILL:
            _wait_for(proc, tmp_path / "checkpoints" / f"step_{2:08d}" / "state.json")
        else:
            _wait_until(proc, lambda: _logged_steps(tmp_path) >= 2, "step 2's metrics")
        sent = time.monotonic()
        proc.send_signal(sig)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # an orderly stop: exit 143, one line, no traceback, a checkpoint of the last logged step
        assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
        assert "stopped by SIGTERM" in out and "Traceback" not in out, out[-3000:]
        print(f"\nasync GRPO: exit {time.monotonic() - sent:.2f} s after SIGTERM")
    assert not list((tmp_path / "checkpoints").glob(".step_*"))  # no half-written checkpoint
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    k = checkpoint.step
    if sig == signal.SIGTERM:
        assert k == _logged_steps(tmp_path) >= 2
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


def _wait_until(proc: subprocess.Popen, ready, what: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"run_grpo.py exited early:\n{proc.stdout.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} after {timeout_s} s")
        time.sleep(0.02)


@pytest.mark.timeout(120)
def test_a_stopped_run_never_replays_the_group_in_flight(config_file: Path, tmp_path: Path) -> None:
    """Rows in file order (no shuffle), max_lag 0 with a spare: positions 0-4 start, step 1 trains 0-3, then
    positions 5-9 start; the "river" row (row 1) comes back at position 9 and hangs in its environment, which
    sends this process SIGINT (Ctrl-C). The stop checkpoints the last whole step with row 1 as skipped, and
    the resumed run (where nothing hangs) never trains it: its next occurrence is position 17."""
    common = (f"output_dir={tmp_path}", *ASYNC, "grpo.async.max_lag=0", "grpo.async.oversample=1",
              "data.shuffle=false", "grpo.save_period=0")
    river_steps = 0

    def hang_the_second_river(state) -> bool:
        nonlocal river_steps
        if "river" not in state.question:
            return False
        river_steps += 1
        if river_steps == 17:  # the first river group had 16 samples: this is its second group
            os.kill(os.getpid(), signal.SIGINT)
        return river_steps > 16

    hang = FailingEnvironment(Fault.HANG, when=hang_the_second_river,
                              reward=lambda s: match_reward(s.reply, "yes", "similarity"))
    cfg = load_config(config_file, [*common, "grpo.max_num_steps=100"], GRPOConfig)
    with GRPO(cfg, task_to_env={"string_match": hang}) as grpo:
        river = next(d.idx for d in grpo.train_data.datums if "river" in d.message_log[-1].content)
        with pytest.raises(KeyboardInterrupt):
            grpo.run()
        k = grpo.step
    assert river_steps > 16 and k >= 1
    checkpoint = load_checkpoint(latest_checkpoint(tmp_path / "checkpoints"))
    assert checkpoint.step == k and river in checkpoint.extra["async"]["skipped_rows"]
    consumed = checkpoint.data_state["consumed"]
    assert consumed <= 16  # the next river (position 17) was not drawn yet

    trained: list[int] = []
    cfg = load_config(config_file, [*common, "resume=true", f"grpo.max_num_steps={k + 1}"], GRPOConfig)
    with GRPO(cfg) as grpo:  # the configured environment: nothing hangs
        train = grpo._train_records

        def spy(records, metrics):
            trained.extend(r.prompt_idx for r in records)
            return train(records, metrics)

        grpo._train_records = spy
        grpo.run()
        drawn = grpo.train_data.consumed
    assert len(trained) == 4 and river not in trained
    assert drawn <= 17 or river in trained  # (had position 17 been drawn and trained, that would be legitimate)


@pytest.mark.timeout(300)
def test_async_grpo_on_a_two_replica_ray_pool(local_ray, config_file: Path, tmp_path: Path) -> None:
    from nemo_rl_ext.cluster import RoutedGeneration

    cfg = load_config(config_file, [f"output_dir={tmp_path}", *ASYNC, "grpo.async.max_lag=1",
                                    "grpo.async.in_flight=abort", "grpo.max_num_steps=3",
                                    "rollouts.num_generations_per_prompt=4", "policy.cluster.num_replicas=2",
                                    "policy.cluster.replica.num_cpus=0.5"], GRPOConfig)
    with GRPO(cfg) as grpo:
        pool = grpo.generation.inner
        assert isinstance(pool, RoutedGeneration)
        history = grpo.run()
        versions = local_ray.get([r.actor.weight_version.remote() for r in pool._replicas], timeout=60)
        served = [pool.metrics()[f"cluster/replica/{i}/requests"] for i in range(2)]
    assert [m["step"] for m in history] == [1, 2, 3]
    assert versions == [3, 3] and min(served) >= 1, (versions, served)  # both replicas served and were refit
    for m in history:
        assert m["cluster/weight_version"] == m["step"]
        assert m["async/lag/max"] <= 1.0 and m["async/lag/0"] + m["async/lag/1"] == 4.0
        assert m["train/optimizer_steps"] == 1.0
