"""An eval on N Ray workers that lease prompts from a shared queue, each into its own store; then one merge.

    python examples/run_eval.py --config eval.yaml eval.ray_workers=2                       # a local Ray
    python examples/run_eval.py --config eval.yaml eval.ray_workers=8 policy.cluster.address=auto \\
        policy.cluster.replica.num_gpus=1                                                     # a cluster

The same pipeline as a run in one process (store_run.py), its steps spread over processes:
1. plan (`plan_run`, here): refuse a changed config against any worker store, then read every store's lines
   (ray_stores.py) and put every (seed, prompt) without a result for each sample into a `PromptQueue` actor
   (prompt_queue.py), with the samples some store holds as its skip set;
2. roll out and store (ray_worker.py): `eval.ray_workers` `EvalWorker` actors, each with its own engine from
   `policy` (`policy.cluster.replica` says what it reserves), keep `eval.max_concurrent_prompts` (default
   `DEFAULT_IN_FLIGHT`) prompts in flight, leasing one whenever one of its groups is done: no fixed slices, so a
   slow worker does not set the pace. Each group goes through the eval's roll-out step (`rollout.roll_out`)
   into the worker's store `<save_path>/[seeds/<seed>/]shards/worker-<k>/`;
3. summarise and report: when the queue is done, the merge (merge.py) writes the same sorted
   completions.jsonl, summary.json and report.md as a run in one process or as static shards, because every
   sample is seeded by (prompt, sample, turn) and the merge keys lines by (prompt, sample).

This process (the driver) starts or joins Ray from `policy.cluster` (null: a local Ray on 127.0.0.1) and watches
the workers (`WorkerPool`). In nemo_gym mode each worker (each group of it, with `eval.seeds`) serves its engine
on its own policy server (a free port) and, with `rollouts.gym.launch` (mode direct), launches its own Gym pointed
at it, when its first prompt starts; the Gym is stopped when the worker's `run` ends (or by `shutdown`; a killed
worker's Gym by the launcher's watchdog). The store keeps the rows it may send in gym_rows.jsonl (every prompt's,
written before the first is sent; a resumed worker sends those). A running Gym calls one policy URL, and ng_run's
head server has one port, so those need one policy server in all (config.py `_gym_worker_problems`). The merged
summary has no `gym_metrics` (merge.py).

A worker that dies (killed, out of memory, its node lost) is seen by the driver as its `run` call failing. The
driver then reads the dead worker's store (ray_stores.py): the prompts it holds every line of are added to its
shard.json and count as done (a worker writes a prompt's lines up to `FLUSH_S` before it reports them), and only
the other prompts it held go back to the front of the queue, with the samples its store holds results of as
their skip set. The worker is started again on the same store (a group already on disk is skipped, a torn last
line is cut) until it has died `policy.cluster.max_failures` times; then it is taken out and the others finish
the queue. A worker holding a lease older than `eval.ray_lease_timeout_s` is killed (it may hang), and its
prompts go back the same way once it is dead. So no prompt is rolled out into two stores. Every start, death and
requeue is a line in `<save_path>/ray_workers.jsonl` (`EVENTS_FILE`). A resumed run whose stores already hold a
result of every sample starts no worker (nor Ray): it only merges.

Each worker owns an engine (rather than sharing a replica pool) so that a worker's death takes exactly its
own prompts with it, and N workers are N independent engines, as N static shards are.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from nemo_rl_ext.cluster import init_ray, on_this_node
from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.merge import merge_run
from nemo_rl_ext.evals.plan import group_configs
from nemo_rl_ext.evals.prompt_queue import Item, PromptQueue, QueueStatus
from nemo_rl_ext.evals.ray_stores import QueuePlan, plan_queue, settle_dead_worker, worker_store
from nemo_rl_ext.evals.ray_worker import EngineFactory, EvalWorker, OnWritten
from nemo_rl_ext.evals.result import EvalResult
from nemo_rl_ext.evals.runs import WorkerStats, append_line
from nemo_rl_ext.evals.shards import group_root
from nemo_rl_ext.evals.store import EvalPaths
from nemo_rl_ext.evals.store_setup import check_store_config, load_rows
from nemo_rl_ext.models.config import ClusterConfig

__all__ = ["DEFAULT_IN_FLIGHT", "EVENTS_FILE", "run_ray_eval"]

DEFAULT_IN_FLIGHT = 8
"""Prompts a worker keeps in flight when `eval.max_concurrent_prompts` is null."""

EVENTS_FILE = "ray_workers.jsonl"
"""The run folder's record of worker starts, deaths, requeued prompts and expired leases."""

