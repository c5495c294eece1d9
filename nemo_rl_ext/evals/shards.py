"""Evaluation as independent jobs: which prompts a shard owns, where each job's store lives, and its shard.json.

    python examples/run_eval.py --config eval.yaml eval.shard=1/3            # the 2nd of 3 shards
    python examples/run_eval.py --config eval.yaml eval.seeds=[0,1] eval.seed_index=1 eval.shard=0/3
    python examples/run_eval.py merge results/evals/eval                    # or: automatic, by the last job

A job is one (seed, shard) pair. `eval.shard: "I/N"` is 0-based (I in 0..N-1, as a Slurm array's
`--array=0-23` counts). Shard I owns the prompts whose index satisfies `idx % N == I`: the slices are disjoint,
cover every prompt, differ in size by at most one, do not move when `eval.num_prompts` grows (a resume with more
prompts only extends each slice), and spread a dataset sorted by source or difficulty evenly over the shards.

The run folder (`eval.save_path`) holds one store per job, each an ordinary eval store (completions.jsonl,
config.yaml, dataset_fingerprint.json, runs.jsonl; gym_rows.jsonl in nemo_gym mode) plus `shard.json`:

    <save_path>/shards/<I>-of-<N>/                   without eval.seeds
    <save_path>/seeds/<seed>/shards/<I>-of-<N>/      with eval.seeds (a seed without eval.shard is shard 0/1)

The merge (merge.py) writes each group's union (sorted completions.jsonl, summary.json, report.md) into
`<save_path>/` or `<save_path>/seeds/<seed>/`, and with seeds the pooled summary into `<save_path>/`.
The merge reads which prompts a store holds from its shard.json, never from the modulo rule, so stores filled
by a dynamic assignment (prompts pulled from a queue; any store name under `shards/`) merge the same way; only
stores named `<I>-of-<N>` are also checked for a missing shard.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

SHARD_FILE = "shard.json"
"""The file in each job's store that says which prompts it owns and whether it finished."""

_SPEC = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")
_NAME = re.compile(r"(\d+)-of-(\d+)")


@dataclass(frozen=True)
class ShardSpec:
    """One of N disjoint slices of the prompts: `eval.shard: "I/N"` (0-based I)."""

    index: int
    """I: which slice, 0 <= I < N."""
    count: int
    """N: how many slices, >= 1."""

    @classmethod
    def parse(cls, text: Any) -> ShardSpec:
        """`"I/N"` -> ShardSpec; ValueError saying what is wrong (the caller names the key)."""
        m = _SPEC.fullmatch(text) if isinstance(text, str) else None
        if m is None:
            raise ValueError("must look like I/N (shard I of N, 0-based, e.g. 0/4)")
        index, count = int(m.group(1)), int(m.group(2))
        if count < 1:
            raise ValueError(f"N must be >= 1 (shard I of N), not {count}")
        if index >= count:
            raise ValueError(f"I must be in 0..{count - 1} (shards are 0-based: I of N), not {index}")
        return cls(index, count)

    @classmethod
    def from_name(cls, name: str) -> ShardSpec | None:
        """The spec of a store folder named `<I>-of-<N>`, or None for any other name."""
        m = _NAME.fullmatch(name)
        if m is None or int(m.group(1)) >= int(m.group(2)):
            return None
        return cls(int(m.group(1)), int(m.group(2)))

    def owns(self, prompt_idx: int) -> bool:
        """True when the prompt belongs to this slice: `prompt_idx % N == I`."""
        return prompt_idx % self.count == self.index

    @property
    def text(self) -> str:
        """The spelling in the config: `I/N`."""
        return f"{self.index}/{self.count}"

    @property
    def name(self) -> str:
        """The store folder's name: `I-of-N`."""
        return f"{self.index}-of-{self.count}"


def group_root(save_path: Path, seed: int | None) -> Path:
    """Where a group's merged outputs go: the run folder, or `seeds/<seed>/` in it."""
    return save_path if seed is None else save_path / "seeds" / str(seed)


def store_root(save_path: Path, seed: int | None, shard: ShardSpec) -> Path:
    """The store of job (seed, shard): `[seeds/<seed>/]shards/<I>-of-<N>/` in the run folder."""
    return group_root(save_path, seed) / "shards" / shard.name


@dataclass(frozen=True)
class ShardRecord:
    """What shard.json holds: the store's prompts, their sample counts, and whether every sample has a line."""

    shard: str | None
    """`I/N` of a static shard; None for a store filled by a dynamic assignment."""
    seed: int | None
    """The job's `policy.generation.seed` when the run has `eval.seeds`; None otherwise."""
    num_prompts: int
    """Rows in the run's selection (every store of a run must agree)."""
    samples: Mapping[int, int]
    """prompt_idx -> samples it needs, for every prompt this store is responsible for."""
    finished: bool
    """True when each of those (prompt, sample) pairs has a line (a result, or an error to retry). A Ray worker's
    store is always finished: it lists a prompt only once the prompt is complete (a sample may have its result
    in another store of the group instead: a retry appends only the missing ones); whether the run covers every
    prompt is the queue's business, and the merge checks it."""

    def to_json(self) -> dict[str, Any]:
        """The shard.json object."""
        return {
            "shard": self.shard,
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "prompts": sorted(self.samples),
            "samples": {str(k): v for k, v in sorted(self.samples.items())},
            "finished": self.finished,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ShardRecord:
        """The record of a parsed shard.json (KeyError / ValueError / TypeError when it is not one)."""
        return cls(
            shard=obj["shard"],
            seed=obj["seed"],
            num_prompts=int(obj["num_prompts"]),
            samples={int(k): int(v) for k, v in obj["samples"].items()},
            finished=bool(obj["finished"]),
        )

    def write(self, root: Path) -> None:
        """Write `root/shard.json` atomically (a reader sees the old or the new file, never half of one)."""
        path = root / SHARD_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
        os.replace(tmp, path)

    @classmethod
    def read(cls, root: Path) -> ShardRecord | None:
        """`root/shard.json`, or None when it is missing or unreadable."""
        try:
            return cls.from_json(orjson.loads((root / SHARD_FILE).read_bytes()))
        except (OSError, orjson.JSONDecodeError, KeyError, ValueError, TypeError, AttributeError):
            return None
