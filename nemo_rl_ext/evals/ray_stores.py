"""What the worker stores of an eval on Ray hold on disk, and what the driver does with it: which prompts are
complete, each store's shard.json brought up to date with its lines, and the items the queue starts with.

The lines on disk, not shard.json, decide what is done: a worker writes a prompt's lines first and lists the
prompt in its shard.json (and reports it to the queue) up to `FLUSH_S` later, so a worker that dies in between
leaves lines that no shard.json lists. The driver reads a dead worker's store before it releases the worker's
prompts (`settle_dead_worker`), and every store when a run starts (`plan_queue`): a prompt whose every sample
has a line there (or a result in a sibling store) is added to the store's shard.json and counts as done, so it
is never rolled out into a second store. A prompt some of whose samples hold a result somewhere (a resumed
prompt with error samples, a group a kill cut short) is queued with those samples as its skip set: the worker
that takes it appends only the others, and the merge takes the union (merge.py).

A sample's count comes from the group's config by the line's agent (`rollouts.num_generations_per_prompt`), as
the worker's `expected` does from the datum's agent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.prompt_queue import Item
from nemo_rl_ext.evals.shards import ShardRecord, group_root
from nemo_rl_ext.evals.store import CompletionStore, EvalPaths

Results = Mapping[int, frozenset[int]]
"""prompt_idx -> the sample indices that hold a result (a non-error line)."""


def worker_store(save_path: Path, seed: int | None, k: int) -> Path:
    """The store of worker k: `<save_path>/[seeds/<seed>/]shards/worker-<k>/`."""
    return group_root(save_path, seed) / "shards" / f"worker-{k}"


@dataclass(frozen=True)
class StoreLines:
    """What one store's completions.jsonl holds, per prompt (read without repairing it)."""

    samples: Mapping[int, int]
    """prompt_idx -> the samples it needs (its agent's count), for every prompt the file has a line of."""
    lines: Mapping[int, frozenset[int]]
    """prompt_idx -> the sample indices that have a line (a result or an error)."""
    results: Results
    """prompt_idx -> the sample indices that have a result."""

    @classmethod
    def read(cls, root: Path, cfg: EvalConfig) -> StoreLines:
        """The lines of the store in `root` (none when it has no completions.jsonl; a torn last line is skipped,
        and left for the store's own worker to cut)."""
        path = EvalPaths(root).completions
        if not path.exists():
            return cls({}, {}, {})
        store = CompletionStore(path, repair=False)
        counts = cfg.rollouts.counts
        samples: dict[int, int] = {}
        lines: dict[int, set[int]] = {}
        results: dict[int, set[int]] = {}
        for p, s in store.keys():
            line = store.line(p, s)
            assert line is not None
            if p not in samples:
                samples[p] = counts.for_agent(line.agent)
            lines.setdefault(p, set()).add(s)
            if not line.is_error:
                results.setdefault(p, set()).add(s)
        return cls(samples, {p: frozenset(v) for p, v in lines.items()},
                   {p: frozenset(v) for p, v in results.items()})

    def complete(self, elsewhere: Results | None = None, *, results_only: bool = False) -> dict[int, int]:
        """prompt -> samples, for every prompt whose every sample has a line here (with `results_only`: a result)
        or a result in `elsewhere` (the results of the group's stores)."""
        elsewhere = elsewhere or {}
        here = self.results if results_only else self.lines
        return {
            p: n for p, n in self.samples.items()
            if all(s in here.get(p, ()) or s in elsewhere.get(p, ()) for s in range(n))
        }


def settle(root: Path, cfg: EvalConfig, num_rows: int, complete: Mapping[int, int]) -> list[int]:
    """Add the prompts in `complete` (prompt -> samples; complete on disk) to the store's shard.json, keeping what
    it lists; a store that has its config.yaml and dataset fingerprint but no shard.json gets one (perhaps
    listing nothing: its worker died before it wrote its first, and the merge would call it unstarted). Returns
    the prompts it did not list yet. Only while no worker writes into `root`."""
    record = ShardRecord.read(root)
    listed = dict(record.samples) if record is not None else {}
    added = sorted(p for p in complete if p not in listed)
    paths = EvalPaths(root)
    if added or (record is None and paths.config.exists() and paths.dataset.exists()):
        seed = cfg.policy.generation.seed if cfg.eval.seeds is not None else None
        ShardRecord(shard=None, seed=seed, num_prompts=record.num_prompts if record is not None else num_rows,
                    samples={**listed, **complete}, finished=True).write(root)
    return added


