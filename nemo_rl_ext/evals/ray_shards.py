"""An eval on N Ray workers that pull prompts from a shared queue, each into its own store; then one merge.

    python examples/run_eval.py --config eval.yaml eval.ray_workers=2                       # a local Ray
    python examples/run_eval.py --config eval.yaml eval.ray_workers=8 policy.cluster.address=auto \\
        policy.cluster.replica.num_gpus=1                                                     # a cluster

This process (the driver) starts or joins Ray from `policy.cluster` (null: a local Ray on 127.0.0.1), puts
every (seed, prompt) that has no complete group on disk into a `PromptQueue` actor (prompt_queue.py), and
starts `eval.ray_workers` `EvalWorker` actors. A worker builds its own engine from `policy` (the model folder
loaded in its process, one torch thread on CPU; `policy.cluster.replica` says what it reserves), then keeps
`eval.max_concurrent_prompts` (default `DEFAULT_IN_FLIGHT`) prompts in flight, leasing one prompt whenever one
of its groups is done: no fixed slices, so a slow worker does not set the pace. Each group goes through the
eval driver's own loop (`driver._roll_out`) into the worker's store `<save_path>/[seeds/<seed>/]shards/
worker-<k>/`, whose shard.json lists the prompts it holds every line of (written before the prompts are
reported done, so a prompt the queue counts as done is in some store's shard.json).

In nemo_gym mode each worker (each group of it, with `eval.seeds`) serves its engine on its own policy server
(a free port) and, with `rollouts.gym.launch` (mode direct), launches its own Gym pointed at it, when its first
prompt starts; the Gym is stopped when the worker's `run` ends (or by `shutdown`; a killed worker's Gym by the
launcher's watchdog). The store keeps the rows it may send in gym_rows.jsonl (every prompt's, written before
the first is sent; a resumed worker sends those). A running Gym calls one policy URL, and ng_run's head server
has one port, so those need one policy server in all (config.py `_gym_worker_problems`). The merged summary
has no `gym_metrics` (merge.py).

A worker that dies (killed, out of memory, its node lost) is seen by the driver as its `run` call failing. The
driver then reads the dead worker's store (ray_stores.py): the prompts it holds every line of are added to its
shard.json and count as done (a worker writes a prompt's lines up to `FLUSH_S` before it reports them), and only
the other prompts it held go back to the front of the queue, with the samples its store holds results of as
their skip set. The worker is started again on the same store (a group already on disk is skipped, a torn last
line is cut) until it has died `policy.cluster.max_failures` times; then it is taken out and the others finish
the queue. A worker holding a lease older than `eval.ray_lease_timeout_s` is killed (it may hang), and its
prompts go back the same way once it is dead. So no prompt is rolled out into two stores. Every start, death and
requeue is a line in `<save_path>/ray_workers.jsonl`. When the queue is done the driver runs the merge (merge.py): the same
sorted completions.jsonl, summary.json and report.md as a run in one process or as static shards, because
every sample is seeded by (prompt, sample, turn) and the merge keys lines by (prompt, sample).

Each worker owns an engine (rather than sharing a replica pool) so that a worker's death takes exactly its
own prompts with it, and N workers are N independent engines, as N static shards are.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.prompt_queue import Item, PromptQueue
from nemo_rl_ext.evals.ray_stores import plan_queue, settle_dead_worker, worker_store
from nemo_rl_ext.evals.runs import WorkerStats, append_line
from nemo_rl_ext.evals.shards import ShardRecord, group_root
from nemo_rl_ext.evals.store import CompletionStore, EvalPaths
from nemo_rl_ext.evals.store_setup import check_store_config
from nemo_rl_ext.models.config import ClusterConfig
from nemo_rl_ext.models.generation.interfaces import GenerationInterface

if TYPE_CHECKING:
    from nemo_rl_ext.evals.driver import EvalResult

DEFAULT_IN_FLIGHT = 8
"""Prompts a worker keeps in flight when `eval.max_concurrent_prompts` is null."""

POLL_S = 0.2
"""How often an idle worker asks the queue again (a dead worker's prompts may come back)."""

FLUSH_S = 0.5
"""How often a worker writes its shard.json and reports the prompts finished since (to the queue)."""

EVENTS_FILE = "ray_workers.jsonl"
"""The run folder's record of worker starts, deaths, requeued prompts and expired leases."""

STOP_TIMEOUT_S = 60.0
"""How long the driver waits for a worker to shut its engine down before killing it."""

EngineFactory = Callable[[], GenerationInterface]
"""Builds a worker's engine in its process (must pickle); None: `build_policy(policy)`."""


OnWritten = Callable[[str, int, int], None]
"""Called in a worker with (worker name, group, prompt) once the prompt's lines are on disk, before the worker
reports it to the queue (tests kill the worker there; must pickle)."""

__all__ = ["EvalWorker", "OnWritten", "group_configs", "run_ray_eval", "worker_store"]


def group_configs(cfg: EvalConfig) -> list[tuple[int | None, EvalConfig]]:
    """(seed, config) of each group the queue covers: the run, or one per `eval.seeds` (that seed as
    `policy.generation.seed`, the identity the merge checks)."""
    if cfg.eval.seeds is None:
        return [(None, cfg)]
    out = []
    for seed in cfg.eval.seeds:
        gen = cfg.policy.generation.model_copy(update={"seed": seed})
        out.append((seed, cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"generation": gen})})))
    return out


