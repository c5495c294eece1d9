"""The environment contract: a batch of message logs in, observations, rewards and terminations out."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_rl_ext.data.records import Message


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
    """Stop strings for each rollout's next generation (None: the row's `stop_strings`, else the generation
    config's own)."""
    rewards: Sequence[float]
    """Reward of this step for each rollout."""
    terminateds: Sequence[bool]
    """True when the rollout is over."""
    answers: Sequence[str | None]
    """The answer extracted from each rollout, if any."""
    extras: Sequence[Mapping[str, Any]] | None = None
    """Per-rollout facts for the completion's `env_extras` (e.g. `vote_key`, `grading`); None: nothing."""
    reward_components: Sequence[Mapping[str, float]] | None = None
    """Per-rollout named parts of this step's reward ({name: number}; the rollout sums them over turns into
    `Completion.reward_components`, as it sums `rewards`); None: the environment reports only the scalar."""

    def __post_init__(self) -> None:
        names = ("observations", "metadata", "next_stop_strings", "rewards", "terminateds", "answers")
        sizes = {name: len(getattr(self, name)) for name in names}
        for name in ("extras", "reward_components"):
            if getattr(self, name) is not None:
                sizes[name] = len(getattr(self, name))
        if len(set(sizes.values())) > 1:
            raise ValueError(f"EnvironmentReturn fields have different lengths: {sizes}")

    @classmethod
    def from_steps(
        cls, steps: Sequence[tuple[Observation, Mapping[str, Any] | None, float, bool, str | None, Mapping[str, Any]]]
    ) -> EnvironmentReturn:
        """One step from per-rollout (observation, metadata, reward, terminated, answer, extras) tuples, each
        rollout's next generation with its default stop strings."""
        return cls(
            observations=[s[0] for s in steps],
            metadata=[s[1] for s in steps],
            next_stop_strings=[None] * len(steps),
            rewards=[s[2] for s in steps],
            terminateds=[s[3] for s in steps],
            answers=[s[4] for s in steps],
            extras=[s[5] for s in steps],
        )


class EnvironmentInterface(abc.ABC):
    """An environment: scores the latest assistant turn of each rollout and says what comes next."""

    @abc.abstractmethod
    async def step(
        self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn:
        """Advance every rollout by one environment step."""

    async def vote_keys(self, answers: Sequence[str | None]) -> list[str | None]:
        """The maj@k vote key of each answer: answers with equal keys are one vote; None casts no vote.

        Keys are computed when an answer is graded: an environment puts each graded answer's key in
        `EnvironmentReturn.extras[i]["vote_key"]` (the built-in ones with this method's normalization), the
        rollout copies it into the completion's `env_extras`, the eval writes it to completions.jsonl and
        maj@k votes on it (`evals.metrics.vote_key`), so a resumed eval never grades again. An answer with no
        stored key votes with `default_vote_key`, which is also this default. Override it where answers
        have a looser equivalence (math: math-verify; string_match: its strip / case settings).
        """
        return [default_vote_key(a) for a in answers]

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources; optional."""


def default_vote_key(answer: Any) -> str | None:
    """The vote key of an answer that no environment keyed: its text with runs of whitespace collapsed."""
    if answer is None:
        return None
    return " ".join(str(answer).split())
