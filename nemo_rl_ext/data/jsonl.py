"""Reading JSON Lines: every line parsed, and every unreadable one reported, each named by its line number."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import orjson

MAX_LISTED = 20
"""Problems listed by name in one message (all of them are counted)."""


def json_lines(data: bytes | str, problems: list[str]) -> Iterator[tuple[int, bytes, Any]]:
    """(line number, line, parsed value) of each non-blank line of `data` that parses; a line that does not
    adds `line N: not JSON (...)` to `problems` (so a caller can report every bad line at once)."""
    raw = data.encode() if isinstance(data, str) else data
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield lineno, line, orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.append(f"line {lineno}: not JSON ({exc})")


def listed(problems: Sequence[str], limit: int = MAX_LISTED) -> str:
    """The first `limit` problems, one per indented line, and how many more there are."""
    shown = "\n  ".join(problems[:limit])
    more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
    return f"  {shown}{more}"
