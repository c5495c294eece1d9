"""An eval on 2 Ray workers pulling prompts from a shared queue (the session's local Ray, the tiny model): the merged
files equal those of a 1-shard run; a worker killed mid-run gives its prompts back to the queue and the run still
merges to the same bytes."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_eval_shard_jobs import NUM_PROMPTS, SAMPLES, overrides, same_report, same_summary, timings_complete

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.evals.ray_lease_queue import EVENTS_FILE, run_ray_eval

REPO = Path(__file__).resolve().parents[2]
WORKER_CPUS = "policy.cluster={replica: {num_cpus: 0.5}}"  # two workers fit the session's 2-CPU Ray with room


def config(tiny_model_dir: Path, save_path: Path, *extra: str) -> EvalConfig:
    return load_config(REPO / "examples/configs/evals/eval.yaml", overrides(tiny_model_dir, save_path, *extra),
                       EvalConfig)


@pytest.fixture(scope="module")
def one_shard(tiny_model_dir, generation, tmp_path_factory) -> Path:
    """The run as one static shard (in this process); its merge is the reference."""
    root = tmp_path_factory.mktemp("one") / "run"
    result = run_eval(config(tiny_model_dir, root, "eval.shard=0/1"), generation=generation, progress=False)
    assert result.summary is not None
    return root


def held_prompts(store: Path) -> list[int]:
    return json.loads((store / "shard.json").read_text())["prompts"]


def events(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / EVENTS_FILE).read_text().splitlines()]


def wait_for_each_other(folder: Path, deadline_s: float = 120.0):
    """A worker hook (pickled by value): after its first prompt is on disk, a worker waits (at most `deadline_s`)
    until the other worker has written one too. Workers start seconds apart (a new Ray process, torch, the model,
    the grading pool), and the tiny model's 24 prompts take one worker about as long: without the wait, which
    worker pulls what is a race (one worker pulled all 24 once on a loaded machine)."""

    def on_written(worker: str, group: int, prompt: int) -> None:
        mine = folder / worker
        if mine.exists():
            return
        mine.write_text(f"{prompt}\n")
        end = time.monotonic() + deadline_s
        while len(list(folder.iterdir())) < 2 and time.monotonic() < end:
            time.sleep(0.05)

    return on_written


@pytest.mark.timeout(400)
def test_two_ray_workers_merge_to_the_bytes_of_one_shard(local_ray, tiny_model_dir, one_shard, tmp_path) -> None:
    root, met = tmp_path / "ray", tmp_path / "first-prompts"
    met.mkdir()
    result = run_ray_eval(config(tiny_model_dir, root, "eval.ray_workers=2", "eval.max_concurrent_prompts=1",
                                 WORKER_CPUS), progress=False, on_written=wait_for_each_other(met))
    assert result.complete and result.summary is not None
    assert result.groups_generated == NUM_PROMPTS and result.completions_written == NUM_PROMPTS * SAMPLES

    merged = (root / "completions.jsonl").read_bytes()
    assert merged == (one_shard / "completions.jsonl").read_bytes()
    assert merged.count(b"\n") == NUM_PROMPTS * SAMPLES
    assert same_summary(root / "summary.json", one_shard / "summary.json")
    assert same_report(root, one_shard) and timings_complete(root, NUM_PROMPTS * SAMPLES)
    stores = sorted(p.name for p in (root / "shards").iterdir())
    assert stores == ["worker-0", "worker-1"]
    held = [held_prompts(root / "shards" / s) for s in stores]
    assert sorted(held[0] + held[1]) == list(range(NUM_PROMPTS))  # every prompt once: pulled, not sliced
    assert held[0] and held[1], held  # both workers pulled prompts
    runs = [json.loads((root / "shards" / s / "runs.jsonl").read_text()) for s in stores]  # one line each
    assert all(list(r) == ["worker", "groups_generated", "completions_written", "errors_written", "wall_time_s"]
               for r in runs)
    assert sorted(r["worker"] for r in runs) == stores and sum(r["groups_generated"] for r in runs) == NUM_PROMPTS
    assert [e["event"] for e in events(root)] == ["started", "started", "finished"]

    again = run_eval(config(tiny_model_dir, root, "eval.ray_workers=2", WORKER_CPUS), progress=False)
    assert again.groups_generated == 0 and again.skipped_completions == NUM_PROMPTS * SAMPLES  # resume: nothing
    assert (root / "completions.jsonl").read_bytes() == merged
    resumed = events(root)[3:]  # ... and no worker started for it: it only merged
    assert [(e["event"], e["total"]) for e in resumed] == [("finished", 0)], resumed
    with pytest.raises(ConfigError, match=r"policy.generation.max_new_tokens"):  # a changed config: before Ray work
        run_eval(config(tiny_model_dir, root, "eval.ray_workers=2", WORKER_CPUS, "policy.generation.max_new_tokens=9"),
                 progress=False)


@pytest.mark.timeout(400)
def test_seeds_on_two_ray_workers_merge_as_seed_jobs_do(local_ray, tiny_model_dir, generation, tmp_path) -> None:
    few = ("eval.num_prompts=8", "eval.seeds=[3,7]")
    jobs = run_eval(config(tiny_model_dir, tmp_path / "jobs", *few), generation=generation, progress=False)
    ray = run_eval(config(tiny_model_dir, tmp_path / "ray", *few, "eval.ray_workers=2", WORKER_CPUS), progress=False)
    assert jobs.summary is not None and ray.summary is not None
    for seed in ("3", "7"):
        a, b = tmp_path / "jobs" / "seeds" / seed, tmp_path / "ray" / "seeds" / seed
        assert (a / "completions.jsonl").read_bytes() == (b / "completions.jsonl").read_bytes()
        assert same_summary(a / "summary.json", b / "summary.json")
        assert sorted(p.name for p in (b / "shards").iterdir()) == ["worker-0", "worker-1"]
    assert same_summary(tmp_path / "jobs" / "summary.json", tmp_path / "ray" / "summary.json")
    assert ray.summary.metrics["num_samples"] == 8 * SAMPLES * 2


def kill_worker_1_during_a_run(local_ray, tiny_model_dir, root: Path, max_failures: int, met: Path):
    """Run 2 Ray workers into `root`, killing worker-1 once it has written 2 prompts; (killed actors, result).
    `met`: an empty folder for `wait_for_each_other` (without it worker-0 could pull every prompt before worker-1
    started, and the attempt was wasted: CI's runs of this test took 28-79 s, one attempt is about 28)."""
    victim_store = root / "shards" / "worker-1" / "completions.jsonl"
    killed: list[str] = []
    run_over = threading.Event()

    def kill_worker_1() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not run_over.is_set():
            started = [e for e in events(root) if e["event"] == "started" and e["worker"] == "worker-1"] \
                if (root / EVENTS_FILE).exists() else []
            if started and victim_store.exists() and victim_store.read_bytes().count(b"\n") >= 2 * SAMPLES:
                local_ray.kill(local_ray.get_actor(started[0]["actor"]), no_restart=True)
                killed.append(started[0]["actor"])
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_worker_1, daemon=True)
    killer.start()
    cfg = config(tiny_model_dir, root, "eval.ray_workers=2", "eval.max_concurrent_prompts=1", WORKER_CPUS,
                 f"policy.cluster.max_failures={max_failures}")
    try:
        result = run_ray_eval(cfg, progress=False, on_written=wait_for_each_other(met))
    finally:
        run_over.set()
        killer.join(timeout=10)
    return killed, result


