"""SIGTERM / SIGINT / SIGKILL to examples/run_eval.py and examples/run_grpo.py in nemo_gym mode (real NeMo
Gym 0.7.0 servers, the tiny model): every process the run started is stopped, and the outputs resume.

The Gym servers are found before the signal as the run's descendants whose environment names a Gym
instance (NEMO_GYM_CONFIG_PATH), with the ports they listen on.
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
import yaml
from child_env import one_thread_env
from gym_processes import descendants, gone, gym_servers_under, port_closed, wait_until_gone

REPO = Path(__file__).resolve().parents[2]
ROWS = REPO / "examples" / "data" / "gym_arithmetic.jsonl"
pytestmark = pytest.mark.timeout(900)
COUNTS = {"agent_alpha": 2, "_default": 1}
NUM_PROMPTS = 8  # of the 16 rows: 12 completions, room for two stops of 2+ lines each and a run that finishes


def start(script: str, args: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, str(REPO / "examples" / script), *args], cwd=REPO, env=one_thread_env(),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=interruptible)


def interruptible() -> None:
    """In the child, before exec: SIGINT back to its default (a test run started as a background job of a
    shell without job control has SIGINT ignored, and its children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(proc: subprocess.Popen, ready, log: Path, within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited (rc {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} after {within_s} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


def signal_and_check(proc: subprocess.Popen, sig: signal.Signals, log: Path) -> tuple[float, float]:
    """Send `sig` once Gym is up; returns (seconds to exit, seconds until every child and port was gone)."""
    gym = gym_servers_under(proc.pid)
    assert {"agent_alpha", "agent_beta", "arithmetic_equivalence", "policy_model"} <= set(gym), gym
    pids = descendants(proc.pid)  # the Gym servers, the launcher's watchdog, anything else it started
    ports = [port for server in gym.values() for port in server.ports]
    assert ports and not any(port_closed(p) for p in ports)
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 120 s after {sig.name}:\n{log.read_text()[-3000:]}") from None
    exited = time.monotonic() - sent
    cleaned = wait_until_gone(pids, ports, 30 if sig == signal.SIGKILL else 0.5)
    left = [p for p in pids if not gone(p)] + [f"port {p}" for p in ports if not port_closed(p)]
    for pid in pids:  # never leave anything behind, even when the assertion below fails
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"left running after {sig.name}: {left}\n{log.read_text()[-3000:]}"
    print(f"\n{sig.name}: exit {exited:.2f} s after the signal; {len(pids)} child process(es) and "
          f"{len(ports)} port(s) gone {max(exited, cleaned):.2f} s after it; left: 0")
    return exited, cleaned


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]  # every line is whole JSON


# ---- the nemo_gym eval --------------------------------------------------------------------------


def eval_args(tiny_model_dir: Path, gym_venv: Path, out: Path) -> list[str]:
    return [
        "--config", "examples/configs/evals/nemo_gym_eval.yaml",
        f"policy.model_name={tiny_model_dir}",
        f"eval.save_path={out}",
        f"rollouts.gym.launch.gym_venv={gym_venv}",
        "rollouts.num_generations_per_prompt={agent_alpha: 2, _default: 1}",
        "eval.ks=[1,2]",
        f"eval.num_prompts={NUM_PROMPTS}",
        "eval.max_concurrent_prompts=1",
        "policy.generation.max_new_tokens=32",
        "--no-progress",
    ]


def expected_completions() -> int:
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()[:NUM_PROMPTS]]
    return sum(COUNTS.get(r["agent_ref"]["name"], COUNTS["_default"]) for r in rows)


@pytest.mark.gym
def test_sigterm_then_sigint_to_the_nemo_gym_eval_stop_every_gym_server_and_each_run_resumes(
    tiny_model_dir, gym_venv, tmp_path
):
    """SIGTERM to a fresh eval, SIGINT to the run that resumes it, then a third run finishes the eval: each signal
    stops every Gym server and leaves whole lines that the next run resumes from. One chain of three runs instead
    of a fresh run and its resume per signal (four Gym launches): the signal path is the same in a resumed run."""
    out = tmp_path / "eval"
    completions = out / "completions.jsonl"
    expected = expected_completions()
    written = 0
    for k, sig in enumerate((signal.SIGTERM, signal.SIGINT)):
        log = tmp_path / f"run-{k}.log"
        proc = start("run_eval.py", eval_args(tiny_model_dir, gym_venv, out), log)
        # Gym is up and this run's first 2 groups are on disk
        wait_for(proc, lambda need=written + 2: completions.exists() and completions.read_bytes().count(b"\n") >= need,
                 log, 400, "completions")
        signal_and_check(proc, sig, log)
        text = log.read_text()
        assert proc.returncode == 128 + sig, text[-3000:]
        assert f"stopped by {sig.name}" in text and "Traceback" not in text, text[-3000:]
        if written:
            assert f"resume: {written} completion(s) already in" in text, text[-3000:]
        now = len(read_lines(completions))
        assert written + 2 <= now < expected and not (out / "summary.json").exists()
        written = now

    again = tmp_path / "last.log"
    rerun = start("run_eval.py", eval_args(tiny_model_dir, gym_venv, out), again)
    assert rerun.wait(600) == 0, again.read_text()[-3000:]
    assert f"resume: {written} completion(s) already in" in again.read_text()
    final = read_lines(completions)
    assert len(final) == expected
    assert len({(x["prompt_idx"], x["sample_idx"]) for x in final}) == expected
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_completions"] == expected


@pytest.mark.gym
def test_sigkill_to_the_nemo_gym_eval_leaves_no_gym_server(tiny_model_dir, gym_venv, tmp_path):
    out = tmp_path / "eval"
    log = tmp_path / "first.log"
    proc = start("run_eval.py", eval_args(tiny_model_dir, gym_venv, out), log)
    completions = out / "completions.jsonl"
    # Gym is up and the first groups are on disk
    wait_for(proc, lambda: completions.exists() and completions.read_bytes().count(b"\n") >= 2, log, 400,
             "completions")
    signal_and_check(proc, signal.SIGKILL, log)
    assert proc.returncode == -signal.SIGKILL  # the resume after a SIGKILL is tested in test_eval.py


# ---- GRPO ---------------------------------------------------------------------------------------


def grpo_config(tmp_path: Path, gym_venv: Path | None) -> Path:
    from nemo_rl_ext.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0, initializer_range=0.05)
    rows = [json.loads(line) for line in ROWS.read_text().splitlines()]
    data = tmp_path / "rows.jsonl"
    if gym_venv is not None:  # Gym rows with a dense reward
        data.write_text("".join(json.dumps({**r, "expected_answer": "what is the answer to it"}) + "\n"
                                for r in rows))
    else:
        data.write_text("".join(json.dumps({"question": f"Say yes. {i}", "answer": "yes"}) + "\n"
                                for i in range(8)))
    cfg = {
        "policy": {"model_name": str(model_dir), "max_model_len": 512,
                   "generation": {"max_new_tokens": 8, "temperature": 1.0}},
        "data": {"train_path": str(data), "shuffle": False},
        "rollouts": {"num_generations_per_prompt": 4, "max_seq_len": 256},
        "grpo": {"num_prompts_per_step": 2, "max_num_steps": 200, "seed": 3, "save_period": 1},
        "optimizer": {"lr": 1.0e-3, "micro_batch_size": 8},
        # the loss before the defaults became NeMo-RL's (KL 0.01, IS off)
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": True},
        "keep_last_checkpoints": None,
    }
    if gym_venv is not None:
        cfg["rollouts"] |= {"mode": "nemo_gym", "gym": {"launch": {
            "gym_venv": str(gym_venv),
            "config_paths": [str(REPO / "tests/functional/gym_configs/dense_arithmetic_agents.yaml")]},
            "row_timeout_s": 120}}
    else:
        cfg["rollouts"]["env"] = {"name": "string_match", "kwargs": {"mode": "similarity"}}
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def sigterm_grpo_then_resume(tmp_path: Path, config: Path, gym: bool) -> None:
    from nemo_rl_ext.grpo.metrics_logger import read_metrics
    from nemo_rl_ext.training.checkpoint import latest_checkpoint, load_checkpoint

    run_dir = tmp_path / "run"
    log = tmp_path / "first.log"
    proc = start("run_grpo.py", ["--config", str(config), f"output_dir={run_dir}"], log)
    marker = run_dir / "checkpoints" / f"step_{1:08d}" / "state.json"
    wait_for(proc, marker.exists, log, 400, "checkpoint of step 1")
    if gym:
        signal_and_check(proc, signal.SIGTERM, log)
    else:
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        print(f"\nnative GRPO: exit {time.monotonic() - sent:.2f} s after SIGTERM")
    text = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "stopped by SIGTERM" in text and "resume=true" in text and "Traceback" not in text, text[-3000:]
    assert not list((run_dir / "checkpoints").glob(".step_*"))  # no half-written checkpoint folder
    k = load_checkpoint(latest_checkpoint(run_dir / "checkpoints")).step

    again = tmp_path / "second.log"
    rerun = start("run_grpo.py", ["--config", str(config), f"output_dir={run_dir}", "resume=true",
                                  f"grpo.max_num_steps={k + 1}"], again)
    assert rerun.wait(600) == 0, again.read_text()[-3000:]
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, k + 2))


@pytest.mark.gym
def test_sigterm_to_nemo_gym_grpo_stops_every_gym_server_and_resumes(gym_venv, tmp_path):
    sigterm_grpo_then_resume(tmp_path, grpo_config(tmp_path, gym_venv), gym=True)


def test_sigterm_to_native_grpo_leaves_a_resumable_run(tmp_path):
    sigterm_grpo_then_resume(tmp_path, grpo_config(tmp_path, None), gym=False)
