"""A store's runs.jsonl: one JSON line per invocation that rolled out into it, as typed records.

    {"groups_generated": 3, "completions_written": 12, "errors_written": 0, "retried": 0,
     "skipped_completions": 4, "wall_time_s": 8.1, "rollout_metrics": {...}}       # run_eval (one process, a job)
    {"worker": "worker-1", "groups_generated": 5, "completions_written": 20, "errors_written": 1,
     "wall_time_s": 30.2}                                                             # a Ray worker's incarnation

`to_json()` gives exactly these keys in this order (the bytes the file has always held).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_rl_ext.evals.store import dumps


def append_line(path: Path, obj: Mapping[str, Any]) -> None:
    """Append one JSON line to `path`."""
    with open(path, "ab") as f:
        f.write(dumps(obj) + b"\n")


@dataclass(frozen=True)
class RunRecord:
    """What one `run_eval` invocation did in a store (a line of its runs.jsonl)."""

    groups_generated: int
    """Groups rolled out."""
    completions_written: int
    """Lines appended (error lines included)."""
    errors_written: int
    """Error lines appended."""
    retried: int
    """(prompt, sample) pairs whose latest line was an error when it started."""
    skipped_completions: int
    """(prompt, sample) pairs whose result was on disk already."""
    wall_time_s: float
    """Its wall time."""
    rollout_metrics: Mapping[str, float] = field(default_factory=dict)
    """The manager's metrics over its groups (empty when nothing was generated)."""

    def to_json(self) -> dict[str, Any]:
        """The runs.jsonl object."""
        return {
            "groups_generated": self.groups_generated,
            "completions_written": self.completions_written,
            "errors_written": self.errors_written,
            "retried": self.retried,
            "skipped_completions": self.skipped_completions,
            "wall_time_s": self.wall_time_s,
            "rollout_metrics": dict(self.rollout_metrics),
        }


@dataclass(frozen=True)
class WorkerStats:
    """What a Ray eval worker generated (what its `run` returns to the driver, over the Ray boundary)."""

    groups_generated: int = 0
    """Groups rolled out."""
    completions_written: int = 0
    """Lines appended (error lines included)."""
    errors_written: int = 0
    """Error lines appended."""

    def plus(self, groups: int, written: int, errors: int) -> WorkerStats:
        """These counts with one more batch added."""
        return dataclasses.replace(
            self,
            groups_generated=self.groups_generated + groups,
            completions_written=self.completions_written + written,
            errors_written=self.errors_written + errors,
        )

    def run_json(self, worker: str, wall_time_s: float) -> dict[str, Any]:
        """The runs.jsonl object of one worker incarnation: `worker`, these counts, `wall_time_s`."""
        return {
            "worker": worker,
            "groups_generated": self.groups_generated,
            "completions_written": self.completions_written,
            "errors_written": self.errors_written,
            "wall_time_s": wall_time_s,
        }