STOP_TIMEOUT_S = 60.0
"""How long the driver waits for a worker to shut its engine down before killing it."""

RAY_CALL_TIMEOUT_S = 60
"""How long the driver waits for the queue actor to answer one call."""


def run_ray_eval(
    cfg: EvalConfig, *, engine_factory: EngineFactory | None = None, progress: bool = True,
    on_written: OnWritten | None = None,
) -> EvalResult:
    """Run (or resume) `cfg` on `eval.ray_workers` Ray workers and merge (module docstring); an `EvalResult`.
    `on_written`: see `OnWritten` (tests)."""
    assert cfg.eval.ray_workers is not None, "not a Ray eval (eval.ray_workers is null)"
    start = time.perf_counter()
    save_path = Path(cfg.eval.save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    groups = group_configs(cfg)
    num_rows = len(load_rows(cfg))
    plan = plan_run(save_path, groups, num_rows)
    if not plan.items:  # every sample has a result on disk: no worker (nor Ray) to start, only the merge
        return _merge_only(save_path, plan, start)
    cluster = cfg.policy.cluster or ClusterConfig()
    started = init_ray(cluster)
    import ray  # lazy: Ray loads only for an eval on Ray (init_ray above has imported it by now)

    try:
        pool = WorkerPool(ray, cfg, groups, num_rows, plan, engine_factory=engine_factory, on_written=on_written)
        status = pool.run(progress=progress)
    finally:
        if started:
            ray.shutdown()
    return _finish(save_path, pool, status, plan, start)


def plan_run(save_path: Path, groups: Sequence[tuple[int | None, EvalConfig]], num_rows: int) -> QueuePlan:
    """Refuse a changed config against any worker store (a user error: found before any worker starts), then
    plan the queue from the lines on disk (every store's shard.json brought up to date, ray_stores.py)."""
    for seed, gcfg in groups:
        for root in sorted((group_root(save_path, seed) / "shards").glob("worker-*")):
            check_store_config(gcfg, EvalPaths(root))
    plan = plan_queue(save_path, groups, num_rows)
    if plan.skipped or plan.retried:
        print(f"resume: {plan.skipped} completion(s) already in {save_path}/.../shards, {plan.retried} error "
              f"sample(s) to retry; {len(plan.items)} group(s) to go")
    return plan


@dataclass
class _Slot:
    """Worker k: its current actor and how often it died."""

    k: int
    actor: Any = None
    name: str = ""
    lease_name: str = ""
    """The current incarnation's name at the queue (`worker-k.i`): a dead incarnation's is released for good."""
    deaths: int = 0
    incarnation: int = 0


class WorkerPool:
    """The driver's side of a Ray eval: the queue actor, `eval.ray_workers` worker actors started (and restarted
    when they die) on it, and the run's record of it in `<save_path>/ray_workers.jsonl`."""

    def __init__(
        self, ray: Any, cfg: EvalConfig, groups: Sequence[tuple[int | None, EvalConfig]], num_rows: int,
        plan: QueuePlan, *, engine_factory: EngineFactory | None = None, on_written: OnWritten | None = None,
    ) -> None:
        assert cfg.eval.ray_workers is not None
        self.ray, self.cfg, self.groups, self.num_rows = ray, cfg, groups, num_rows
        self.save_path = Path(cfg.eval.save_path)
        self.cluster = cfg.policy.cluster or ClusterConfig()
        self.factory, self.on_written = engine_factory, on_written
        self.total = len(plan.items)
        self.skips: dict[Item, frozenset[int]] = dict(plan.skips)  # kept here too: a dead store is read against them
        self.run_id = uuid.uuid4().hex[:8]
        self.events = self.save_path / EVENTS_FILE
        # on the driver's node: a worker node lost must not take the queue with it
        queue = ray.remote(PromptQueue).options(num_cpus=0, max_restarts=0, scheduling_strategy=on_this_node())
        self.queue = queue.remote(plan.items, cfg.eval.ray_lease_timeout_s, skips=self.skips)
        self.worker_cls = ray.remote(EvalWorker)
        self.slots = [_Slot(k) for k in range(cfg.eval.ray_workers)]
        self.running: dict[Any, _Slot] = {}
        self.stats: list[WorkerStats] = []

    def event(self, **fields: Any) -> None:
        """Append one line to ray_workers.jsonl."""
        append_line(self.events, {"time": time.time(), "run": self.run_id, **fields})

    def run(self, *, progress: bool) -> QueueStatus:
        """Start every worker, restart the dead, kill the stuck, until no worker runs; then stop them all. A
        worker that raised stops the run: its ConfigError as is, anything else as a RuntimeError."""
        bar = tqdm(total=self.total, desc=f"eval on {len(self.slots)} Ray workers", unit="prompt",
                   disable=not progress)
        failure: BaseException | None = None
        try:
            for slot in self.slots:
                self.launch(slot)
            while self.running:
                self._watch()
                bar.update(self.status().done - bar.n)
            status = self.status()
        except self.ray.exceptions.RayTaskError as err:  # a worker raised (a user error, a bug): stop every worker
            failure = err.cause if getattr(err, "cause", None) is not None else err
        finally:
            bar.close()
            self.stop()
        if isinstance(failure, ConfigError):
            raise failure
        if failure is not None:
            raise RuntimeError(f"a Ray eval worker failed: {failure}") from failure
        return status

    def status(self) -> QueueStatus:
        """The queue's counts."""
        return self.ray.get(self.queue.status.remote(), timeout=RAY_CALL_TIMEOUT_S)

    def launch(self, slot: _Slot) -> None:
        """Start worker `slot.k` (again) on its stores."""
        slot.name = f"worker-{slot.k}"
        slot.lease_name = f"{slot.name}.{slot.incarnation}"
        actor_name = f"nemo_rl_ext.eval/{self.run_id}/{slot.name}.{slot.incarnation}"
        options = {"num_cpus": self.cluster.replica.num_cpus, "num_gpus": self.cluster.replica.num_gpus,
                   "max_restarts": 0}
        slot.actor = self.worker_cls.options(name=actor_name, **options).remote(
            slot.name, self.cfg, self.factory, 1, self.on_written
        )
        jobs = [(gcfg, str(worker_store(self.save_path, seed, slot.k))) for seed, gcfg in self.groups]
        in_flight = self.cfg.eval.max_concurrent_prompts or DEFAULT_IN_FLIGHT
        self.running[slot.actor.run.remote(jobs, self.queue, in_flight, slot.lease_name)] = slot
        self.event(event="started", worker=slot.name, incarnation=slot.incarnation, actor=actor_name)
        slot.incarnation += 1

    def _watch(self) -> None:
        """Wait up to a second for a worker's `run` to end (its stats, or its death), then expire old leases."""
        ready, _ = self.ray.wait(list(self.running), num_returns=1, timeout=1.0)
        for ref in ready:
            slot = self.running.pop(ref)
            try:
                self.stats.append(self.ray.get(ref))
            except self.ray.exceptions.RayActorError as err:  # the worker died: what its store lacks goes back
                self._died(slot, err)
        self._expire()

    def _died(self, slot: _Slot, err: BaseException) -> None:
        """Worker `slot` died: settle its stores, release its prompts to the queue, restart it unless it has died
        `policy.cluster.max_failures` times."""
        dead = settle_dead_worker(self.save_path, self.groups, slot.k, self.num_rows, self.skips)
        back = self.ray.get(self.queue.release.remote(slot.lease_name, dead.done, dead.skips), timeout=RAY_CALL_TIMEOUT_S)
        for item, held in dead.skips.items():
            self.skips[item] = self.skips.get(item, frozenset()) | held
        slot.deaths += 1
        max_failures = self.cluster.max_failures
        restart = slot.deaths < max_failures
        reason = " ".join(str(err).split())[:500] or type(err).__name__
        self.event(event="died", worker=slot.name, requeued=[list(i) for i in back],
                   recovered=[list(i) for i in dead.recovered], deaths=slot.deaths, restarted=restart, reason=reason)
        print(f"{slot.name} died ({reason}); {len(back)} prompt(s) back to the queue, "
              f"{len(dead.recovered)} found complete in its store; " + (
                  f"restarting it ({slot.deaths} of {max_failures} deaths)" if restart
                  else f"taken out after {slot.deaths} deaths (policy.cluster.max_failures)"))
        if restart:
            self.launch(slot)

    def _expire(self) -> None:
        """Kill every worker holding a lease older than `eval.ray_lease_timeout_s` (it may hang); what it lacks
        goes back to the queue once it is dead (`_died`)."""
        for lease_name, stale in self.ray.get(self.queue.expire.remote(), timeout=RAY_CALL_TIMEOUT_S).items():
            slot = next((s for s in self.slots if s.lease_name == lease_name and s.actor is not None), None)
            name = slot.name if slot is not None else lease_name
            self.event(event="lease_expired", worker=name, held=[list(i) for i in stale])
            print(f"{name} held prompt(s) {[p for _, p in stale]} longer than eval.ray_lease_timeout_s "
                  f"({self.cfg.eval.ray_lease_timeout_s:g} s): killing {name} (what it lacks goes back once it is "
                  "dead)")
            if slot is not None:
                self.ray.kill(slot.actor, no_restart=True)

    def stop(self) -> None:
        """Shut every worker's engine down (bounded), then end the actors and the queue."""
        actors = [s.actor for s in self.slots if s.actor is not None]
        refs = []
        for actor in actors:
            try:
                refs.append(actor.shutdown.remote())
            except Exception:  # noqa: BLE001 - a dead actor: nothing to shut down
                pass
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        for actor in (*actors, self.queue):
            self.ray.kill(actor, no_restart=True)


def _merge_only(save_path: Path, plan: QueuePlan, start: float) -> EvalResult:
    """A resumed run with nothing left to queue: its record in ray_workers.jsonl, then the merge."""
    append_line(save_path / EVENTS_FILE, {"time": time.time(), "run": uuid.uuid4().hex[:8], "event": "finished",
                                          "done": 0, "total": 0, "requeued": 0})
    return EvalResult(
        paths=EvalPaths(save_path), complete=True, summary=merge_run(save_path).summary, groups_generated=0,
        completions_written=0, skipped_completions=plan.skipped, wall_time_s=time.perf_counter() - start,
        errors_written=0, retried=plan.retried,
    )


def _finish(save_path: Path, pool: WorkerPool, status: QueueStatus, plan: QueuePlan, start: float) -> EvalResult:
    """Record how the run ended and, when the queue is done, merge the worker stores (merge.py)."""
    complete = status.finished
    pool.event(event="finished" if complete else "stopped", done=status.done, total=status.total,
               requeued=status.requeued)
    if not complete:
        print(f"every Ray worker was taken out with {status.total - status.done} prompt(s) left "
              f"(see {pool.events}); re-run to resume")
    stats = pool.stats
    return EvalResult(
        paths=EvalPaths(save_path),
        complete=complete,
        summary=merge_run(save_path).summary if complete else None,
        groups_generated=sum(s.groups_generated for s in stats),
        completions_written=sum(s.completions_written for s in stats),
        skipped_completions=plan.skipped,
        wall_time_s=time.perf_counter() - start,  # the merge included
        errors_written=sum(s.errors_written for s in stats),
        retried=plan.retried,
    )
