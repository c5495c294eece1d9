"""The single-step `string_match` environment: reward for answering exactly (or nearly) a target string.

A task any model can learn, whatever it knows: a smoke test for training loops (a random-init model learns
to emit the target within a few dozen GRPO steps) and a simple format-following reward.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Observation
from nemo_rl_ext.environments.math_env import ground_truth_of, last_assistant_content
from nemo_rl_ext.environments.registry import register_environment

MatchMode = Literal["exact", "similarity", "prefix"]


def match_reward(response: str, target: str, mode: MatchMode = "similarity") -> float:
    """Reward of `response` against `target`, in [0, 1]; 1.0 exactly when they are equal.

    - `exact`: 1.0 if equal, else 0.0.
    - `similarity`: difflib's ratio 2 * matched characters / (len(response) + len(target)).
    - `prefix`: length of the common prefix / max(len(response), len(target)).
    """
    if mode == "exact":
        return 1.0 if response == target else 0.0
    if mode == "similarity":
        if not response and not target:
            return 1.0
        return difflib.SequenceMatcher(None, response, target, autojunk=False).ratio()
    if mode == "prefix":
        longest = max(len(response), len(target))
        if longest == 0:
            return 1.0
        common = 0
        for a, b in zip(response, target, strict=False):
            if a != b:
                break
            common += 1
        return common / longest
    raise ValueError(f"mode must be 'exact', 'similarity' or 'prefix', got {mode!r}")


@register_environment("string_match")
class StringMatchEnvironment(EnvironmentInterface):
    """Scores the last assistant message against `metadata[i]["ground_truth"]` with `match_reward`.

    `strip` trims whitespace of both sides first; `case_sensitive=False` compares lower-cased text.
    The answer reported is the (trimmed) response, and its maj@k vote key (`extras[i]["vote_key"]`) is the
    response as compared, so responses that differ only in what `strip` / `case_sensitive` ignore share a vote.
    Always terminates after one turn.
    """

    def __init__(self, mode: MatchMode = "similarity", strip: bool = True, case_sensitive: bool = True) -> None:
        if mode not in ("exact", "similarity", "prefix"):
            raise ValueError(f"mode must be 'exact', 'similarity' or 'prefix', got {mode!r}")
        self.mode: MatchMode = mode
        self.strip = strip
        self.case_sensitive = case_sensitive

    def _normalize(self, text: str) -> str:
        text = text.strip() if self.strip else text
        return text if self.case_sensitive else text.lower()

    async def step(
        self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"{len(message_logs)} message logs but {len(metadata)} metadata entries")
        targets = [self._normalize(str(ground_truth_of(m, i))) for i, m in enumerate(metadata)]
        responses = [self._normalize(last_assistant_content(log) or "") for log in message_logs]
        n = len(responses)
        return EnvironmentReturn(
            observations=[Observation(role="environment", content="")] * n,
            metadata=[dict(m or {}) for m in metadata],
            next_stop_strings=[None] * n,
            rewards=[match_reward(r, t, self.mode) for r, t in zip(responses, targets, strict=True)],
            terminateds=[True] * n,
            answers=responses,
            extras=[{"vote_key": r} for r in responses],
        )

    async def vote_keys(self, answers: Sequence[str | None]) -> list[str | None]:
        """The answer as this environment compares it (trimmed / lower-cased as configured)."""
        return [None if a is None else self._normalize(a) for a in answers]
