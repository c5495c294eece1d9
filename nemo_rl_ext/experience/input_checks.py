"""A dataset checked before any model loads: the file exists, its rows parse, every row's agent has a count.

A run calls these from its config's `input_problems` so that a missing file or a missing `_default` is one
message naming the config key and the file, seconds after start, not a traceback after the model loaded.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from nemo_rl_ext.data.generation_counts import GenerationCountError, GenerationCounts


def dataset_problems(
    key: str,
    path: str | Path,
    *,
    gym_rows: bool,
    task_name: str | None,
    required: Sequence[str],
    counts: int | Mapping[str, int],
    counts_key: str,
    limit: int | None = None,
    gym_agent_name: str | None = None,
) -> list[str]:
    """Every problem of the dataset at `path` (config key `key`) for a run with these sample `counts`.

    `gym_rows`: NeMo Gym rows (agent from `agent_ref.name`); else question/answer rows with the `required`
    keys, whose agent is their `agent_name`, else `task_name` (as `DatumSpec.agent`). `limit`: only the
    first rows are rolled out, so only they need a count. `gym_agent_name`: the agent of Gym rows without
    `agent_ref` (`gym.agent_name`).
    """
    from nemo_rl_ext.data.datasets import gym_datums, load_jsonl

    path = Path(path)
    if not path.is_file():
        return [f"{key}: file not found: {path}"]
    try:
        if gym_rows:
            rows = load_jsonl(path, required=("responses_create_params",))[:limit]
            agents = [d.agent for d in gym_datums(rows, agent_name=gym_agent_name)]
        else:
            rows = load_jsonl(path, required=required)[:limit]
            agents = [str(row.get("agent_name") or task_name) for row in rows]
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        message = str(exc)
        return [f"{key}: {message if str(path) in message else f'{path}: {message}'}"]
    try:
        with warnings.catch_warnings():  # unused count keys: the manager warns about those itself
            warnings.simplefilter("ignore", UserWarning)
            GenerationCounts.parse(counts).preflight(enumerate(agents))
    except GenerationCountError as exc:
        return [f"{counts_key}: rows of {path}: {str(exc).replace('num_generations_per_prompt', counts_key)}"]
    return []
