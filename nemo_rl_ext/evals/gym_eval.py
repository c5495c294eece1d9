"""The nemo_gym eval's own files: the rows sent to Gym (materialized before sending) and Gym's aggregate metrics.

- `gym_rows.jsonl`: every row POSTed to an agent's `/run`, one JSON body a line, in prompt order and, within
  a prompt, sample order (as Gym's collector writes `*_materialized_inputs.jsonl`). Written before the
  first row is sent; a resumed run sends these rows, not rows rebuilt from the config.
- `gym_aggregate_metrics.json`: per agent, what Gym's `/aggregate_metrics` answered for the results on
  disk (`agent_metrics`, `key_metrics`, `group_level_metrics`), or the error that kept it from answering.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.evals.store import CompletionStore
from nemo_rl_ext.experience.gym_rollouts import AsyncNemoGymRolloutImpl
from nemo_rl_ext.gym.client import agent_name_of

logger = logging.getLogger(__name__)

ROWS_FILE = "gym_rows.jsonl"
AGGREGATE_FILE = "gym_aggregate_metrics.json"


def materialize_rows(
    impl: AsyncNemoGymRolloutImpl, datums: Sequence[DatumSpec], expected: Mapping[int, int], root: Path,
    resuming: bool,
) -> Path:
    """Write the rows to `root/gym_rows.jsonl` (or, when resuming, read them back) and pin them in `impl`
    so that exactly these rows are sent. A file that does not fit the datums is a ConfigError."""
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
        impl.pin_rows(by_prompt)
        return path
    by_prompt = {d.idx: impl._build_inputs(d) for d in datums}
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_bytes(b"".join(orjson.dumps(r) + b"\n" for d in datums for r in by_prompt[d.idx]))
    tmp.replace(path)
    impl.pin_rows(by_prompt)
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
    impl: AsyncNemoGymRolloutImpl, datums: Sequence[DatumSpec], expected: Mapping[int, int],
    store: CompletionStore, root: Path, *, reuse: bool,
) -> dict[str, Any]:
    """Agent -> Gym's `/aggregate_metrics` answer for the results on disk, also written to
    `root/gym_aggregate_metrics.json`. `reuse`: nothing new was rolled out, so a file already there is
    kept (Gym is not started for it). An agent whose call fails gets `{"error": ...}` (not fatal)."""
    path = root / AGGREGATE_FILE
    if reuse and path.exists():
        return orjson.loads(path.read_bytes())
    from nemo_rl_ext.experience.fault_policy import describe

    client = await impl.client()
    metrics: dict[str, Any] = {}
    for agent, results in sorted(stripped_results(datums, expected, store).items()):
        try:
            answer = await client.aggregate_metrics(agent, results)
        except Exception as exc:  # an infrastructure failure: recorded, the eval's own metrics stand
            logger.warning("Gym /aggregate_metrics for agent %r failed: %s", agent, describe(exc))
            metrics[agent] = {"error": describe(exc)}
            continue
        metrics[agent] = {k: answer.get(k) for k in ("agent_metrics", "key_metrics", "group_level_metrics")}
    path.write_bytes(orjson.dumps(metrics, option=orjson.OPT_INDENT_2) + b"\n")
    return metrics


def load_aggregate(root: Path) -> dict[str, Any] | None:
    """The metrics `aggregate_metrics` wrote into `root`, or None."""
    path = root / AGGREGATE_FILE
    return orjson.loads(path.read_bytes()) if path.exists() else None
