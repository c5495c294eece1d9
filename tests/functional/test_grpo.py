"""GRPO end to end on a tiny model (native rollouts, CPU): it learns a task, and a killed or stopped run resumes
exactly.

The task: every prompt's ground truth is "yes", generation stops at the string "yes" (a stop string), and
the `string_match` environment pays the similarity of the response to "yes" (1.0 for exactly "yes"). The
policy must learn to say "yes" first thing. The model is the tiny random Qwen2 built with a small
initializer range (0.05): the default tiny model (0.3) is so peaky that its samples barely differ, so a
group has nothing to compare.

Measured on 2 CPU cores (seeded, so every run gives the same numbers; about 12 s for 30 steps):
reward/mean of steps 1-5 = 0.111 0.110 0.117 0.121 0.110 (mean 0.114); steps 26-30 = 1.000 0.996 1.000
1.000 0.994 (mean 0.998); validation mean_reward 0.413, 0.949, 1.000 at steps 10, 20, 30.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from child_env import one_thread_env

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.grpo.config import RESUME_MAY_CHANGE, GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.training.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint

REPO = Path(__file__).resolve().parents[2]
# the resume tests compare runs trained here with runs trained partly in subprocesses (started with one thread too)
pytestmark = pytest.mark.usefixtures("one_torch_thread")
WORDS = ("apple", "river", "blue", "seven", "cat", "hello", "tree", "water")


@pytest.fixture(scope="module")
def soft_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with initializer_range 0.05: random, but with enough entropy to explore."""
    from nemo_rl_ext.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("soft_tiny"), seed=0, initializer_range=0.05)


