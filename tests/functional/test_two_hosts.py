"""Two real hosts on one machine (`two_hosts.TwoHosts`: network namespaces with their own addresses, a Ray head in
one and a worker node in the other, sharing nothing but the link and the file system), drivers run on the head
host (`two_hosts_driver.py`) through the project's own config (`policy.cluster.address`):

- an eval on Ray workers on both hosts merges to the bytes of one host's run;
- a replica pool spread over both hosts answers every request when the worker host is lost mid-run, and an eval
  whose worker host is lost finishes on the head host, merging to the same bytes;
- FSDP2 trainer ranks on both hosts (the rendezvous on rank 0's host address) train as one process does; the
  worker host lost mid-step stops the run naming the lost rank and its node; the run resumes from the checkpoint
  in the shared folder and completes.

One cluster for the whole module (the worker node started again after a test took it away). Skipped where the
machine cannot make network namespaces (not root, no `ip`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_eval_ray_shards import config as eval_config
from test_eval_shard_jobs import NUM_PROMPTS, SAMPLES, overrides, same_report, same_summary
from test_trainer_workers import (  # noqa: F401 (config_file: a fixture, used by name)
    _assert_same_train_metrics,
    assert_resumed_step,
    checkpoint_weights,
    config_file,
)
from tolerances import AdamRecord, assert_trained_weights_close
from two_hosts import TwoHosts, why_not_possible

from nemo_rl_ext.config import load_config
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.evals.ray_lease_queue import EVENTS_FILE
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.training.checkpoint import checkpoint_dir

HERE = Path(__file__).resolve().parent
DRIVER = [sys.executable, str(HERE / "two_hosts_driver.py")]
DRIVER_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    """The two hosts and their Ray cluster, made once for the module; every process, namespace and link removed
    after its last test, failed or not."""
    reason = why_not_possible()
    if reason is not None:
        pytest.skip(reason)
    two = TwoHosts()
    try:
        two.make()
        yield two
    finally:
        left = two.close()
    assert not left, f"Ray processes outlived the cluster: {left}"


def both_hosts_up(hosts: TwoHosts) -> TwoHosts:
    """The worker node started again if an earlier test lost it."""
    try:
        hosts.raylet(hosts.worker)
    except ValueError:
        hosts.start_node(hosts.worker)
    return hosts


def start(hosts: TwoHosts, *args: str, shared: Path) -> subprocess.Popen:
    """Start the driver on the head host (its output in `shared/<command>.log`)."""
    return hosts.popen_in(hosts.head, [*DRIVER, *args], shared / f"{args[0]}.log")


def finish(proc: subprocess.Popen, shared: Path, command: str) -> tuple[int, dict, str]:
    """Wait for the driver; (exit code, its JSON, the end of its output)."""
    try:
        proc.wait(timeout=DRIVER_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    found = shared / f"{command}.json"
    out = (shared / f"{command}.log").read_text(errors="replace")[-4000:]
    return proc.returncode, json.loads(found.read_text()) if found.exists() else {}, out


def drive(hosts: TwoHosts, *args: str, shared: Path) -> tuple[int, dict, str]:
    """Run the driver on the head host to its end."""
    return finish(start(hosts, *args, shared=shared), shared, args[0])


def wait_for(predicate, what: str, proc: subprocess.Popen, shared: Path, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            log = sorted(shared.glob("*.log"))[-1].read_text(errors="replace")
            raise AssertionError(f"the driver ended before {what}: {log[-4000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def one_host(tiny_model_dir, generation, tmp_path_factory) -> Path:
    """The eval as one static shard in this process (one host, no Ray): the bytes both-host runs must merge to."""
    root = tmp_path_factory.mktemp("one_host") / "run"
    result = run_eval(eval_config(tiny_model_dir, root, "eval.shard=0/1"), generation=generation, progress=False)
    assert result.summary is not None
    return root


def cluster_override(hosts: TwoHosts, **extra: object) -> str:
    """`policy.cluster` pointing at the head's GCS address; each eval worker reserves one whole node (1 CPU)."""
    fields = {"address": hosts.address, "replica": {"num_cpus": 1}, **extra}
    return f"policy.cluster={json.dumps(fields)}"


