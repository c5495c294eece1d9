"""What a Gym row's `responses_create_params` must look like before it is sent (the pre-flight row check).

Gym's agents validate the body of `/run` against the OpenAI Responses API and answer HTTP 422 for a row that
does not fit; that is a data error found after the model loaded and Gym started. `responses_params_problems`
finds the same shapes up front: `input` is required and is a string or a list of message / item objects
(`{"role", "content"}` messages, `{"type": ...}` items such as `function_call` and `function_call_output`), and
the other known fields have the types the Responses API gives them. Unknown fields are left to Gym.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

ROLES = ("user", "system", "developer", "assistant")
"""Roles of an input message."""

_NUMBER = (int, float)
FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "instructions": ((str,), "a string"),
    "model": ((str,), "a string"),
    "tools": ((list,), "a list of tool objects"),
    "tool_choice": ((str, dict), "a string or an object"),
    "parallel_tool_calls": ((bool,), "true or false"),
    "temperature": (_NUMBER, "a number"),
    "top_p": (_NUMBER, "a number"),
    "max_output_tokens": ((int,), "an integer"),
    "max_tool_calls": ((int,), "an integer"),
    "metadata": ((dict,), "an object"),
    "text": ((dict,), "an object"),
    "reasoning": ((dict,), "an object"),
    "include": ((list,), "a list"),
    "store": ((bool,), "true or false"),
    "truncation": ((str,), "a string"),
    "user": ((str,), "a string"),
    "previous_response_id": ((str,), "a string"),
}
"""Known `responses_create_params` fields other than `input` -> (JSON types, what to say). null is allowed."""

CONTENT_PART_TYPES = ("input_text", "input_image", "input_file", "input_audio", "output_text", "refusal")
"""The `type` of a message's content part (the Responses API's)."""
TEXT_PARTS = ("input_text", "output_text")
"""Content parts whose `text` must be a string."""

ITEM_STRING_FIELDS: dict[str, tuple[str, ...]] = {
    "function_call": ("name", "arguments", "call_id"),
    "function_call_output": ("call_id",),
}
"""Input item type -> fields that must be strings."""


def _is(value: Any, types: tuple[type, ...]) -> bool:
    """isinstance, except that true/false is not a number."""
    return isinstance(value, types) and (bool in types or not isinstance(value, bool))


def _shown(value: Any) -> str:
    return reprlib.repr(value)


def _item_problem(i: int, item: Any) -> str | None:
    """What is wrong with input item `i` (a message or a typed item), or None."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        return f"{where} must be a message or item object, got {_shown(item)}"
    kind = item.get("type")
    if "role" in item or kind == "message":
        if item.get("role") not in ROLES:
            return f"{where}.role must be one of {list(ROLES)}, got {_shown(item.get('role'))}"
        content = item.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") in CONTENT_PART_TYPES):
                    return f"{where}.content[{j}] must be an object with a 'type' in {list(CONTENT_PART_TYPES)}, got {_shown(part)}"
                if part["type"] in TEXT_PARTS and not isinstance(part.get("text"), str):
                    return f"{where}.content[{j}].text must be a string, got {_shown(part.get('text'))}"
        elif not isinstance(content, str):
            return f"{where}.content must be a string or a list of content parts, got {_shown(content)}"
        return None
    if not isinstance(kind, str):
        return f"{where} needs a 'role' (a message) or a string 'type' (an item), got keys {sorted(item)}"
    for key in ITEM_STRING_FIELDS.get(kind, ()):
        if not isinstance(item.get(key), str):
            return f"{where}.{key} of a {kind} item must be a string, got {_shown(item.get(key))}"
    if kind == "function_call_output" and not isinstance(item.get("output"), str | list):
        return f"{where}.output of a function_call_output item must be a string or a list, got {_shown(item.get('output'))}"
    return None


def responses_params_problems(params: Any) -> list[str]:
    """Every problem of one row's `responses_create_params` (empty when Gym would accept its shape)."""
    if not isinstance(params, Mapping):
        return [f"responses_create_params must be an object, got {_shown(params)}"]
    problems = []
    if "input" not in params:
        problems.append("responses_create_params.input is missing (a string or a list of messages)")
    else:
        value = params["input"]
        if isinstance(value, list):
            problems += [f"responses_create_params.{p}" for i, item in enumerate(value) if (p := _item_problem(i, item))]
        elif not isinstance(value, str):
            problems.append(
                f"responses_create_params.input must be a string or a list of message/item objects, got {_shown(value)}"
            )
    for key, (types, what) in FIELD_TYPES.items():
        value = params.get(key)
        if value is not None and not _is(value, types):
            problems.append(f"responses_create_params.{key} must be {what}, got {_shown(value)}")
    tools = params.get("tools")
    if isinstance(tools, list):
        bad = [j for j, tool in enumerate(tools) if not (isinstance(tool, dict) and isinstance(tool.get("type"), str))]
        if bad:
            problems.append(f"responses_create_params.tools[{bad[0]}] must be an object with a string 'type', "
                            f"got {_shown(tools[bad[0]])}")
    return problems


def gym_row_problem(row: Mapping[str, Any]) -> str | None:
    """One line naming what is wrong with a Gym row's `responses_create_params`, or None (a missing key is
    reported by the caller's required-key check)."""
    if "responses_create_params" not in row:
        return None
    problems = responses_params_problems(row["responses_create_params"])
    return "; ".join(problems) if problems else None
