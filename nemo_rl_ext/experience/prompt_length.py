"""Prompts too long to generate from: found per completion, counted per prompt, and said once per run.

A prompt that alone fills the context (`policy.max_model_len`, `rollouts.max_seq_len`) ends every sample
truncated at 0 turns with reward 0, which looks like a model that answers nothing. Both rollout modes mark
such a completion (`records.PROMPT_TOO_LONG` in its `env_extras`); the eval counts the prompts in its summary
(`num_prompts_too_long`), GRPO in its step metrics (`rollout/prompts_too_long`), and each logs one warning per
run (`PromptLengthWarning`) naming the longest prompt and the settings to raise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_rl_ext.data.records import PROMPT_TOO_LONG, Completion, PromptGroupRecord

logger = logging.getLogger(__name__)

SETTINGS = "policy.max_model_len and rollouts.max_seq_len"
"""The settings that bound a rollout's context (the smaller one wins)."""


def too_long_extras(prompt_tokens: int | None, limit: int | None) -> dict[str, Any]:
    """The `env_extras` entry that marks a completion whose prompt left no room to generate."""
    return {PROMPT_TOO_LONG: {"prompt_tokens": prompt_tokens, "limit": limit}}


def prompt_too_long(completion: Completion) -> Mapping[str, Any] | None:
    """The completion's mark (`too_long_extras`), or None when its prompt had room."""
    return completion.env_extras.get(PROMPT_TOO_LONG)


def count_prompts_too_long(records: Sequence[PromptGroupRecord]) -> tuple[int, int | None]:
    """(prompts with a sample whose prompt left no room, the longest of them in tokens or None if unknown)."""
    marks = [[m for c in r.completions if (m := prompt_too_long(c)) is not None] for r in records]
    lengths = [m["prompt_tokens"] for ms in marks for m in ms if isinstance(m.get("prompt_tokens"), int)]
    return sum(bool(ms) for ms in marks), max(lengths) if lengths else None


def prompts_too_long_message(count: int, num_prompts: int | None, longest: int | None) -> str:
    """One line: how many prompts left no room to generate, the longest, and the settings to raise."""
    of = f" of {num_prompts}" if num_prompts is not None else ""
    size = f"the longest is {longest} tokens" if longest is not None else "their length is unknown"
    return (
        f"{count}{of} prompt(s) too long: the prompt alone left no room to generate, so those samples ended "
        f"truncated at 0 turns with reward 0 ({size}). Raise {SETTINGS} (e.g. policy.max_model_len=8192 "
        "rollouts.max_seq_len=8192), or shorten the prompts."
    )


class PromptLengthWarning:
    """Logs the prompts-too-long warning at most once (one per run: create one per run)."""

    def __init__(self) -> None:
        self.warned = False
        """True once the warning was logged."""

    def __call__(self, count: int, num_prompts: int | None, longest: int | None) -> None:
        """Log the warning if `count` > 0 and it was not logged yet."""
        if count and not self.warned:
            self.warned = True
            logger.warning("%s", prompts_too_long_message(count, num_prompts, longest))
