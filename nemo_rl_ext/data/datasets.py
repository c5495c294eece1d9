"""Question/answer JSONL datasets turned into `DatumSpec`s for the math and tool environments."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from nemo_rl_ext.data.chat import tokenize_prompt
from nemo_rl_ext.data.columns import CHAT_KEY, TOOLS_KEY
from nemo_rl_ext.data.jsonl import json_lines, listed
from nemo_rl_ext.data.records import DatumSpec

if TYPE_CHECKING:  # annotations only: importing transformers takes seconds, which `--help` and config checks skip
    from transformers import PreTrainedTokenizerBase

SHIPPED_ARITHMETIC = Path(__file__).resolve().parents[2] / "examples" / "data" / "arithmetic.jsonl"


def load_jsonl(
    path: str | Path, required: Sequence[str] = (), check: Callable[[dict[str, Any]], str | None] | None = None
) -> list[dict[str, Any]]:
    """Rows of a JSONL file; every unreadable line, every row missing a required key and every row `check`
    finds a problem with (its one-line answer; None: fine) in one error."""
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for lineno, _, row in json_lines(Path(path).read_bytes(), problems):
        if not isinstance(row, dict):
            problems.append(f"line {lineno}: expected an object, got {type(row).__name__}")
            continue
        missing = [k for k in required if k not in row]
        if missing:
            problems.append(f"line {lineno}: missing key(s) {missing}")
        elif check is not None and (problem := check(row)) is not None:
            problems.append(f"line {lineno}: {problem}")
        rows.append(row)
    if problems:
        raise ValueError(f"{path}: {len(problems)} bad row(s):\n" + listed(problems))
    return rows


def datum_from_messages(
    tokenizer: PreTrainedTokenizerBase,
    idx: int,
    messages: Sequence[Mapping[str, str]],
    task_name: str,
    extra_env_info: Mapping[str, Any] | None = None,
    agent_name: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> DatumSpec:
    """A ready-to-roll-out row from plain chat messages."""
    return DatumSpec(
        idx=idx,
        message_log=tokenize_prompt(tokenizer, messages, tools),
        task_name=task_name,
        extra_env_info=dict(extra_env_info or {}),
        agent_name=agent_name,
        metadata=dict(metadata or {}),
    )


@dataclass(frozen=True)
class RowPrompt:
    """What a row adapter makes of one dataset row."""

    user_content: str
    """The user turn of the prompt (a system prompt, if any, goes before it)."""
    extra_env_info: dict[str, Any]
    """What the environment reads for this prompt (the math environments: `ground_truth`; the default adapter
    adds every other column, TRL's rule)."""
    metadata: dict[str, Any]
    """The rest of the row, carried along to the records."""
    agent_name: str | None = None
    """The row's agent (its per-agent sample count), if it names one."""
    messages: tuple[dict[str, Any], ...] | None = None
    """A chat prompt (OpenAI-format messages) instead of `user_content`."""
    tools: tuple[dict[str, Any], ...] | None = None
    """The tool definitions (OpenAI format) the chat template renders with the prompt."""


class RowAdapter(Protocol):
    """Dataset row -> `RowPrompt`; raises KeyError/ValueError for a row it can't use (the row is named)."""

    def __call__(self, row: Mapping[str, Any], *, question_key: str, answer_key: str) -> RowPrompt: ...


def qa_row(row: Mapping[str, Any], *, question_key: str = "question", answer_key: str = "answer") -> RowPrompt:
    """Question/answer rows: the question is the user turn (or `messages`, a chat prompt, with `tools`), the
    answer the `ground_truth`; the other columns are the metadata (`data.columns.normalize_row` maps the
    names of other ecosystems to these)."""
    chat = row.get(CHAT_KEY) if question_key not in row else None
    tools = row.get(TOOLS_KEY) if chat is not None else None
    used = (question_key, answer_key) + ((CHAT_KEY, TOOLS_KEY) if chat is not None else ())
    rest = {k: v for k, v in row.items() if k not in used}
    return RowPrompt(
        user_content="" if chat is not None else str(row[question_key]),
        extra_env_info={**rest, "ground_truth": str(row[answer_key])},
        metadata=rest,
        agent_name=row.get("agent_name"),
        messages=tuple(chat) if chat is not None else None,
        tools=tuple(tools) if tools is not None else None,
    )


def prompt_datum(
    tokenizer: PreTrainedTokenizerBase, idx: int, prompt: RowPrompt, task_name: str, system_prompt: str | None
) -> DatumSpec:
    """The datum of one adapted row: `system_prompt` (unless a chat prompt has its own system message) and the
    user turn, or the chat prompt."""
    if prompt.messages is not None:
        messages = [dict(m) for m in prompt.messages]
    else:
        messages = [{"role": "user", "content": prompt.user_content}]
    if system_prompt and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return datum_from_messages(
        tokenizer, idx, messages, task_name=task_name, extra_env_info=prompt.extra_env_info,
        agent_name=prompt.agent_name, metadata=prompt.metadata, tools=prompt.tools,
    )


def qa_datums(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Mapping[str, Any]],
    task_name: str,
    *,
    system_prompt: str | None = None,
    question_key: str = "question",
    answer_key: str = "answer",
    row_adapter: RowAdapter = qa_row,
) -> list[DatumSpec]:
    """One DatumSpec per row, as `row_adapter` reads it (default: the question as the user turn, the answer
    as `ground_truth`); every row the adapter refuses is named in one ValueError."""
    prompts, problems = [], []
    for idx, row in enumerate(rows):
        try:
            prompts.append(row_adapter(row, question_key=question_key, answer_key=answer_key))
        except (KeyError, ValueError, TypeError) as exc:
            problems.append(f"row {idx}: {type(exc).__name__}: {exc}")
    if problems:
        raise ValueError(f"{len(problems)} row(s) the {task_name!r} environment can't use:\n  " + "\n  ".join(problems[:20]))
    return [prompt_datum(tokenizer, idx, prompt, task_name, system_prompt) for idx, prompt in enumerate(prompts)]