# ---- the worker ------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """A worker's state for one group (the run, or one seed): its store, manager and datums."""

    cfg: EvalConfig
    root: Path
    store: CompletionStore
    manager: Any
    datums: dict[int, Any]
    expected: dict[int, int]
    num_rows: int
    held: dict[int, int] = field(default_factory=dict)
    """prompt -> samples, for every prompt this store holds (a line of each sample, but of those another store has
    the result of): its shard.json."""

    def write_record(self) -> None:
        ShardRecord(shard=None, seed=self.cfg.policy.generation.seed if self.cfg.eval.seeds is not None else None,
                    num_prompts=self.num_rows, samples=dict(self.held), finished=True).write(self.root)


class EvalWorker:
    """One Ray worker: an engine, and a loop that leases prompts and rolls them out into its stores."""

    def __init__(self, name: str, cfg: EvalConfig, engine_factory: EngineFactory | None = None,
                 torch_threads: int | None = 1, on_written: OnWritten | None = None) -> None:
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)  # Ray does not cap torch threads
        self.name = name
        self.on_written = on_written
        if engine_factory is not None:
            self.generation = engine_factory()
        else:
            from nemo_rl_ext.experience.build import build_policy

            self.generation = build_policy(cfg.policy.model_copy(update={"cluster": None}))[1]
        self.stats = WorkerStats()
        self._managers: list[Any] = []  # shut down by `run` or `shutdown`: the policy servers and Gyms they started

    def ready(self) -> int:
        """The worker's process id (returns once the engine is built)."""
        import os

        return os.getpid()

    async def _open(self, cfg: EvalConfig, root: Path) -> _Group:
        """Open (or resume) the store `root` for `cfg`, as a run's own store is (store_setup.py)."""
        from nemo_rl_ext.evals.store_setup import check_store, open_store

        opened = await open_store(check_store(cfg, root), self.generation, build_cfg=self._runtime_config(cfg, root))
        self._managers.append(opened.manager)
        store, expected = opened.store, opened.expected
        group = _Group(cfg, root, store, opened.manager, {d.idx: d for d in opened.datums}, expected,
                       len(opened.checked.rows))
        record = ShardRecord.read(root)  # what it listed (the driver adds what a dead incarnation left unlisted)
        group.held = dict(record.samples) if record is not None else {}
        group.held.update({p: n for p, n in expected.items() if all(store.line(p, s) is not None for s in range(n))})
        group.write_record()
        return group

    def _runtime_config(self, cfg: EvalConfig, root: Path) -> EvalConfig:
        """`cfg` as this worker runs it (config.yaml keeps `cfg`): a set `rollouts.gym.launch.work_dir` gets a
        folder per worker and group, as every worker launches its own Gym (logs of the same names)."""
        gym = cfg.rollouts.gym  # unused in native mode (changing it there changes nothing)
        if gym is None or gym.launch is None or gym.launch.work_dir is None:
            return cfg
        sub = root.relative_to(Path(cfg.eval.save_path)).as_posix().replace("/", "-")
        launch = gym.launch.model_copy(update={"work_dir": gym.launch.work_dir / sub})
        rollouts = cfg.rollouts.model_copy(update={"gym": gym.model_copy(update={"launch": launch})})
        return cfg.model_copy(update={"rollouts": rollouts})

    async def run(self, jobs: Sequence[tuple[EvalConfig, str]], queue: Any, in_flight: int) -> WorkerStats:
        """Lease prompts from `queue` until it is done, `in_flight` at a time; `jobs[g]` is group g's config
        and store. Returns what this incarnation generated."""
        start = time.perf_counter()
        groups = [await self._open(cfg, Path(root)) for cfg, root in jobs]
        finished: list[Item] = []

        async def flush() -> None:
            if not finished:
                return
            batch = list(finished)
            for g in {g for g, _ in batch}:
                groups[g].write_record()  # on disk before the queue counts the prompts as done
            await queue.complete.remote(self.name, batch)
            del finished[: len(batch)]

        async def flusher() -> None:
            while True:
                await asyncio.sleep(FLUSH_S)
                await flush()

        async def loop() -> None:
            while True:
                items = await queue.lease.remote(self.name, 1)
                if items is None:
                    return
                if not items:
                    await asyncio.sleep(POLL_S)
                    continue
                skips = await queue.skip_samples.remote(items)
                for g, p in items:
                    await self._roll_out_prompt(groups[g], g, p, skips.get((g, p), frozenset()))
                    finished.append((g, p))

        flushing = asyncio.ensure_future(flusher())
        try:
            await asyncio.gather(*(loop() for _ in range(in_flight)))
            await flush()
        finally:
            flushing.cancel()
            await self._stop_managers()
        wall = time.perf_counter() - start
        for group in groups:
            append_line(EvalPaths(group.root).runs, self.stats.run_json(self.name, wall))
        return self.stats

    async def _roll_out_prompt(self, group: _Group, g: int, p: int, skip: frozenset[int]) -> None:
        """Give every sample of prompt p that is not in `skip` (results another store holds) a line in the group's
        store, rolling the prompt out unless the store has them; then it is held (listed at the next flush)."""
        from nemo_rl_ext.evals.driver import _roll_out

        n = group.expected[p]
        need = [s for s in range(n) if s not in skip]
        if any(s not in group.store.done(p, n) for s in need):
            records, written, errors = await _roll_out(
                group.manager, [group.datums[p]], group.expected, group.store,
                group.cfg.eval.save_token_ids, None, False, None, "", skip={p: skip},
            )
            self.stats = self.stats.plus(len(records), written, errors)
        if any(group.store.line(p, s) is None for s in need):
            raise RuntimeError(f"the rollouts returned fewer than {n} completions for prompt {p}")
        if self.on_written is not None:
            self.on_written(self.name, g, p)
        group.held[p] = n

    async def _stop_managers(self) -> None:
        """Stop every manager opened (its policy server and Gym, in nemo_gym mode), each once."""
        while self._managers:
            await self._managers.pop().shutdown()

    async def shutdown(self) -> None:
        """Stop the managers still open (a worker stopped mid-run), then the engine."""
        await self._stop_managers()
        self.generation.shutdown()


