"""A Ray eval worker: an engine of its own, and a loop that leases prompts from the queue (prompt_queue.py) and
rolls each out into its store through the eval's own roll-out step (`rollout.roll_out`).

A worker builds its engine from `policy` (the model folder loaded in its process, one torch thread on CPU), then
keeps `in_flight` prompts in flight, leasing one whenever one of its groups is done. Each group (the run, or one
seed) has the worker's store `<save_path>/[seeds/<seed>/]shards/worker-<k>/`, opened as any store is
(`store_setup.check_store`, `store_setup.open_store`), whose shard.json lists the prompts it holds every line
of: written every `FLUSH_S`, before the prompts are reported done to the queue, so a prompt the queue counts as
done is in some store's shard.json. The driver side is ray_lease_queue.py.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.prompt_queue import Item
from nemo_rl_ext.evals.rollout import roll_out
from nemo_rl_ext.evals.runs import WorkerStats, append_line
from nemo_rl_ext.evals.shards import ShardRecord
from nemo_rl_ext.evals.store import CompletionStore, EvalPaths
from nemo_rl_ext.evals.store_setup import check_store, open_store
from nemo_rl_ext.experience.build import build_policy
from nemo_rl_ext.models.generation.interfaces import GenerationInterface

__all__ = ["FLUSH_S", "POLL_S", "EngineFactory", "EvalWorker", "OnWritten"]

POLL_S = 0.2
"""How often an idle worker asks the queue again (a dead worker's prompts may come back)."""

FLUSH_S = 0.5
"""How often a worker writes its shard.json and reports the prompts finished since (to the queue)."""

EngineFactory = Callable[[], GenerationInterface]
"""Builds a worker's engine in its process (must pickle); None: `build_policy(policy)`."""

OnWritten = Callable[[str, int, int], None]
"""Called in a worker with (worker name, group, prompt) once the prompt's lines are on disk, before the worker
reports it to the queue (tests kill the worker there; must pickle)."""


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
            torch.set_num_threads(torch_threads)  # Ray does not cap torch threads
        self.name = name
        self.on_written = on_written
        if engine_factory is not None:
            self.generation = engine_factory()
        else:
            self.generation = build_policy(cfg.policy.model_copy(update={"cluster": None}))[1]
        self.stats = WorkerStats()
        self._managers: list[Any] = []  # shut down by `run` or `shutdown`: the policy servers and Gyms they started

    def ready(self) -> int:
        """The worker's process id (returns once the engine is built)."""
        return os.getpid()

    async def _open(self, cfg: EvalConfig, root: Path) -> _Group:
        """Open (or resume) the store `root` for `cfg`, as a run's own store is (store_setup.py)."""
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

    async def run(
        self, jobs: Sequence[tuple[EvalConfig, str]], queue: Any, in_flight: int, lease_as: str | None = None
    ) -> WorkerStats:
        """Lease prompts from `queue` until it is done, `in_flight` at a time; `jobs[g]` is group g's config
        and store; `lease_as` is this incarnation's name at the queue (default: the worker's name). Returns what
        this incarnation generated."""
        who = lease_as or self.name
        start = time.perf_counter()
        groups = [await self._open(cfg, Path(root)) for cfg, root in jobs]
        finished: list[Item] = []

        async def flush() -> None:
            if not finished:
                return
            batch = list(finished)
            for g in {g for g, _ in batch}:
                groups[g].write_record()  # on disk before the queue counts the prompts as done
            await queue.complete.remote(who, batch)
            del finished[: len(batch)]

        async def flusher() -> None:
            while True:
                await asyncio.sleep(FLUSH_S)
                await flush()

        async def loop() -> None:
            while True:
                items = await queue.lease.remote(who, 1)
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
        n = group.expected[p]
        need = [s for s in range(n) if s not in skip]
        if any(s not in group.store.done(p, n) for s in need):
            rolled = await roll_out(
                group.manager, [group.datums[p]], expected=group.expected, store=group.store,
                save_token_ids=group.cfg.eval.save_token_ids, skip={p: skip},
            )
            self.stats = self.stats.plus(len(rolled.records), rolled.written, rolled.errors)
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
