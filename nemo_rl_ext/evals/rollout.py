"""The eval's roll-out step: prompts -> `RolloutManager.stream_rollouts` -> lines appended to a store.

    rolled = await roll_out(manager, plan.todo, expected=opened.expected, store=opened.store)
    rolled.records, rolled.written, rolled.errors

One function for every way an eval rolls out: a run or a shard job in this process (store_run.py) and a Ray
worker's leased prompt (ray_worker.py). Each group's samples that have no result yet (missing, or errored
before) are appended as soon as the group is done, with their latencies in timings.jsonl beside the store.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from nemo_rl_ext.data.records import DatumSpec, PromptGroupRecord
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.store import CompletionStore
from nemo_rl_ext.evals.timings import append_timings
from nemo_rl_ext.experience.rollout_manager import RolloutManager

__all__ = ["RolledOut", "roll_out"]


@dataclass(frozen=True)
class RolledOut:
    """What one `roll_out` call did."""

    records: list[PromptGroupRecord]
    """The groups rolled out, in the order they finished."""
    written: int
    """Lines appended (error lines included)."""
    errors: int
    """Error lines appended (infrastructure failures recorded, to be retried)."""


async def roll_out(
    manager: RolloutManager,
    datums: Sequence[DatumSpec],
    *,
    expected: Mapping[int, int],
    store: CompletionStore,
    save_token_ids: bool = False,
    max_concurrent_prompts: int | None = None,
    progress: bool = False,
    stop_after_groups: int | None = None,
    desc: str = "eval",
    skip: Mapping[int, Collection[int]] | None = None,
) -> RolledOut:
    """Roll out `datums` through `manager.stream_rollouts`, appending each group's samples that have no result
    yet to `store` as soon as the group is done. `expected`: prompt -> samples it needs; `skip`: prompt ->
    samples not to append (results another store holds); `stop_after_groups` (tests): stop once this many
    groups are written, as if the run had been killed there."""
    records: list[PromptGroupRecord] = []
    written = errors = 0
    bar = tqdm(total=len(datums), desc=desc, unit="prompt", disable=not progress)
    stream = manager.stream_rollouts(datums, max_concurrent_prompts=max_concurrent_prompts)
    try:
        async with contextlib.aclosing(stream):
            async for record in stream:
                have = store.done(record.prompt_idx, expected[record.prompt_idx])
                have |= set((skip or {}).get(record.prompt_idx, ()))
                lines = _new_lines(record, have, save_token_ids)
                written += store.append(lines)
                append_timings(store.path.parent, record, skip=have)  # timings.jsonl: not in the lines
                errors += sum(x.is_error for x in lines)
                records.append(record)
                bar.update(1)
                if stop_after_groups is not None and len(records) >= stop_after_groups:
                    break
    finally:
        bar.close()
    return RolledOut(records, written, errors)


def _new_lines(record: PromptGroupRecord, have: Collection[int], save_token_ids: bool) -> list[CompletionLine]:
    """The lines of `record`'s samples but those in `have` (results this store or another holds)."""
    return [
        CompletionLine.from_completion(record, i, c, save_token_ids)
        for i, c in enumerate(record.completions)
        if i not in have
    ]
