"""The environment contract: a batch of message logs in, observations, rewards and terminations out."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_rl_ext.experience.records import Message


@dataclass(frozen=True)
class Observation:
    """What the environment says next; the rollout loop tokenizes it once and appends it."""

    role: str
    """Usually "tool", "user" or "environment"."""
    content: str
    """Text of the observation; empty when the environment has nothing to add."""


@dataclass(frozen=True)
class EnvironmentReturn:
    """One environment step over a batch of rollouts; every field has one entry per rollout."""

    observations: Sequence[Observation]
    """The next message for each rollout."""
    metadata: Sequence[Mapping[str, Any] | None]
    """Updated per-rollout state, passed back on the next step."""
    next_stop_strings: Sequence[tuple[str, ...] | None]
    """Stop strings for each rollout's next generation (None: the generation config's own)."""
    rewards: Sequence[float]
    """Reward of this step for each rollout."""
    terminateds: Sequence[bool]
    """True when the rollout is over."""
    answers: Sequence[str | None]
    """The answer extracted from each rollout, if any."""
    extras: Sequence[Mapping[str, Any]] | None = None
    """Per-rollout facts for the completion's `env_extras` (e.g. `vote_key`, `grading`); None: nothing."""

    def __post_init__(self) -> None:
        names = ("observations", "metadata", "next_stop_strings", "rewards", "terminateds", "answers")
        sizes = {name: len(getattr(self, name)) for name in names}
        if self.extras is not None:
            sizes["extras"] = len(self.extras)
        if len(set(sizes.values())) > 1:
            raise ValueError(f"EnvironmentReturn fields have different lengths: {sizes}")


class EnvironmentInterface(abc.ABC):
    """An environment: scores the latest assistant turn of each rollout and says what comes next."""

    @abc.abstractmethod
    async def step(
        self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn:
        """Advance every rollout by one environment step."""

    async def vote_keys(self, answers: Sequence[str | None]) -> list[str | None]:
        """The maj@k vote key of each answer: answers with equal keys are one vote; None casts no vote.

        Where keys are computed: an environment that grades an answer puts its key in
        `EnvironmentReturn.extras[i]["vote_key"]` (the built-in ones do, with this method's normalization),
        so the key is computed once, when the answer is graded, and travels in the completion's `env_extras`
        (and the eval's completions.jsonl) to maj@k; an answer without a stored key is keyed with
        `default_vote_key`. This default is `default_vote_key`; override it where answers have a looser
        equivalence (math: math-verify; string_match: its own normalization).
        """
        return [default_vote_key(a) for a in answers]

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources; optional."""


def default_vote_key(answer: Any) -> str | None:
    """The vote key of an answer that no environment keyed: its text with runs of whitespace collapsed."""
    if answer is None:
        return None
    return " ".join(str(answer).split())
