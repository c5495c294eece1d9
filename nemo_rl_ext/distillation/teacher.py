"""What a teacher is: something that scores token sequences (`Teacher.score`), and what it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class TeacherError(RuntimeError):
    """A teacher could not score a sequence (a dead or slow server, a refused request): an infrastructure
    failure, never the model's answer; the completion it was scoring becomes an error completion."""


@dataclass(frozen=True)
class TeacherScores:
    """A teacher's scores of one token sequence: entry i scores id i + 1 given ids 0..i (the first id has no
    context, so n ids have n - 1 scores)."""

    logprobs: tuple[float, ...]
    """The teacher's logprob of each id after the first, in its context (temperature 1)."""
    topk_ids: tuple[tuple[int, ...], ...] | None = None
    """With top_k > 0: the teacher's k likeliest ids at each of those positions, likeliest first; else None."""
    topk_logprobs: tuple[tuple[float, ...], ...] | None = None
    """Their logprobs (same shape as `topk_ids`); None without top-k."""


class Teacher(ABC):
    """A frozen model that scores the student's exact token ids: local (`local_teacher`) or served over HTTP
    (`http_teacher`)."""

    name: str
    """The model name, folder or URL the config gave (what errors and metrics name it by)."""

    @abstractmethod
    async def score(self, sequences: Sequence[Sequence[int]], top_k: int = 0) -> list[TeacherScores]:
        """Each sequence's `TeacherScores` (in order), batched as the teacher likes; `TeacherError` when the
        teacher cannot answer."""

    def close(self) -> None:  # noqa: B027 - optional hook: a teacher with nothing to release keeps it
        """Release what the teacher holds (a model, a connection pool)."""
