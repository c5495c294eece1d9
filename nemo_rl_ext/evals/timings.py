"""The rollout timings of an eval (`timings.jsonl`), kept apart from its completions.

completions.jsonl holds only what the rollouts produced, so the same seeds give the same bytes whether the
prompts ran in one process, resumed, or in shards; a wall-clock measurement would break that. The rollout
wall time of each written completion (`Completion.latency_s`) goes to this sidecar file in the same folder
instead, one JSON object per line, appended by the driver right after the completion lines:

    {"prompt_idx": 3, "sample_idx": 1, "latency_s": 0.42}

`latency_s` is null when the rollout did not measure it. The entries are appended in the order the lines are
written, so when a (prompt, sample) has several (an error, then its retry), the latest is the one of its
current line. The file is written without fsync (a measurement, not a result): a kill can leave a torn last
line, which reading ignores and the next append cuts off; a completion without an entry (written before
the file existed, or killed between the two writes) has no timing, and the profile leaves it out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.jsonl import json_lines, listed
from nemo_rl_ext.data.records import PromptGroupRecord
from nemo_rl_ext.evals.store import dumps

TIMINGS_FILE = "timings.jsonl"
"""The timings sidecar, next to completions.jsonl."""

Timings = Mapping[tuple[int, int], float]
"""(prompt_idx, sample_idx) -> the rollout wall seconds of its latest written line that has one."""


def timing_entries(record: PromptGroupRecord, skip: Collection[int] = ()) -> list[dict[str, object]]:
    """The entries of a group's completions, but those whose sample index is in `skip` (not written)."""
    return [
        {"prompt_idx": record.prompt_idx, "sample_idx": i, "latency_s": c.latency_s}
        for i, c in enumerate(record.completions)
        if i not in skip
    ]


def append_timings(folder: Path, record: PromptGroupRecord, skip: Collection[int] = ()) -> int:
    """Append the timings of a group's written completions (all but the sample indices in `skip`) to the
    folder's timings.jsonl with one write, first cutting off a torn last line; returns the entries written."""
    entries = timing_entries(record, skip)
    if not entries:
        return 0
    path = folder / TIMINGS_FILE
    with open(path, "a+b") as f:
        size = f.seek(0, 2)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":  # a torn last line from a killed run
                f.seek(0)
                f.truncate(f.read().rfind(b"\n") + 1)
        f.write(b"".join(dumps(e) + b"\n" for e in entries))
        f.flush()
    return len(entries)


def _entry_problem(row: object) -> str | None:
    if not isinstance(row, dict):
        return f"not an object: {row!r}"
    missing = [k for k in ("prompt_idx", "sample_idx", "latency_s") if k not in row]
    if missing:
        return f"missing key(s): {', '.join(missing)}"
    wrong = [
        f"{k}={row[k]!r}"
        for k, ok in (
            ("prompt_idx", lambda v: isinstance(v, int) and not isinstance(v, bool)),
            ("sample_idx", lambda v: isinstance(v, int) and not isinstance(v, bool)),
            ("latency_s", lambda v: v is None or (isinstance(v, int | float) and not isinstance(v, bool))),
        )
        if not ok(row[k])
    ]
    return f"wrong type: {', '.join(wrong)}" if wrong else None


def read_timings(folder: Path) -> dict[tuple[int, int], float]:
    """The folder's timings (`Timings`): per (prompt, sample), its latest entry's latency; pairs whose latest
    entry is null are left out. No file: {}. A torn last line (no newline: a killed run) is ignored; any
    other unreadable line raises ConfigError naming the file and every such line."""
    path = folder / TIMINGS_FILE
    if not path.exists():
        return {}
    data = path.read_bytes()
    data = data[: data.rfind(b"\n") + 1]
    latest: dict[tuple[int, int], float | None] = {}
    problems: list[str] = []
    for lineno, _, row in json_lines(data, problems):
        problem = _entry_problem(row)
        if problem:
            problems.append(f"line {lineno}: {problem}")
            continue
        latency = row["latency_s"]
        latest[(row["prompt_idx"], row["sample_idx"])] = None if latency is None else float(latency)
    if problems:
        raise ConfigError(
            f"{path}: {len(problems)} unreadable line(s), not from a killed run (fix the lines, or delete the file: "
            f"the profile then has no latencies):\n{listed(problems)}"
        )
    return {key: v for key, v in latest.items() if v is not None}
