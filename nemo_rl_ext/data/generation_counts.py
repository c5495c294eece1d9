"""Per-agent generation counts: `int | {agent_name: int, "_default": int}`, validated once."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nemo_rl_ext.config import ConfigError

DEFAULT_KEY = "_default"


class GenerationCountError(ConfigError):
    """A generation-count setting or a dataset that doesn't fit it (a user error: the CLIs print it alone)."""


@dataclass(frozen=True)
class GenerationCounts:
    """How many completions each agent's prompts get."""

    per_agent: Mapping[str, int]
    """Explicit counts by agent name."""
    default: int | None
    """Count for agents not in `per_agent`; None means such agents are an error."""

    @classmethod
    def parse(cls, value: int | Mapping[str, int]) -> GenerationCounts:
        """Validate `num_generations_per_prompt`, reporting every bad value in one error."""
        if isinstance(value, bool) or not isinstance(value, int | Mapping):
            raise GenerationCountError(
                f"num_generations_per_prompt must be an int or a dict of agent name -> int, got {value!r}"
            )
        if isinstance(value, int):
            if value < 1:
                raise GenerationCountError(f"num_generations_per_prompt must be >= 1, got {value}")
            return cls(per_agent={}, default=value)
        bad = {
            key: count
            for key, count in value.items()
            if isinstance(count, bool) or not isinstance(count, int) or count < 1
        }
        if bad:
            listed = ", ".join(f"{key!r}: {count!r}" for key, count in bad.items())
            raise GenerationCountError(
                f"num_generations_per_prompt values must be integers >= 1; bad entries: {{{listed}}}"
            )
        per_agent = {str(k): int(v) for k, v in value.items() if k != DEFAULT_KEY}
        default = value.get(DEFAULT_KEY)
        return cls(per_agent=per_agent, default=None if default is None else int(default))

    def for_agent(self, agent: str) -> int:
        """The count for one agent; raises if it has no entry and there is no `_default`."""
        if agent in self.per_agent:
            return self.per_agent[agent]
        if self.default is None:
            raise GenerationCountError(
                f"agent {agent!r} has no entry in num_generations_per_prompt and there is no "
                f"{DEFAULT_KEY!r}; known agents: {sorted(self.per_agent)}"
            )
        return self.default

    def preflight(self, rows: Iterable[tuple[int, str]], *, warn_unused: bool = True) -> None:
        """Check a dataset before any generation, given (row index, agent name) pairs.

        Every row whose agent has no count is reported in one error; with `warn_unused`, dict keys that
        match no row give one UserWarning listing them (a typo catcher; off for a batch of a dataset).
        """
        rows = list(rows)
        missing: dict[str, list[int]] = {}
        if self.default is None:
            for idx, agent in rows:
                if agent not in self.per_agent:
                    missing.setdefault(agent, []).append(idx)
        if missing:
            detail = "; ".join(f"agent {agent!r}: rows {idxs}" for agent, idxs in missing.items())
            raise GenerationCountError(
                f"{sum(len(v) for v in missing.values())} row(s) have an agent with no entry in "
                f"num_generations_per_prompt and there is no {DEFAULT_KEY!r} — {detail}"
            )
        seen = {agent for _, agent in rows}
        unused = sorted(set(self.per_agent) - seen)
        if unused and warn_unused:
            warnings.warn(
                f"num_generations_per_prompt has keys that match no row's agent: {unused} "
                f"(agents in the data: {sorted(seen)})",
                UserWarning,
                stacklevel=2,
            )