@pytest.mark.timeout(400)
def test_an_eval_on_workers_on_two_hosts_merges_to_the_bytes_of_one_host(hosts, tiny_model_dir, one_host,
                                                                         tmp_path) -> None:
    hosts = both_hosts_up(hosts)
    root = tmp_path / "run"
    code, found, out = drive(hosts, "eval", str(tmp_path), *overrides(
        tiny_model_dir, root, "eval.ray_workers=2", "eval.max_concurrent_prompts=1", cluster_override(hosts)),
        shared=tmp_path)
    assert code == 0, out[-4000:]
    assert found["complete"] and found["groups_generated"] == NUM_PROMPTS
    assert sorted(found["worker_nodes"].values()) == [hosts.head.ip, hosts.worker.ip]  # one worker on each host
    assert (root / "completions.jsonl").read_bytes() == (one_host / "completions.jsonl").read_bytes()
    assert same_summary(root / "summary.json", one_host / "summary.json")
    assert same_report(root, one_host)


@pytest.mark.timeout(400)
def test_a_pool_over_two_hosts_answers_everything_when_the_worker_host_is_lost(hosts, tmp_path) -> None:
    hosts = both_hosts_up(hosts)
    proc = start(hosts, "pool", hosts.address, str(tmp_path), shared=tmp_path)
    wait_for(lambda: (tmp_path / "in_flight").exists(), "requests in flight", proc, tmp_path)
    hosts.lose_worker()
    (tmp_path / "lost").write_text("")
    code, found, out = finish(proc, tmp_path, "pool")
    assert code == 0, out[-4000:]
    assert sorted(found["placed"]) == [hosts.head.ip, hosts.worker.ip]  # one replica on each host
    assert all(n > 0 for n in found["in_flight_at_loss"]), found
    assert found["answered"] == found["requests"] == 40  # nothing lost
    assert found["retries"] >= 1 and found["restarts"] >= 1
    assert found["answered_after"] == 8 and found["live_replicas_on"] == [hosts.head.ip] * 2, found


@pytest.mark.timeout(400)
def test_an_eval_whose_worker_host_is_lost_finishes_on_the_head_host(hosts, tiny_model_dir, one_host,
                                                                     tmp_path) -> None:
    hosts = both_hosts_up(hosts)
    root = tmp_path / "run"
    met = tmp_path / "worker_nodes"
    proc = start(hosts, "eval", str(tmp_path), *overrides(
        tiny_model_dir, root, "eval.ray_workers=2", "eval.max_concurrent_prompts=1",
        cluster_override(hosts, max_failures=1)), shared=tmp_path)  # taken out at its first death: host A finishes

    def lost_worker_wrote_two_prompts() -> bool:
        on_worker = [p.name for p in met.iterdir() if p.read_text() == hosts.worker.ip] if met.exists() else []
        store = root / "shards" / (on_worker[0] if on_worker else "-") / "completions.jsonl"
        return store.exists() and store.read_bytes().count(b"\n") >= 2 * SAMPLES

    wait_for(lost_worker_wrote_two_prompts, "two prompts from the worker host", proc, tmp_path)
    hosts.lose_worker()
    code, found, out = finish(proc, tmp_path, "eval")
    assert code == 0, out[-4000:]
    assert found["complete"]
    died = [json.loads(x) for x in (root / EVENTS_FILE).read_text().splitlines() if '"died"' in x]
    assert [d["worker"] for d in died] == [p for p, ip in found["worker_nodes"].items() if ip == hosts.worker.ip]
    assert (root / "completions.jsonl").read_bytes() == (one_host / "completions.jsonl").read_bytes()
    assert same_summary(root / "summary.json", one_host / "summary.json")


