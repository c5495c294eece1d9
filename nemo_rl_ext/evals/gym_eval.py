"""The nemo_gym eval's own files: the rows sent to Gym (materialized before sending) and Gym's aggregate metrics.
The driver calls these in every mode; a manager that sends no rows and has no aggregate of its own (native mode)
makes them write nothing (`RolloutManager.request_rows` / `aggregate_metrics` answer None).

- `gym_rows.jsonl`: every row POSTed to an agent's `/run`, one JSON body a line, in prompt order and, within
  a prompt, sample order (as Gym's collector writes `*_materialized_inputs.jsonl`). Written before the
  first row is sent; a resumed run sends these rows, not rows rebuilt from the config.
- `gym_aggregate_metrics.json`: per agent, what Gym's `/aggregate_metrics` answered for the results on
  disk (`agent_metrics`, `key_metrics`, `group_level_metrics`), or the error that kept it from answering.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.evals.store import CompletionStore
from nemo_rl_ext.evals.summary import GymAgentMetrics
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.gym.client import agent_name_of

ROWS_FILE = "gym_rows.jsonl"
AGGREGATE_FILE = "gym_aggregate_metrics.json"


def prepare_rows(
    manager: RolloutManager, datums: Sequence[DatumSpec], expected: Mapping[int, int], root: Path, resuming: bool,
    rebuilt: Collection[int] = (),
) -> Path | None:
    """Pin in `manager` the rows it sends for `datums`, written to `root/gym_rows.jsonl` first (or, when resuming,
    read back from it, but for the prompts of `rebuilt`, whose dataset row was fixed after Gym refused it: their
    rows are built again and the file rewritten), so that exactly these rows are sent; returns the file. A
    manager that sends no rows (native mode) writes nothing: None. A file that does not fit the datums is a
    ConfigError."""
    built = manager.request_rows(datums)
    if built is None:
        return None
    path = root / ROWS_FILE
    if resuming and path.exists():
        lines = path.read_bytes().splitlines()
        if len(lines) != sum(expected[d.idx] for d in datums):
            raise ConfigError(
                f"{path}: {len(lines)} row(s), but this eval sends {sum(expected.values())}; "
                "the rows were written for another selection (move the file aside to rebuild it)"
            )
        try:
            rows = [orjson.loads(line) for line in lines]
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{path}: unreadable ({exc}); move it aside to rebuild it") from None
        by_prompt, at = {}, 0
        for d in datums:
            by_prompt[d.idx], at = rows[at : at + expected[d.idx]], at + expected[d.idx]
        agents = {d.idx: agent_name_of(d.extra_env_info) for d in datums}
        bad = [idx for idx, group in by_prompt.items() if any(not _for_agent(r, agents[idx]) for r in group)]
        if bad:
            raise ConfigError(f"{path}: the rows of prompt(s) {bad[:20]} are for another agent than the dataset's")
        fixed = [idx for idx in by_prompt if idx in rebuilt]
        if not fixed:
            manager.pin_rows(by_prompt)
            return path
        built = {**by_prompt, **{idx: built[idx] for idx in fixed}}
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for d in datums for r in built[d.idx]))
    tmp.replace(path)
    manager.pin_rows(built)
    return path


def _for_agent(row: Any, agent: str) -> bool:
    """True when `row` is a Gym row for `agent`."""
    try:
        return isinstance(row, dict) and agent_name_of(row) == agent
    except ValueError:
        return False


def stripped_results(
    datums: Sequence[DatumSpec], expected: Mapping[int, int], store: CompletionStore
) -> dict[str, list[dict[str, Any]]]:
    """Agent -> the Gym results on disk (errors left out), without `response` (but its `usage`) and
    `responses_create_params`, as Gym's collector sends them to `/aggregate_metrics`."""
    out: dict[str, list[dict[str, Any]]] = {}
    for d in datums:
        for s in range(expected[d.idx]):
            line = store.line(d.idx, s)
            if line is None or line.is_error or not isinstance(result := line.env_extras.get("gym_result"), dict):
                continue
            entry = {k: v for k, v in result.items() if k not in ("response", "responses_create_params")}
            usage = (result.get("response") or {}).get("usage")
            if usage:
                entry["response"] = {"usage": usage}
            out.setdefault(line.agent, []).append(entry)
    return out


async def aggregate_metrics(
    manager: RolloutManager, datums: Sequence[DatumSpec], expected: Mapping[int, int],
    store: CompletionStore, root: Path, *, reuse: bool,
) -> dict[str, Any] | None:
    """Agent -> the manager's own aggregate of the results on disk (nemo_gym: Gym's `/aggregate_metrics`, while
    Gym is up), also written to `root/gym_aggregate_metrics.json`; None, and nothing written, for a manager
    without one (native mode). `reuse`: nothing new was rolled out, so a file already there is kept (Gym is not
    started for it) unless an agent's entry is an error. An agent whose call fails gets `{"error": ...}` (not
    fatal; a server known to be down is not called at all, see `GymClient.aggregate_metrics`)."""
    path = root / AGGREGATE_FILE
    if reuse and path.exists():
        kept = orjson.loads(path.read_bytes())
        if not any("error" in entry for entry in kept.values()):  # one that failed is asked for again
            return kept
    metrics = await manager.aggregate_metrics(stripped_results(datums, expected, store))
    if metrics is None:
        return None
    path.write_bytes(orjson.dumps(metrics, option=orjson.OPT_INDENT_2) + b"\n")
    return metrics


def load_aggregate(root: Path) -> dict[str, Any] | None:
    """The metrics `aggregate_metrics` wrote into `root`, or None."""
    path = root / AGGREGATE_FILE
    return orjson.loads(path.read_bytes()) if path.exists() else None


def summary_metrics(root: Path) -> dict[str, GymAgentMetrics] | None:
    """The summary's `gym_metrics` from `root/gym_aggregate_metrics.json` (per agent, without the per-task
    `group_level_metrics`, which stay in the file); None without the file (native mode)."""
    aggregate = load_aggregate(root)
    if aggregate is None:
        return None
    return {agent: GymAgentMetrics.from_json(entry) for agent, entry in aggregate.items()}