# ---- the driver ------------------------------------------------------------------------------------------


@dataclass
class _Slot:
    """Worker k: its current actor and how often it died."""

    k: int
    actor: Any = None
    name: str = ""
    deaths: int = 0
    incarnation: int = 0


def run_ray_eval(
    cfg: EvalConfig, *, engine_factory: EngineFactory | None = None, progress: bool = True,
    on_written: OnWritten | None = None,
) -> EvalResult:
    """Run (or resume) `cfg` on `eval.ray_workers` Ray workers and merge (module docstring); an `EvalResult`.
    `on_written`: see `OnWritten` (tests)."""
    from nemo_rl_ext.cluster import init_ray
    from nemo_rl_ext.evals.driver import EvalResult, load_rows
    from nemo_rl_ext.evals.merge import merge_run

    assert cfg.eval.ray_workers is not None, "not a Ray eval (eval.ray_workers is null)"
    start = time.perf_counter()
    save_path = Path(cfg.eval.save_path)
    save_path.mkdir(parents=True, exist_ok=True)
    groups = group_configs(cfg)
    num_rows = len(load_rows(cfg))
    for seed, gcfg in groups:  # a changed config is a user error: found before any worker starts
        for root in sorted((group_root(save_path, seed) / "shards").glob("worker-*")):
            check_store_config(gcfg, EvalPaths(root))
    plan = plan_queue(save_path, groups, num_rows)  # and every store's shard.json lists what it holds
    items, skipped, retried = plan.items, plan.skipped, plan.retried
    skips = dict(plan.skips)  # the queue's skip sets, kept here too (a dead store is read against them)
    if skipped or retried:
        print(f"resume: {skipped} completion(s) already in {save_path}/.../shards, {retried} error sample(s) to "
              f"retry; {len(items)} group(s) to go")
    cluster = cfg.policy.cluster or ClusterConfig()
    started = init_ray(cluster)
    import ray

    run_id = uuid.uuid4().hex[:8]
    events = save_path / EVENTS_FILE

    def event(**fields: Any) -> None:
        append_line(events, {"time": time.time(), "run": run_id, **fields})

    queue = ray.remote(PromptQueue).options(num_cpus=0, max_restarts=0).remote(
        items, cfg.eval.ray_lease_timeout_s, skips=skips
    )
    worker_cls = ray.remote(EvalWorker)
    options = {"num_cpus": cluster.replica.num_cpus, "num_gpus": cluster.replica.num_gpus, "max_restarts": 0}
    in_flight = cfg.eval.max_concurrent_prompts or DEFAULT_IN_FLIGHT
    slots = [_Slot(k) for k in range(cfg.eval.ray_workers)]
    running: dict[Any, _Slot] = {}
    stats: list[WorkerStats] = []

    def launch(slot: _Slot) -> None:
        slot.name = f"worker-{slot.k}"
        actor_name = f"nemo_rl_ext.eval/{run_id}/{slot.name}.{slot.incarnation}"
        slot.actor = worker_cls.options(name=actor_name, **options).remote(slot.name, cfg, engine_factory, 1,
                                                                           on_written)
        jobs = [(gcfg, str(worker_store(save_path, seed, slot.k))) for seed, gcfg in groups]
        running[slot.actor.run.remote(jobs, queue, in_flight)] = slot
        event(event="started", worker=slot.name, incarnation=slot.incarnation, actor=actor_name)
        slot.incarnation += 1

    bar = tqdm(total=len(items), desc=f"eval on {len(slots)} Ray workers", unit="prompt", disable=not progress)
    failure: BaseException | None = None
    try:
        for slot in slots:
            launch(slot)
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
            for ref in ready:
                slot = running.pop(ref)
                try:
                    stats.append(ray.get(ref))
                except ray.exceptions.RayActorError as err:  # the worker died: what its store lacks goes back
                    dead = settle_dead_worker(save_path, groups, slot.k, num_rows, skips)
                    back = ray.get(queue.release.remote(slot.name, dead.done, dead.skips), timeout=60)
                    for item, held in dead.skips.items():
                        skips[item] = skips.get(item, frozenset()) | held
                    slot.deaths += 1
                    restart = slot.deaths < cluster.max_failures
                    reason = " ".join(str(err).split())[:500] or type(err).__name__
                    event(event="died", worker=slot.name, requeued=[list(i) for i in back],
                          recovered=[list(i) for i in dead.recovered], deaths=slot.deaths, restarted=restart,
                          reason=reason)
                    print(f"{slot.name} died ({reason}); {len(back)} prompt(s) back to the queue, "
                          f"{len(dead.recovered)} found complete in its store; " + (
                        f"restarting it ({slot.deaths} of {cluster.max_failures} deaths)" if restart
                        else f"taken out after {slot.deaths} deaths (policy.cluster.max_failures)"))
                    if restart:
                        launch(slot)
            for name, stale in ray.get(queue.expire.remote(), timeout=60).items():
                event(event="lease_expired", worker=name, held=[list(i) for i in stale])
                print(f"{name} held prompt(s) {[p for _, p in stale]} longer than eval.ray_lease_timeout_s "
                      f"({cfg.eval.ray_lease_timeout_s:g} s): killing {name} (what it lacks goes back once it is "
                      "dead)")
                for slot in slots:
                    if slot.name == name and slot.actor is not None:
                        ray.kill(slot.actor, no_restart=True)
            status = ray.get(queue.status.remote(), timeout=60)
            bar.update(status.done - bar.n)
        status = ray.get(queue.status.remote(), timeout=60)
    except ray.exceptions.RayTaskError as err:  # a worker raised (a user error, a bug): stop every worker
        failure = err.cause if getattr(err, "cause", None) is not None else err
    finally:
        bar.close()
        _stop(ray, [s.actor for s in slots if s.actor is not None], queue)
        if started:
            ray.shutdown()
    if isinstance(failure, ConfigError):
        raise failure
    if failure is not None:
        raise RuntimeError(f"a Ray eval worker failed: {failure}") from failure
    complete = status.finished
    event(event="finished" if complete else "stopped", done=status.done, total=status.total,
          requeued=status.requeued)
    if not complete:
        print(f"every Ray worker was taken out with {status.total - status.done} prompt(s) left "
              f"(see {events}); re-run to resume")
    summary = merge_run(save_path).summary if complete else None
    return EvalResult(
        paths=EvalPaths(save_path),
        complete=complete,
        summary=summary,
        groups_generated=sum(s.groups_generated for s in stats),
        completions_written=sum(s.completions_written for s in stats),
        skipped_completions=skipped,
        wall_time_s=time.perf_counter() - start,
        errors_written=sum(s.errors_written for s in stats),
        retried=retried,
    )


def _stop(ray: Any, actors: Sequence[Any], queue: Any) -> None:
    """Shut every worker's engine down (bounded), then end the actors and the queue."""
    refs = []
    for actor in actors:
        try:
            refs.append(actor.shutdown.remote())
        except Exception:  # noqa: BLE001 - a dead actor: nothing to shut down
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
    for actor in (*actors, queue):
        ray.kill(actor, no_restart=True)