@pytest.mark.timeout(600)
def test_trainer_ranks_on_two_hosts_train_as_one_process_and_a_lost_host_stops_the_run_naming_its_rank(
    hosts, config_file, one_torch_thread, tmp_path  # noqa: F811 (the fixture imported above)
) -> None:
    """4 GRPO steps in this process (one process, no Ray) and on 2 FSDP2 ranks, one on each host (the driver on the
    head host; generation on one replica of the same cluster). The worker host is lost once step 3's checkpoint is
    complete: the run stops naming the rank that was there and its node. Steps 1-3 match one process's; the run
    resumed from step 3's checkpoint in the shared folder completes step 4, which matches one process's."""
    hosts = both_hosts_up(hosts)
    # one Adam step per GRPO step (fewer steps to compare)
    four = ["grpo.max_num_steps=4", "optimizer.minibatches_per_step=1"]
    one_dir, out = tmp_path / "one", tmp_path / "two"
    cfg = load_config(config_file, [f"output_dir={one_dir}", *four], GRPOConfig)
    with GRPO(cfg) as run:  # the reference path: its gradients, for Adam's rule on the ranks' weights
        record = AdamRecord(run.trainer.optimizer,
                            {k: p for k, p in run.trainer.model.named_parameters() if p.requires_grad})
        run.run()
    one = read_metrics(one_dir / "metrics.jsonl")

    cluster = f"policy.cluster={json.dumps({'address': hosts.address, 'replica': {'num_cpus': 0}})}"
    ranks = [f"output_dir={out}", "trainer.workers=2", cluster, *four]
    proc = start(hosts, "grpo", str(config_file), str(tmp_path), *ranks, shared=tmp_path)
    step_3 = checkpoint_dir(out / "checkpoints", 3) / "complete.json"
    wait_for(step_3.exists, "step 3's checkpoint", proc, tmp_path)
    lost_at = time.time()
    hosts.lose_worker()
    code, found, output = finish(proc, tmp_path, "grpo")
    assert code == 3, output[-4000:]
    workers = found["workers"]
    assert sorted(w["ip"] for w in workers) == [hosts.head.ip, hosts.worker.ip]  # one rank on each host
    (lost,) = [w for w in workers if w["ip"] == hosts.worker.ip]
    message = found["error"]
    assert f"rank {lost['rank']} (pid {lost['pid']}) on node {lost['node_id']} ({hosts.worker.ip})" in message, message
    # at once when Ray's call to the lost rank is refused, else once Ray's health checks declare the node dead
    # (measured: 1.5 to 21 s after the loss)
    assert found["raised_at"] - lost_at < 120, message
    print(f"stopped {found['raised_at'] - lost_at:.1f} s after the loss: {message[:600]}")

    two = read_metrics(out / "metrics.jsonl")
    assert [m["step"] for m in two] == [1, 2, 3]
    _assert_same_train_metrics(one[:3], two)
    for step in (1, 2, 3):  # Adam's rule for two paths (tests/tolerances.py): a noise gradient's element may be
        # up to 2 lr a step apart (3 elements were 4.4e-6 apart at step 1, beyond a fitted 2e-6), a real one not
        w1, w2 = checkpoint_weights(one_dir, step), checkpoint_weights(out, step)
        assert w2.keys() == {*w1, "lm_head.weight"} and w1.keys() == record.initial.keys()
        assert_trained_weights_close(w1, w2, initial=record.initial, record=record.at(step), lr=cfg.optimizer.lr)

    hosts = both_hosts_up(hosts)
    (tmp_path / "grpo.json").unlink()
    code, found, output = drive(hosts, "grpo", str(config_file), str(tmp_path), *ranks, "resume=true", shared=tmp_path)
    assert code == 0, output[-4000:]
    assert found["resumed_from"] == 3 and found["step"] == 4
    assert sorted(w["ip"] for w in found["workers"]) == [hosts.head.ip, hosts.worker.ip]
    (resumed,) = [m for m in read_metrics(out / "metrics.jsonl") if m["step"] == 4]
    assert_resumed_step(resumed, one[3], exact=False)