def _union(parts: Sequence[Results]) -> dict[int, frozenset[int]]:
    out: dict[int, frozenset[int]] = {}
    for part in parts:
        for p, samples in part.items():
            out[p] = out.get(p, frozenset()) | samples
    return out


@dataclass(frozen=True)
class QueuePlan:
    """What a (resumed) Ray eval queues: the items without a result for every sample, and what is on disk."""

    items: list[Item]
    """(group, prompt) of every prompt no store of its group holds a result of every sample for, in order."""
    skips: dict[Item, frozenset[int]]
    """item -> the samples some store of its group holds a result for (the worker appends only the others)."""
    skipped: int
    """(prompt, sample) results already on disk."""
    retried: int
    """Samples of the queued items that have a line but no result anywhere: errors, rolled out again."""


def plan_queue(save_path: Path, groups: Sequence[tuple[int | None, EvalConfig]], num_rows: int) -> QueuePlan:
    """Settle every store of the run (each store's shard.json lists the prompts complete on disk in it, with the
    group's results), then the items to queue, from the lines on disk. Before any worker starts."""
    items: list[Item] = []
    skips: dict[Item, frozenset[int]] = {}
    retried = skipped = 0
    for g, (seed, gcfg) in enumerate(groups):
        roots = [r for r in sorted((group_root(save_path, seed) / "shards").glob("*")) if r.is_dir()]
        stores = [(root, StoreLines.read(root, gcfg)) for root in roots]
        results = _union([lines.results for _, lines in stores])
        with_lines = _union([lines.lines for _, lines in stores])
        samples: dict[int, int] = {}
        for root, lines in stores:
            settle(root, gcfg, num_rows, lines.complete(results))
            samples.update(lines.samples)
        for p in range(num_rows):
            have = results.get(p, frozenset())
            skipped += len(have)
            if p in samples and all(s in have for s in range(samples[p])):
                continue
            items.append((g, p))
            if have:
                skips[(g, p)] = have
            retried += len(with_lines.get(p, frozenset()) - have)
    return QueuePlan(items, skips, skipped, retried)


@dataclass(frozen=True)
class DeadWorker:
    """What a dead worker's stores hold, for the queue's `release`."""

    done: list[Item]
    """The items whose every sample has a result in its store (or elsewhere): done, never rolled out again."""
    recovered: list[Item]
    """Those of `done` that its shard.json did not list yet (written, but not reported before it died)."""
    skips: dict[Item, frozenset[int]]
    """The other items its stores hold results of: item -> those samples (added to the item's skip set)."""


def settle_dead_worker(save_path: Path, groups: Sequence[tuple[int | None, EvalConfig]], k: int, num_rows: int,
                       skips: Mapping[Item, frozenset[int]]) -> DeadWorker:
    """Worker k is dead (nothing writes into its stores any more): list the prompts complete in its stores in
    their shard.json, so that no prompt is left in no store's shard.json, and say what to release them with.
    `skips`: the queue's skip sets (the results the other stores hold)."""
    done: list[Item] = []
    recovered: list[Item] = []
    partial: dict[Item, frozenset[int]] = {}
    for g, (seed, gcfg) in enumerate(groups):
        root = worker_store(save_path, seed, k)
        lines = StoreLines.read(root, gcfg)
        # results only: an error line may be one an earlier run left for this run to retry (the prompt is
        # queued, perhaps leased by another worker); a prompt with an error stays queued, and its retry appends
        # only the samples without a result (the merge prefers a result to an error)
        complete = lines.complete({p: s for (h, p), s in skips.items() if h == g}, results_only=True)
        recovered += [(g, p) for p in settle(root, gcfg, num_rows, complete)]
        done += [(g, p) for p in sorted(complete)]
        partial.update({(g, p): s for p, s in lines.results.items() if p not in complete})
    return DeadWorker(done, recovered, partial)