@pytest.mark.timeout(400)
@pytest.mark.parametrize("max_failures", [1, 2], ids=["taken-out", "restarted"])
def test_a_killed_worker_gives_its_prompts_back_and_the_merge_is_unchanged(
    local_ray, tiny_model_dir, one_shard, tmp_path, max_failures
) -> None:
    for attempt in range(3):  # the kill must land mid-run: on a loaded machine worker-1 may finish first
        root = tmp_path / f"killed-{attempt}"
        met = tmp_path / f"first-prompts-{attempt}"
        met.mkdir()
        killed, result = kill_worker_1_during_a_run(local_ray, tiny_model_dir, root, max_failures, met)
        if killed:
            break
    assert killed, "worker-1 finished before it could be killed, 3 times"
    assert result.complete and result.summary is not None

    log = events(root)
    [died] = [e for e in log if e["event"] == "died"]
    assert died["worker"] == "worker-1" and died["restarted"] is (max_failures > 1)
    assert died["requeued"] or died["recovered"], "worker-1 held no prompt when it was killed"
    requeued = {p for _, p in died["requeued"]}
    starts = [e["worker"] for e in log if e["event"] == "started"]
    assert sorted(starts) == (["worker-0", "worker-1", "worker-1"] if max_failures > 1 else ["worker-0", "worker-1"])
    assert log[-1]["event"] == "finished" and log[-1]["requeued"] == len(requeued)

    held = {s.name: held_prompts(s) for s in (root / "shards").iterdir()}
    assert set().union(*held.values()) == set(range(NUM_PROMPTS))
    if max_failures == 1:  # taken out: worker-0 rolled out what worker-1 held when it died
        assert requeued <= set(held["worker-0"])
    assert (root / "completions.jsonl").read_bytes() == (one_shard / "completions.jsonl").read_bytes()
    assert same_summary(root / "summary.json", one_shard / "summary.json")


