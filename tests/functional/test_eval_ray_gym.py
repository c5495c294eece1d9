"""A nemo_gym eval on 2 Ray workers (the session's local Ray, the tiny model through a real NeMo Gym): each worker
launches its own Gym on its own ports, each store keeps its gym_rows.jsonl, the merge equals a 1-shard run's (but
for Gym's per-call ids and float noise in the logprobs: see `gym_stable`), and no Gym server outlives the run."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import psutil
import pytest
from gym_processes import wait_until_gone
from test_eval_shard_jobs import same_report, same_summary, timings_complete

from nemo_rl_ext.config import load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.evals.ray_lease_queue import EVENTS_FILE

REPO = Path(__file__).resolve().parents[2]
WORKER_CPUS = "policy.cluster={replica: {num_cpus: 0.5}}"  # two workers fit the session's 2-CPU Ray with room
NUM_PROMPTS = 6
NUM_SAMPLES = 9  # agent_alpha (prompts 0, 2, 4) x 2 + agent_beta (1, 3, 5) x 1


def config(tiny_model_dir: Path, gym_venv: Path, save_path: Path, *extra: str) -> EvalConfig:
    return load_config(
        REPO / "examples" / "configs" / "evals" / "nemo_gym_eval.yaml",
        [f"policy.model_name={tiny_model_dir}", "policy.max_model_len=512", "rollouts.max_seq_len=512",
         "policy.generation.max_new_tokens=8", f"eval.save_path={save_path}",
         f"eval.dataset_path={REPO / 'examples' / 'data' / 'gym_arithmetic.jsonl'}", f"eval.num_prompts={NUM_PROMPTS}",
         "rollouts.num_generations_per_prompt={agent_alpha: 2, _default: 1}", "eval.ks=[1,2]",
         f"rollouts.gym.launch.gym_venv={gym_venv}",
         f"rollouts.gym.launch.config_paths=[{REPO / 'examples' / 'configs' / 'gym' / 'arithmetic_agents.yaml'}]",
         *extra],
        EvalConfig,
    )


class GymWatch:
    """Every Gym server process among this process's descendants (Ray's workers are), polled in a thread:
    pid -> (its parent, the instance name, the ports it listens on)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, str, tuple[int, ...]]] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        me = psutil.Process(os.getpid())
        while not self._done.wait(0.3):
            for child in me.children(recursive=True):
                try:
                    name = child.environ().get("NEMO_GYM_CONFIG_PATH")
                    if name:
                        ports = tuple(sorted({c.laddr.port for c in child.net_connections("tcp")
                                              if c.status == psutil.CONN_LISTEN}))
                        old = self.seen.get(child.pid, (0, "", ()))[2]
                        self.seen[child.pid] = (child.ppid(), name, ports or old)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    pass

    def __enter__(self) -> GymWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=10)


@pytest.mark.gym
@pytest.mark.timeout(900)
def test_nemo_gym_on_two_ray_workers_each_launch_gym_and_merge_as_one_shard(
    local_ray, gym_venv, tiny_model_dir, tmp_path
) -> None:
    one = run_eval(config(tiny_model_dir, gym_venv, tmp_path / "one", "eval.shard=0/1"), progress=False)
    assert one.summary is not None and one.completions_written == NUM_SAMPLES

    root = tmp_path / "ray"
    cfg = config(tiny_model_dir, gym_venv, root, "eval.ray_workers=2", "eval.max_concurrent_prompts=1", WORKER_CPUS)
    with GymWatch() as watch:
        result = run_eval(cfg, progress=False)
    assert result.complete and result.summary is not None and result.summary.rollout_mode == "nemo_gym"
    assert result.groups_generated == NUM_PROMPTS and result.completions_written == NUM_SAMPLES
    merged = (root / "completions.jsonl").read_bytes()
    ours, ref = merged.splitlines(), (tmp_path / "one" / "completions.jsonl").read_bytes().splitlines()
    assert len(ours) == len(ref) == NUM_SAMPLES
    for a, b in zip(ours, ref, strict=True):  # equal but for what Gym makes up per call and float noise
        (a, a_logprobs), (b, b_logprobs) = gym_stable(a), gym_stable(b)
        assert a == b
        assert a_logprobs == pytest.approx(b_logprobs, rel=1e-4, abs=1e-4)  # engine logprobs: tests/tolerances.py
    assert same_summary(root / "summary.json", tmp_path / "one" / "summary.json")
    assert same_report(root, tmp_path / "one") and timings_complete(root, NUM_SAMPLES)
    assert result.summary.gym_metrics is None  # Gym's own aggregate needs a live Gym: not in a merged summary
    assert all(json.loads(x)["error"] is None for x in merged.splitlines())  # every sample went through Gym

    stores = [root / "shards" / f"worker-{k}" for k in range(2)]
    held = [json.loads((s / "shard.json").read_text())["prompts"] for s in stores]
    assert sorted(held[0] + held[1]) == list(range(NUM_PROMPTS)) and held[0] and held[1], held
    rows = (tmp_path / "one" / "shards" / "0-of-1" / "gym_rows.jsonl").read_bytes()
    assert rows.count(b"\n") == NUM_SAMPLES
    for store in stores:  # each store materialized every row it may send (resumes send these)
        assert (store / "gym_rows.jsonl").read_bytes() == rows

    # each worker launched its own Gym (3 servers), on ports of its own, as a child of its own process
    by_worker: dict[int, dict[str, tuple[int, ...]]] = {}
    for parent, name, ports in watch.seen.values():
        by_worker.setdefault(parent, {})[name] = ports
    assert len(by_worker) == 2, watch.seen
    names = {"arithmetic_equivalence", "agent_alpha", "agent_beta", "policy_model"}
    assert all(set(servers) == names for servers in by_worker.values()), by_worker
    ports = [p for servers in by_worker.values() for ps in servers.values() for p in ps]
    assert ports and len(ports) == len(set(ports)), by_worker
    # ... and every one of them is gone once run_eval returned
    assert wait_until_gone(list(watch.seen), ports, within_s=30) < 30, watch.seen
    left = [c.pid for c in psutil.Process(os.getpid()).children(recursive=True)
            if c.is_running() and _gym_name(c)]
    assert not left, left

    again = run_eval(cfg, progress=False)  # resume: nothing left to roll out, the same merge, no worker started
    assert again.groups_generated == 0 and again.skipped_completions == NUM_SAMPLES
    assert (root / "completions.jsonl").read_bytes() == merged
    runs = [json.loads(x) for x in (root / EVENTS_FILE).read_text().splitlines()]
    assert [(e["event"], e.get("total")) for e in runs][-2:] == [("finished", NUM_PROMPTS), ("finished", 0)], runs
    assert [e["event"] for e in runs].count("started") == 2, runs


def gym_stable(raw: bytes) -> tuple[dict, list[float]]:
    """A completion line without what Gym makes up for each call (the response's `id` and `created_at`, each
    output item's `id`), and apart from it the generation logprobs (equal up to float noise: the engine's
    batches hold whichever requests arrived together)."""
    line = json.loads(raw)
    response = line["env_extras"]["gym_result"]["response"]
    del response["id"], response["created_at"]
    logprobs = []
    for item in response["output"]:
        item.pop("id", None)
        logprobs += item.pop("generation_log_probs", [])
    return line, logprobs


def _gym_name(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get("NEMO_GYM_CONFIG_PATH")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
