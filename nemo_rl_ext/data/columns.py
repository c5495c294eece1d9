"""The columns of a question/answer dataset row, with NeMo-RL's, TRL's and verl's names, mapped to one row shape.

A row's prompt is, in this order of preference:
- the question key (`data.question_key`, NeMo-RL's `input_key`; default `question`): a string;
- `prompt` (TRL): a string, or a list of chat messages;
- `messages` (NeMo-RL's OpenAI format, with an optional `tools` column): a trailing assistant message is the
  reference answer and is not part of the prompt.

Its reference answer (what the environment reads as `ground_truth`) is the answer key (`data.answer_key`,
NeMo-RL's `output_key`; default `answer`), else the trailing assistant message, else `ground_truth`, else verl's
`reward_model.ground_truth`. Every other column is kept (TRL's rule: it reaches the environment).

`normalize_row` returns a row that `datasets.qa_row` reads: the question key (a string prompt) or `messages`
(a chat prompt, with `tools`), the answer key, and the other columns. A row that already has the question and
answer keys comes back unchanged (the JSONL rows of before).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
"""The roles of an OpenAI-format message."""
CHAT_KEY = "messages"
"""The key of a chat prompt in a normalized row."""
TOOLS_KEY = "tools"
"""The key of the tool definitions (OpenAI format) that go with a chat prompt."""


def message_problem(messages: Any) -> str | None:
    """What is wrong with an OpenAI-format message list (None: nothing): a list of objects, each with a role
    of `ROLES` and string content (an assistant message with tool calls may have none)."""
    if not isinstance(messages, list) or not messages:
        return f"messages must be a non-empty list of messages, got {type(messages).__name__}"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"messages[{i}] must be an object with role and content, got {type(message).__name__}"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}"
        if not isinstance(content, str) and not (role == "assistant" and content is None and message.get("tool_calls")):
            return f"messages[{i}].content must be a string, got {type(content).__name__}"
    return None


def _text(value: Any) -> bool:
    """Whether `value` can be a text prompt: a non-blank string, or a number (written as text, as before)."""
    if isinstance(value, str):
        return bool(value.strip())
    return isinstance(value, int | float) and not isinstance(value, bool)


def _chat_prompt(messages: Any, field: str) -> list[dict[str, Any]]:
    """`messages` as a prompt (plain dicts; None-valued keys dropped, as Arrow fills absent struct fields)."""
    problem = message_problem(messages)
    if problem is not None:
        raise ValueError(problem if field == CHAT_KEY else f"{field}: {problem}")
    return [{k: v for k, v in dict(m).items() if v is not None} for m in messages]


def _answer(row: Mapping[str, Any], answer_key: str, trailing: Any) -> Any:
    """The reference answer of `row` (see the module's docstring); KeyError when there is none."""
    if answer_key in row and row[answer_key] is not None:
        return row[answer_key]
    if trailing is not None:
        return trailing
    if row.get("ground_truth") is not None:
        return row["ground_truth"]
    reward_model = row.get("reward_model")
    if isinstance(reward_model, Mapping) and reward_model.get("ground_truth") is not None:
        return reward_model["ground_truth"]
    raise KeyError(f"missing key(s) {[answer_key]} (the reference answer; or a trailing assistant message in "
                   "'messages', 'ground_truth', 'reward_model.ground_truth')")


def normalize_row(row: Mapping[str, Any], *, question_key: str = "question", answer_key: str = "answer") -> dict[str, Any]:
    """`row` in the shape `datasets.qa_row` reads (module docstring); KeyError / ValueError naming the problem."""
    if question_key in row and answer_key in row:
        if not _text(row[question_key]):
            raise ValueError(f"{question_key!r} must be a non-empty string, got {row[question_key]!r:.60}")
        return dict(row)
    consumed = {question_key, answer_key}
    trailing = None
    if question_key in row:
        out: dict[str, Any] = {question_key: row[question_key]}
    elif "prompt" in row:
        consumed.add("prompt")
        prompt = row["prompt"]
        out = {question_key: prompt} if isinstance(prompt, str) else {CHAT_KEY: _chat_prompt(prompt, "prompt")}
    elif CHAT_KEY in row:
        consumed.add(CHAT_KEY)
        messages = _chat_prompt(row[CHAT_KEY], CHAT_KEY)
        if messages[-1]["role"] == "assistant":
            trailing = messages.pop().get("content")
        if not messages:
            raise ValueError("messages holds only the reference answer: no prompt before it")
        out = {CHAT_KEY: messages}
    else:
        missing = [k for k in (question_key, answer_key) if k not in row]
        raise KeyError(f"missing key(s) {missing} (the prompt may also be a 'prompt' or 'messages' column)")
    if question_key in out and not _text(out[question_key]):
        raise ValueError(f"the prompt must be a non-empty string, got {out[question_key]!r:.60}")
    out[answer_key] = _answer(row, answer_key, trailing)
    if CHAT_KEY in out and row.get(TOOLS_KEY) is not None:
        consumed.add(TOOLS_KEY)
        out[TOOLS_KEY] = list(row[TOOLS_KEY])
    out.update((k, v) for k, v in row.items() if k not in consumed)
    return out


def columns_problem(columns: Sequence[str], *, question_key: str = "question", answer_key: str = "answer") -> str | None:
    """What a table with these columns lacks for every row (None: each row may have what it needs)."""
    if not {question_key, "prompt", CHAT_KEY} & set(columns):
        return f"no prompt column: none of {question_key!r}, 'prompt', 'messages'"
    if not {answer_key, CHAT_KEY, "ground_truth", "reward_model"} & set(columns):
        return f"no reference answer column: none of {answer_key!r}, 'messages', 'ground_truth', 'reward_model'"
    return None