def die_once_after_writing(marker: Path):
    """A worker hook (`run_ray_eval(on_written=...)`, pickled by value): worker-1 SIGKILLs itself right after its
    first prompt's lines are on disk, before it lists the prompt in shard.json or reports it to the queue."""

    def on_written(worker: str, group: int, prompt: int) -> None:
        if worker == "worker-1" and not marker.exists():
            marker.write_text(f"{prompt}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    return on_written


def result_lines(store: Path) -> list[tuple[int, int]]:
    rows = [json.loads(x) for x in (store / "completions.jsonl").read_bytes().splitlines()]
    return [(x["prompt_idx"], x["sample_idx"]) for x in rows if x["stop_reason"] != "error"]


@pytest.mark.timeout(900)
def test_a_worker_killed_between_writing_and_reporting_a_prompt_leaves_it_in_one_store(
    local_ray, tiny_model_dir, one_shard, tmp_path
) -> None:
    for attempt in range(3):  # on a loaded machine worker-0 may take every prompt before worker-1 has loaded
        root = tmp_path / f"ray-{attempt}"
        marker = tmp_path / f"killed-after-prompt-{attempt}"
        cfg = config(tiny_model_dir, root, "eval.ray_workers=2", "eval.max_concurrent_prompts=1", WORKER_CPUS,
                     "policy.cluster.max_failures=1")  # taken out at its first death: worker-0 finishes the queue
        result = run_ray_eval(cfg, progress=False, on_written=die_once_after_writing(marker))
        if marker.exists():
            break
    assert marker.exists(), "worker-1 wrote no prompt, 3 times"
    killed_after = int(marker.read_text())
    assert result.complete and result.summary is not None

    stores = [root / "shards" / f"worker-{k}" for k in range(2)]
    pairs = [pair for store in stores for pair in result_lines(store)]
    assert sorted(pairs) == [(p, s) for p in range(NUM_PROMPTS) for s in range(SAMPLES)]  # each in exactly one store
    [died] = [e for e in events(root) if e["event"] == "died"]
    assert died["worker"] == "worker-1" and died["restarted"] is False
    # its prompt was on disk but unreported: found there and listed, not handed to worker-0
    assert died["recovered"] == [[0, killed_after]] and died["requeued"] == []
    assert killed_after in held_prompts(root / "shards" / "worker-1")
    assert killed_after not in held_prompts(root / "shards" / "worker-0")

    assert (root / "completions.jsonl").read_bytes() == (one_shard / "completions.jsonl").read_bytes()
    assert same_summary(root / "summary.json", one_shard / "summary.json")
    assert same_report(root, one_shard) and timings_complete(root, NUM_PROMPTS * SAMPLES)
