"""The shared queue of an eval on Ray workers: which prompts are still to do, and which worker holds which.

    queue = PromptQueue([(0, p) for p in range(24)], lease_timeout_s=600)
    queue.lease("worker-0")          # -> [(0, 0)]: the worker rolls the prompt out into its own store
    queue.complete("worker-0", [(0, 0)])
    queue.release("worker-1", done=[(0, 3)])  # worker-1 died: what its store holds is done, the rest goes back

A plain class (ray_lease_queue.py makes it a Ray actor), so the lease rules are tested without Ray. An item is
(group, prompt_idx): the group is the seed's index with `eval.seeds`, else 0. A worker leases an item when it has
a free slot, so a slow worker takes fewer items and no worker waits for another's fixed slice. An item stays
leased until its worker completes it, and goes back to the queue only once its worker is dead (`release`, called
by the driver that watches the workers, after it has read what the dead worker's store holds): so no two live
workers ever hold the same item, and a prompt is rolled out into one store only. A lease older than
`lease_timeout_s` is reported (`expire`), once; the driver then kills that worker (it may hang) and releases it.

An item may come with the samples that some store already holds a result for (`skips`: a resumed prompt with
error samples, or a prompt a dead worker wrote part of); the worker that leases it appends only the others.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

Item = tuple[int, int]
"""(group, prompt_idx): the seed's index in `eval.seeds` (0 without seeds) and the prompt's dataset index."""


@dataclass(frozen=True)
class QueueStatus:
    """A snapshot of the queue (for progress and the run's record)."""

    pending: int
    """Items nobody holds yet."""
    leased: dict[str, int]
    """Worker -> items it holds."""
    done: int
    """Items completed."""
    requeued: int
    """Items that went back to the queue (their worker died, or was killed for an expired lease), counted each
    time."""
    total: int
    """Items the queue started with."""

    @property
    def finished(self) -> bool:
        """True when every item is completed."""
        return self.done == self.total


class PromptQueue:
    """Pending items, leases per worker, completed items; see the module docstring."""

    def __init__(
        self,
        items: Sequence[Item],
        lease_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        skips: Mapping[Item, Collection[int]] | None = None,
    ) -> None:
        items = [(int(g), int(p)) for g, p in items]
        if len(set(items)) != len(items):
            raise ValueError("every item must be queued once")
        self._skips: dict[Item, frozenset[int]] = {}
        """item -> the sample indices some store already holds a result for (not rolled out again)."""
        self._add_skips(skips or {})
        self._stale: set[str] = set()
        """Workers `expire` has reported (until they are released)."""
        self._released: set[str] = set()
        """Workers `release`d (dead): a lease they asked for while dying takes nothing."""
        self._items = frozenset(items)
        """Every item queued: what `complete` may count (a store holds older prompts, done before this queue)."""
        self._pending: deque[Item] = deque(items)
        self._leases: dict[str, dict[Item, float]] = {}
        """worker -> {item: when it was leased}."""
        self._done: set[Item] = set()
        self._total = len(items)
        self._requeued = 0
        self._timeout = lease_timeout_s
        self._clock = clock

    def lease(self, worker: str, n: int = 1) -> list[Item] | None:
        """Up to `n` items for `worker`, oldest first; [] when none is pending but some are leased (one may
        come back: ask again later); None when every item is done (the worker can stop), and for a worker
        already released: its request was on the way when it died, and what it took would stay leased to a dead
        worker, never released, and the run would wait for it for ever."""
        if n < 1:
            raise ValueError(f"n must be >= 1, not {n}")
        if len(self._done) == self._total or worker in self._released:
            return None
        now = self._clock()
        taken: list[Item] = []
        held = self._leases.setdefault(worker, {})
        while self._pending and len(taken) < n:
            item = self._pending.popleft()
            if item in self._done:  # completed by a worker whose lease had been taken back
                continue
            held[item] = now
            taken.append(item)
        if not taken and len(self._done) == self._total:
            return None
        return taken

    def complete(self, worker: str, items: Iterable[Item]) -> None:
        """`worker` has every line of `items` in its store: they are done (whoever holds them now). Items this
        queue never held are ignored: they were done before it started."""
        for item in items:
            item = (int(item[0]), int(item[1]))
            if item not in self._items:
                continue
            self._done.add(item)
            for held in self._leases.values():
                held.pop(item, None)

    def skip_samples(self, items: Iterable[Item]) -> dict[Item, frozenset[int]]:
        """The sample indices of each of `items` that some store already holds a result for (items without any
        are left out): the worker that rolls the item out appends only its other samples."""
        out = {}
        for item in items:
            item = (int(item[0]), int(item[1]))
            if self._skips.get(item):
                out[item] = self._skips[item]
        return out

    def _add_skips(self, skips: Mapping[Item, Collection[int]]) -> None:
        for item, samples in skips.items():
            item = (int(item[0]), int(item[1]))
            self._skips[item] = self._skips.get(item, frozenset()) | {int(s) for s in samples}

    def release(
        self, worker: str, done: Iterable[Item] = (), skips: Mapping[Item, Collection[int]] | None = None
    ) -> list[Item]:
        """`worker` is dead: `done` (the items its store holds a line of every sample of) are done, `skips` adds
        the samples its store holds a result for to those items' skip sets, and the other items it held go back
        to the front of the queue (in lease order); returns those."""
        self.complete(worker, done)
        self._add_skips(skips or {})
        held = self._leases.pop(worker, {})
        self._stale.discard(worker)
        self._released.add(worker)
        back = [item for item in held if item not in self._done]
        self._pending.extendleft(reversed(back))
        self._requeued += len(back)
        return back

    def expire(self) -> dict[str, list[Item]]:
        """The workers holding a lease older than `lease_timeout_s`, each with its stale items, each worker
        reported once. Nothing goes back to the queue here: the driver kills these workers, then `release`s
        them (a worker that still runs could still write what it holds)."""
        if self._timeout is None:
            return {}
        now = self._clock()
        out: dict[str, list[Item]] = {}
        for worker, held in self._leases.items():
            old = [item for item, since in held.items() if now - since > self._timeout]
            if old and worker not in self._stale:
                self._stale.add(worker)
                out[worker] = old
        return out

    def status(self) -> QueueStatus:
        """The current counts."""
        return QueueStatus(
            pending=sum(item not in self._done for item in self._pending),
            leased={w: len(h) for w, h in self._leases.items() if h},
            done=len(self._done),
            requeued=self._requeued,
            total=self._total,
        )