@pytest.fixture(scope="module")
def config_file(soft_tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GRPO config for the say-"yes" task (output_dir is set per test)."""
    folder = tmp_path_factory.mktemp("grpo_cfg")
    data = folder / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n" for w in WORDS))
    cfg = {
        "policy": {
            "model_name": str(soft_tiny_model),
            "max_model_len": 256,
            "generation": {"max_new_tokens": 8, "temperature": 1.0, "stop_strings": ["yes"]},
        },
        "rollouts": {
            "num_generations_per_prompt": 16,
            "max_seq_len": 128,
            "env": {"name": "string_match", "kwargs": {"mode": "similarity"}},
        },
        "data": {"train_path": str(data)},
        "grpo": {
            "num_prompts_per_step": 4,
            "max_num_steps": 30,
            "seed": 42,
        },
        "optimizer": {"lr": 3.0e-3, "micro_batch_size": 16, "max_grad_norm": 1.0},
        # the loss these runs were measured with (before the defaults became NeMo-RL's: KL 0.01, IS off)
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
    }
    path = folder / "grpo_tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(config_file: Path, *overrides: str) -> list[dict]:
    cfg = load_config(config_file, list(overrides), GRPOConfig)
    with GRPO(cfg) as grpo:
        grpo.run()
    return read_metrics(Path(cfg.output_dir) / "metrics.jsonl")


def assert_same_step(got: dict, expected: dict) -> None:
    """One step's metrics from a resumed run against the uninterrupted run's, every differing key listed.

    What the sampled tokens decide (rewards, lengths, advantages: every key outside train/) must be equal to the
    bit: a resume that restored other weights, another RNG state or another data position samples other tokens.
    The train/ keys are float32 reductions over the trainer's and the engine's logprobs. Once in CI (2 pytest
    workers on 2 loaded cores) the subprocess's step 2 had train/grad_norm one ulp from this process's and step 3
    a near-cancelling train/loss (-0.00243) 1.6e-5 apart (relative), with every token-decided key equal: the
    trainer then ran 2 torch threads in the subprocess (now one: `one_torch_thread`, `one_thread_env`);
    splitting a step's 64 rows over two static batches changed no logprob bit (measured). 1e-4 relative, or
    1e-6 absolute, holds float noise of that size and nothing coarser."""
    keys = [key for key in expected if not key.startswith("timing/") and "wall_time" not in key]
    assert set(keys) <= set(got), sorted(set(keys) - set(got))
    exact = [key for key in keys if not key.startswith("train/") and got[key] != expected[key]]
    close = [key for key in keys if key.startswith("train/")
             and got[key] != pytest.approx(expected[key], rel=1e-4, abs=1e-6)]
    assert not exact + close, {key: (got[key], expected[key]) for key in exact + close}


@pytest.mark.timeout(90)
def test_grpo_learns_to_say_the_target(config_file: Path, tmp_path: Path) -> None:
    metrics = run(config_file, f"output_dir={tmp_path}", "grpo.val_period=10", "validation.num_prompts=4")
    train = [m for m in metrics if m["step"] > 0]
    assert [m["step"] for m in train] == list(range(1, 31))
    rewards = [m["rollout/reward/mean"] for m in train]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # measured: first 5 steps 0.114, last 5 steps 0.998 (see the module docstring)
    assert first < 0.2, rewards
    assert last > 0.8, rewards
    # the per-step record carries rollout, loss, ratio, grad-norm and timing metrics; validation every 10
    step = train[-1]
    for key in (
        "rollout/reward/std", "rollout/tokens/generated/mean", "train/loss", "train/clip_fraction",
        "train/importance_ratio/mean", "train/gen_kl/mean", "train/grad_norm", "timing/rollout_s",
        "timing/train_s", "timing/refit_s", "timing/step_s", "batch/advantage/abs_mean",
    ):
        assert key in step, key
    assert abs(step["train/importance_ratio/mean"] - 1.0) < 1e-3  # engine and trainer agree after refits
    assert [m["step"] for m in metrics if "val/mean_reward" in m] == [10, 20, 30]
    assert metrics[-1]["val/mean_reward"] > 0.8
    assert (tmp_path / "config.yaml").is_file()


def _kill_after_checkpoint(
    config_file: Path, output_dir: Path, step: int, overrides: tuple[str, ...], timeout_s: float = 60.0
) -> None:
    """Run examples/run_grpo.py in a subprocess and SIGKILL it as soon as the checkpoint of `step` exists."""
    cmd = [
        sys.executable, str(REPO / "examples" / "run_grpo.py"), "--config", str(config_file),
        f"output_dir={output_dir}", *overrides, "grpo.max_num_steps=100", "keep_last_checkpoints=null",
    ]
    marker = output_dir / "checkpoints" / f"step_{step:08d}" / "state.json"
    proc = subprocess.Popen(cmd, cwd=REPO, env=one_thread_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while not marker.exists():
            if proc.poll() is not None:
                raise AssertionError(f"run_grpo.py exited early:\n{proc.stdout.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no checkpoint of step {step} after {timeout_s} s")
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.timeout(120)
def test_killed_run_resumes_with_the_same_next_step(config_file: Path, tmp_path: Path) -> None:
    # The static scheduler: a step's requests share one batch (or a few, under load), so the engine's logprobs
    # and the importance weights built from them repeat to the bit. Under continuous batching the tokens repeat
    # (per-request seeds) but a row's batch mates depend on timing: train/loss moved by 1e-5 (relative) once.
    short = ("grpo.save_period=2", "grpo.val_period=2", "validation.num_prompts=2", "policy.hf.scheduler=static")
    uninterrupted = run(config_file, f"output_dir={tmp_path / 'a'}", "grpo.max_num_steps=5", *short)

    killed = tmp_path / "b"
    _kill_after_checkpoint(config_file, killed, step=2, overrides=short)
    resume_from = latest_checkpoint(killed / "checkpoints")
    k = load_checkpoint(resume_from).step  # 2, or 4 if the process outran the kill
    assert k in (2, 4)
    with pytest.raises(ConfigError, match="resume=true"):  # a fresh start would mix two runs
        GRPO(load_config(config_file, [f"output_dir={killed}"], GRPOConfig))
    resumed = run(config_file, f"output_dir={killed}", "resume=true", f"grpo.max_num_steps={k + 1}", *short)

    # the metrics file holds each step once: lines the killed run wrote after its checkpoint were dropped
    assert [m["step"] for m in resumed] == list(range(1, k + 2))
    expected, got = uninterrupted[k], resumed[k]  # step k + 1
    assert got["step"] == expected["step"] == k + 1
    assert {"train/loss", "train/grad_norm", "rollout/reward/mean", "batch/advantage/abs_mean"} <= set(expected)
    assert_same_step(got, expected)
    # and the steps before the kill, computed by the killed process, match the uninterrupted run too
    for before, after in zip(uninterrupted[:k], resumed[:k], strict=True):
        assert after["rollout/reward/mean"] == before["rollout/reward/mean"]


@pytest.mark.timeout(180)
def test_sigterm_without_periodic_checkpoints_leaves_the_last_step_resumable(config_file: Path, tmp_path: Path) -> None:
    """save_period 0 writes no checkpoint; SIGTERM (wherever it lands: rollouts, update, refit) still leaves
    one of the last whole step, and the resumed run's next step is the uninterrupted run's."""
    short = ("grpo.save_period=0", "policy.hf.scheduler=static")
    uninterrupted = run(config_file, f"output_dir={tmp_path / 'a'}", "grpo.max_num_steps=8", *short)

    stopped = tmp_path / "b"
    cmd = [sys.executable, str(REPO / "examples" / "run_grpo.py"), "--config", str(config_file),
           f"output_dir={stopped}", *short, "grpo.max_num_steps=100"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=one_thread_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    metrics_file = stopped / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 90
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no step 2 after 90 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "stopped by SIGTERM" in out and "resume=true" in out and "Traceback" not in out, out[-3000:]
    k = load_checkpoint(latest_checkpoint(stopped / "checkpoints")).step
    assert k == len(metrics_file.read_text().splitlines()) and 2 <= k <= 7  # the last step it logged
    resumed = run(config_file, f"output_dir={stopped}", "resume=true", f"grpo.max_num_steps={k + 1}", *short)
    assert [m["step"] for m in resumed] == list(range(1, k + 2))
    expected, got = uninterrupted[k], resumed[k]  # step k + 1: same rows, seeds, weights and optimizer state
    assert {"train/loss", "train/grad_norm", "rollout/reward/mean"} <= set(expected)
    assert_same_step(got, expected)


@pytest.mark.timeout(90)
def test_resume_refuses_a_changed_config_and_skips_a_damaged_checkpoint(
    config_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    small = ("rollouts.num_generations_per_prompt=4", "grpo.save_period=1", "keep_last_checkpoints=null")
    run(config_file, f"output_dir={tmp_path}", "grpo.max_num_steps=2", *small)

    # training keys differ: refused before any model loads, every changed key listed
    changed = ("optimizer.lr=0.001", "grpo.num_prompts_per_step=2", "rollouts.env.kwargs.mode=exact")
    resume = (f"output_dir={tmp_path}", "resume=true", *small)
    with pytest.raises(ConfigError) as err:
        GRPO(load_config(config_file, [*resume, *changed], GRPOConfig))
    text = str(err.value)
    newest = checkpoint_dir(tmp_path / "checkpoints", 2)
    assert text.startswith(f"{newest} was saved by a run with a different config"), text
    listed = [line.strip() for line in text.splitlines() if line.startswith("  - ")]
    assert listed == [
        "- grpo.num_prompts_per_step: 4 -> 2",
        "- optimizer.lr: 0.003 -> 0.001",
        "- rollouts.env.kwargs.mode: 'similarity' -> 'exact'",
    ]
    assert "grpo.max_num_steps" in text  # the message names the keys that may change

    # the newest checkpoint's weights are damaged: one warning naming the file, and the run resumes at
    # step 1 with keys of RESUME_MAY_CHANGE changed (more steps, no progress bar, another checkpoint period)
    damaged = newest / "policy" / "model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    allowed = ("grpo.max_num_steps=3", "logger.progress=true", "grpo.save_period=3", "validation.ks=[1, 2]")
    assert {"grpo.max_num_steps", "logger", "grpo.save_period", "validation"} <= set(RESUME_MAY_CHANGE)
    with caplog.at_level(logging.WARNING, logger="nemo_rl_ext.training.checkpoint"):
        with GRPO(load_config(config_file, [*resume, *allowed], GRPOConfig)) as grpo:
            assert grpo.step == 1
            grpo.run()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"{damaged} is damaged"), warnings
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert load_checkpoint(latest_checkpoint(tmp_path / "checkpoints")).step == 3


@pytest.mark.timeout(60)
def test_dynamic_sampling_rolls_out_more_and_skips_steps_without_signal(config_file: Path, tmp_path: Path) -> None:
    # exact-match rewards are all 0 at first: every group has zero variance and is dropped
    metrics = run(
        config_file, f"output_dir={tmp_path}", "grpo.max_num_steps=2", "rollouts.env.kwargs.mode=exact",
        "grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling.max_gen_batches=2",
        "optimizer.scheduler.warmup_steps=2",
    )
    # a step without an update still has its scheduled lr in its metrics (lr 3e-3 x s/2): the curve has every step
    assert [m["train/lr"] for m in metrics] == [1.5e-3, 3e-3]
    for m in metrics:
        assert m["rollout/num_prompts"] == 8.0  # two batches of 4 prompts
        assert m["dynamic_sampling/gen_batches"] == 2.0
        assert m["dynamic_sampling/kept_groups"] == 0.0
        assert m["dynamic_sampling/zero_variance_fraction"] == 1.0
        assert m["train/optimizer_steps"] == 0.0 and "train/loss" not in m
    # with similarity rewards every group differs: one batch is enough
    metrics = run(
        config_file, f"output_dir={tmp_path / 'sim'}", "grpo.max_num_steps=1", "grpo.dynamic_sampling.enabled=true",
    )
    assert metrics[0]["dynamic_sampling/gen_batches"] == 1.0
    assert metrics[0]["dynamic_sampling/kept_groups"] == 4.0 and metrics[0]["train/optimizer_steps"] == 1.0


@pytest.mark.timeout(120)
def test_prompts_too_long_are_in_the_step_metrics_and_warned_about_once(
    config_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A prompt that alone fills rollouts.max_seq_len (128) ends truncated at 0 turns: each step counts it in
    `rollout/prompts_too_long`, and the run logs one warning naming it and the settings to raise."""
    data = tmp_path / "rows.jsonl"
    rows = [{"question": f"Say yes. {w}", "answer": "yes"} for w in WORDS[:3]]
    rows.append({"question": "Say yes. " + "Really, please do. " * 60, "answer": "yes"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING):
        metrics = run(config_file, f"output_dir={tmp_path / 'run'}", f"data.train_path={data}",
                      "grpo.max_num_steps=2", "rollouts.num_generations_per_prompt=4")
    train = [m for m in metrics if m["step"] > 0]
    assert [m["rollout/prompts_too_long"] for m in train] == [1.0, 1.0]  # 4 prompts a step: the long one each time
    said = [r.getMessage() for r in caplog.records if "prompt(s) too long" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("1 of 4 prompt(s) too long") and "policy.max_model_len and rollouts.max_seq_len" in said[0]


@pytest.mark.timeout(150)
def test_lr_schedule_per_step_and_across_a_resume(config_file: Path, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """`optimizer.scheduler`: train/lr follows the formula at each step, a run stopped after step 2 and resumed
    continues the schedule exactly (the same lr, and the same step 3 as the uninterrupted run), and a resumed
    run that trains past the horizon it started with stays at min_lr, and says so once."""
    cosine = ("optimizer.scheduler.type=cosine", "optimizer.scheduler.warmup_steps=1",
              "optimizer.scheduler.min_lr=3.0e-4", "optimizer.scheduler.total_steps=4", "policy.hf.scheduler=static",
              "grpo.save_period=2")
    whole = run(config_file, f"output_dir={tmp_path / 'a'}", "grpo.max_num_steps=4", *cosine)
    # lr 3e-3, W = 1, T = 4: step 1 at lr; p = (s - 1)/3; 3e-4 + 2.7e-3 (1 + cos(pi p))/2
    expected = [3e-3, 3e-4 + 2.7e-3 * 0.75, 3e-4 + 2.7e-3 * 0.25, 3e-4]
    assert [m["train/lr"] for m in whole] == pytest.approx(expected, rel=1e-6)

    stopped = tmp_path / "b"
    run(config_file, f"output_dir={stopped}", "grpo.max_num_steps=2", *cosine)
    resumed = run(config_file, f"output_dir={stopped}", "resume=true", "grpo.max_num_steps=4", *cosine)
    assert [m["train/lr"] for m in resumed] == [m["train/lr"] for m in whole]  # the same float, by construction
    assert_same_step(resumed[2], whole[2])

    # no total_steps: the horizon is the starting run's grpo.max_num_steps (2), kept by its checkpoint
    linear = ("optimizer.scheduler.type=linear", "optimizer.scheduler.min_lr=3.0e-4", "grpo.save_period=1")
    short = tmp_path / "c"
    first = run(config_file, f"output_dir={short}", "grpo.max_num_steps=2", *linear)
    with caplog.at_level(logging.WARNING, logger="nemo_rl_ext.grpo.loop"):
        longer = run(config_file, f"output_dir={short}", "resume=true", "grpo.max_num_steps=4", *linear)
    said = [r.getMessage() for r in caplog.records if "optimizer.scheduler" in r.getMessage()]
    assert said == ["optimizer.scheduler: the run's schedule ends at step 2 (its horizon when it started); steps 3 "
                    "to 4 (grpo.max_num_steps) train at min_lr"], said
    assert [m["train/lr"] for m in first] == [3e-3, 3e-4]
    assert [m["train/lr"] for m in longer] == [3e-3, 3e-4, 3e-4, 3e-4]  # a horizon of 4 would give 1.2e-3 at 3
