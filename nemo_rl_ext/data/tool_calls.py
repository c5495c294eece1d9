"""Tool calls in the Qwen/Hermes text format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Used by tool-calling environments and by the OpenAI-compatible policy server (to build `tool_calls`), so it
depends on nothing but the standard library.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

TOOL_CALL_OPEN = "<tool_call>"
"""Tag that opens a tool call."""
TOOL_CALL_CLOSE = "</tool_call>"
"""Tag that closes a tool call."""
MAX_TOOL_CALL_CHARS = 32_768
"""Longest tool call body accepted (characters); a longer one is a malformed call (an error message)."""
MAX_TOOL_CALL_DEPTH = 64
"""Deepest JSON nesting accepted in a call or its string `arguments` (deeper JSON would exhaust the stack)."""

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]', re.DOTALL)  # a string (maybe unclosed) or a bracket


@dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call found in model text."""

    name: str
    """Name of the called tool."""
    arguments: dict[str, Any]
    """Decoded arguments (a JSON-string `arguments` is decoded too); treat as read-only."""
    raw: str
    """The call's full text as the model wrote it, tags included."""


class ParsedToolCalls(NamedTuple):
    """What `parse_tool_calls` found; unpacks as `(content, calls, errors)`."""

    content: str
    """The text with every well-formed call removed (malformed blocks stay), stripped."""
    calls: list[ToolCall]
    """The well-formed calls, in text order."""
    errors: list[str]
    """One message per malformed call, in text order."""


def parse_tool_calls(
    text: str, max_chars: int = MAX_TOOL_CALL_CHARS, max_depth: int = MAX_TOOL_CALL_DEPTH
) -> ParsedToolCalls:
    """Find the `<tool_call>` blocks in `text`; malformed blocks become error messages, never exceptions.

    A trailing `<tool_call>` without its closing tag (generation stopped at `</tool_call>`, which engines
    usually leave out of the output) is parsed like a closed one. A block longer than `max_chars` or whose
    JSON nests deeper than `max_depth` is malformed (hostile input: it must not exhaust memory or the stack).
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    kept: list[str] = []
    position = 0
    blocks = [(m.start(), m.end(), m.group(1)) for m in _BLOCK.finditer(text)]
    tail_start = text.find(TOOL_CALL_OPEN, blocks[-1][1] if blocks else 0)
    if tail_start != -1:
        blocks.append((tail_start, len(text), text[tail_start + len(TOOL_CALL_OPEN) :]))
    for number, (start, end, body) in enumerate(blocks, start=1):
        raw = text[start:end]
        call, error = _parse_block(body, raw, max_chars, max_depth)
        kept.append(text[position:start])
        if call is not None:
            calls.append(call)
        else:
            kept.append(raw)
            unclosed = "" if raw.endswith(TOOL_CALL_CLOSE) else " (unclosed)"
            errors.append(f"tool call {number}{unclosed}: {error}")
        position = end
    kept.append(text[position:])
    return ParsedToolCalls("".join(kept).strip(), calls, errors)


def _parse_block(body: str, raw: str, max_chars: int, max_depth: int) -> tuple[ToolCall | None, str]:
    """One block's body → (call, "") or (None, why it is malformed)."""
    body = body.strip()
    if len(body) > max_chars:
        return None, f"tool call is {len(body)} characters long, more than the {max_chars} allowed"
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    if not body:
        return None, "empty tool call"
    payload, error = _bounded_json(body, max_depth)
    if error:
        return None, error
    if not isinstance(payload, dict):
        return None, f"expected a JSON object, got {type(payload).__name__}"
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return None, "missing or non-string 'name'"
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        arguments, error = _bounded_json(arguments, max_depth) if arguments.strip() else ({}, "")
        if error:
            return None, f"'arguments' of {name!r} is a string but not valid JSON: {error}"
    if not isinstance(arguments, dict):
        return None, f"'arguments' of {name!r} must be an object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments, raw=raw), ""


def _bounded_json(text: str, max_depth: int) -> tuple[Any, str]:
    """json.loads(text) → (value, ""), or (None, why not) when it is invalid or nests deeper than `max_depth`."""
    depth = deepest = 0
    for token in _JSON_TOKEN.findall(text):  # one linear pass; brackets inside strings do not count
        if token[0] == '"':
            continue
        depth = depth + 1 if token in "[{" else depth - 1
        deepest = max(deepest, depth)
    if deepest > max_depth:
        return None, f"JSON nested {deepest} levels deep, more than the {max_depth} allowed"
    try:
        return json.loads(text), ""
    except json.JSONDecodeError as e:
        return None, f"invalid JSON: {e}"
    except RecursionError:  # the count above missed a nesting (it cannot, but the stack must survive)
        return None, f"JSON nested more than {max_depth} levels deep"
