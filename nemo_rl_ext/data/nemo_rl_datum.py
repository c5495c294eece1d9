"""NeMo-RL's dataset row (`nemo_rl.data.interfaces.DatumSpec`, a TypedDict) and its message dicts, read into
our records, so that code written against NeMo-RL passes its datums unchanged.

NeMo-RL's row: `message_log` (dicts with `role`, `content`, `token_ids`: a 1-D tensor), `length`,
`extra_env_info`, `loss_multiplier`, `idx`, and optionally `task_name`, `stop_strings` and any other key.
Token ids may be tensors, numpy arrays or lists. Keys we have no field for (`length` among them) are kept
in `metadata`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_rl_ext.data.records import DatumSpec, Message

REQUIRED_KEYS = ("message_log", "length", "extra_env_info", "loss_multiplier", "idx", "task_name")
"""The keys a row must have: NeMo-RL's required ones, and `task_name` (optional in its TypedDict, but every
rollout reads it to pick the environment)."""

_FIELDS = {"message_log", "extra_env_info", "loss_multiplier", "idx", "task_name", "stop_strings", "agent_name"}
"""Keys that become `DatumSpec` fields; every other key goes to `metadata`."""


def as_datum(sample: DatumSpec | Mapping[str, Any]) -> DatumSpec:
    """`sample` itself if it is a `DatumSpec`; a NeMo-RL row (a mapping) read with `datum_from_nemo_rl`."""
    if isinstance(sample, DatumSpec):
        return sample
    if isinstance(sample, Mapping):
        return datum_from_nemo_rl(sample)
    raise TypeError(f"expected a DatumSpec or a NeMo-RL DatumSpec dict, got {type(sample).__name__}")


def datum_from_nemo_rl(row: Mapping[str, Any]) -> DatumSpec:
    """Our `DatumSpec` from NeMo-RL's; one ValueError naming every missing key and every bad value."""
    problems: list[str] = []
    missing = [k for k in REQUIRED_KEYS if k not in row]
    if missing:
        problems.append(f"missing key(s) {', '.join(repr(k) for k in missing)}")
    idx = _index(row, "idx", problems)
    _index(row, "length", problems)
    messages = _messages(row.get("message_log"), problems) if "message_log" in row else ()
    info = row.get("extra_env_info")
    if info is not None and not isinstance(info, Mapping):
        problems.append(f"extra_env_info must be a dict or None, got {type(info).__name__}")
    task = row.get("task_name")
    if "task_name" in row and not isinstance(task, str):
        problems.append(f"task_name must be a str, got {task!r}")
    stops = row.get("stop_strings")
    if stops is not None and (isinstance(stops, str) or not all(isinstance(s, str) for s in stops)):
        problems.append(f"stop_strings must be a list of str or None, got {stops!r}")
    multiplier = _loss_multiplier(row, problems)
    if problems:
        where = f" (idx {idx})" if idx is not None else ""
        raise ValueError(f"NeMo-RL DatumSpec{where}: " + "; ".join(problems))
    return DatumSpec(
        idx=idx,
        message_log=messages,
        task_name=task,
        extra_env_info=dict(info or {}),
        agent_name=row.get("agent_name"),
        metadata={k: v for k, v in row.items() if k not in _FIELDS},
        stop_strings=None if stops is None else tuple(stops),
        loss_multiplier=multiplier,
    )


def message_from_nemo_rl(message: Mapping[str, Any], where: str = "message") -> Message:
    """Our `Message` from a NeMo-RL message dict (`role`, `content`, `token_ids`, optional
    `generation_logprobs`); one ValueError naming every problem."""
    problems: list[str] = []
    result = _message(message, where, problems)
    if problems:
        raise ValueError("; ".join(problems))
    assert result is not None
    return result


def _messages(log: Any, problems: list[str]) -> tuple[Message, ...]:
    if isinstance(log, str | bytes | Mapping) or not isinstance(log, Sequence):
        problems.append(f"message_log must be a list of message dicts, got {type(log).__name__}")
        return ()
    messages = [_message(m, f"message_log[{i}]", problems) for i, m in enumerate(log)]
    return tuple(m for m in messages if m is not None)


def _message(message: Any, where: str, problems: list[str]) -> Message | None:
    if not isinstance(message, Mapping):
        problems.append(f"{where} must be a dict, got {type(message).__name__}")
        return None
    missing = [k for k in ("role", "content", "token_ids") if k not in message]
    if missing:
        problems.append(f"{where}: missing key(s) {', '.join(repr(k) for k in missing)}")
        return None
    before = len(problems)
    role, content = message["role"], message["content"]
    if not isinstance(role, str):
        problems.append(f"{where}.role must be a str, got {role!r}")
    if content is not None and not isinstance(content, str):
        problems.append(f"{where}.content must be a str, got {type(content).__name__}")
    ids = _numbers(message["token_ids"], f"{where}.token_ids", integers=True, problems=problems)
    logprobs = None
    if message.get("generation_logprobs") is not None:
        logprobs = _numbers(message["generation_logprobs"], f"{where}.generation_logprobs", False, problems)
    if len(problems) > before:
        return None
    try:
        return Message(role, content or "", ids, logprobs)
    except ValueError as exc:  # logprobs of another length than the ids
        problems.append(f"{where}: {exc}")
        return None


def _numbers(value: Any, where: str, integers: bool, problems: list[str]) -> tuple:
    """A 1-D tensor, array or sequence as a tuple of ints (or floats)."""
    items = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(items, str | bytes) or not isinstance(items, Sequence):
        problems.append(f"{where} must be a 1-D tensor or list, got {type(value).__name__}")
        return ()
    kind = (int,) if integers else (int, float)
    bad = [x for x in items if isinstance(x, bool) or not isinstance(x, kind)]
    if bad:
        what = "ints" if integers else "numbers"
        problems.append(f"{where} must hold {what} (a 1-D tensor or list), got {bad[0]!r}")
        return ()
    return tuple(items) if integers else tuple(float(x) for x in items)


def _index(row: Mapping[str, Any], key: str, problems: list[str]) -> int | None:
    if key not in row:
        return None
    value = row[key]
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        problems.append(f"{key} must be an int, got {value!r}")
        return None
    if number < 0:
        problems.append(f"{key} must be >= 0, got {number}")
        return None
    return number


def _loss_multiplier(row: Mapping[str, Any], problems: list[str]) -> float:
    value = row.get("loss_multiplier", 1.0)
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 0:
        problems.append(f"loss_multiplier must be a finite number >= 0, got {value!r}")
    return number