NEMO_GYM_TASK = "nemo_gym"
"""task_name of every Gym row (the Gym agents, not a task_to_env entry, score them)."""


GYM_TASK_KEY = "gym_task_index"
"""`DatumSpec.metadata` key: Gym's `_ng_task_index` of the row, shared by identical rows."""
GYM_REPEAT_KEY = "gym_repeat"
"""`DatumSpec.metadata` key: how many identical rows came before this one (its samples' rollout indices
continue after theirs)."""


def prepare_gym_rows(
    rows: Sequence[dict[str, Any]],
    *,
    agent_name: str | None = None,
    responses_create_params: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Gym rows as Gym's collector prepares them (copies; `rows` is not changed).

    - `agent_ref` is the row's, else `{"name": agent_name}` (Gym's `+agent_name`); rows with neither are
      named in one error.
    - `responses_create_params` is the row's with the override's top-level keys replacing its own
      (`row | overrides`, Gym's `+responses_create_params`).
    """
    overrides = dict(responses_create_params or {})
    bad = [
        i
        for i, r in enumerate(rows)
        if not isinstance(r.get("responses_create_params"), dict)
        or not (agent_name or (isinstance(r.get("agent_ref"), dict) and r["agent_ref"].get("name")))
    ]
    if bad:
        need = "responses_create_params" + ("" if agent_name else " or agent_ref.name")
        hint = "" if agent_name else " (gym.agent_name names the agent of rows without agent_ref, like Gym's +agent_name)"
        raise ValueError(f"{len(bad)} Gym row(s) lack {need}: rows {bad[:20]}{hint}")
    prepared = []
    for row in rows:
        out = copy.deepcopy(dict(row))
        if not (isinstance(out.get("agent_ref"), dict) and out["agent_ref"].get("name")):
            out["agent_ref"] = {"name": agent_name}
        out["responses_create_params"] = {**out["responses_create_params"], **copy.deepcopy(overrides)}
        prepared.append(out)
    return prepared


def gym_task_indices(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Gym's `_ng_task_index` of each row, as Gym 0.7.0's collector assigns them: a row's own
    `_ng_task_index` is kept; the others are deduplicated, identical rows (the same JSON as read) sharing
    one index, numbered in order of first appearance."""
    task_of: dict[bytes, int] = {}
    return [
        int(r["_ng_task_index"]) if "_ng_task_index" in r
        else task_of.setdefault(orjson.dumps(r, option=orjson.OPT_SORT_KEYS), len(task_of))
        for r in rows
    ]


def gym_datums(
    rows: Sequence[dict[str, Any]],
    *,
    agent_name: str | None = None,
    responses_create_params: Mapping[str, Any] | None = None,
) -> list[DatumSpec]:
    """Gym rows as datums: no prompt tokens (the agents build the prompt), the prepared row (see
    `prepare_gym_rows`) as `extra_env_info`, and in `metadata` Gym's task index (`GYM_TASK_KEY`) and how
    many identical rows came before it (`GYM_REPEAT_KEY`). Every row must carry `responses_create_params`
    and an agent; all offenders in one error.
    """
    prepared = prepare_gym_rows(rows, agent_name=agent_name, responses_create_params=responses_create_params)
    seen: Counter[int] = Counter()
    datums = []
    for idx, (row, task) in enumerate(zip(prepared, gym_task_indices(rows), strict=True)):
        datums.append(
            DatumSpec(idx, message_log=(), task_name=NEMO_GYM_TASK, extra_env_info=row,
                      agent_name=row["agent_ref"]["name"],
                      metadata={GYM_TASK_KEY: task, GYM_REPEAT_KEY: seen[task]})
        )
        seen[task] += 1
    return datums
