"""The single-step `math` environment: grades the last assistant message with math-verify, time-bounded.

Grading (`math_grading.py`) runs in worker processes with a hard per-answer deadline (`grading_pool.py`):
an answer whose grading overruns `grading_timeout_s` scores 0 and its completion's `env_extras["grading"]`
is "timeout" (counted in `rollout/grading_timeouts`). The workers start when the environment is built (a
clear `GradingUnavailableError` there when they cannot, before any rollout runs); a grade that fails for a
reason that is not the answer's (a worker killed or out of memory, a broken pool) raises
`GradingUnavailableError` from `step`, so the rollout becomes an error completion, retried on resume.

maj@k vote keys are computed here, at grading time, in the same worker call and under the same deadline:
each graded rollout's `EnvironmentReturn.extras` carries `vote_key` (`math_vote_key`: spellings that
math-verify parses to the same value share a key; a correct answer gets its ground truth's key) and
`grading` (ok | timeout). The rollout loop copies them into the completion's `env_extras`, the eval
writes them to completions.jsonl, and maj@k (`evals/metrics.py`) votes on `vote_key`, so a resumed eval
reads the same keys from the file without grading again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments.grading_pool import (
    DEFAULT_GRADING_TIMEOUT_S,
    DEFAULT_GRADING_WORKERS,
    GradingUnavailableError,
    shared_grading_pool,
)
from nemo_rl_ext.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Observation
from nemo_rl_ext.environments.math_grading import (
    Grade,
    extract_answer,
    grade_answer,
    grade_answers,
    math_vote_key,
)
from nemo_rl_ext.environments.registry import register_environment

__all__ = [
    "Grade",
    "GradingUnavailableError",
    "MathEnvironment",
    "MathGrader",
    "extract_answer",
    "grade_answer",
    "grade_answers",
    "grade_extras",
    "ground_truth_of",
    "last_assistant_content",
    "math_vote_key",
]


def last_assistant_content(message_log: Sequence[Message]) -> str | None:
    """The content of the last assistant message of a rollout, or None when it has none."""
    for message in reversed(message_log):
        if message.role == "assistant":
            return message.content
    return None


def ground_truth_of(metadata: Mapping[str, Any] | None, index: int) -> Any:
    """`metadata["ground_truth"]`, or a ValueError naming the rollout (a dataset/config mistake)."""
    if not metadata or metadata.get("ground_truth") is None:
        raise ValueError(f"rollout {index}: metadata has no 'ground_truth' (keys: {sorted(metadata or {})})")
    return metadata["ground_truth"]


def grade_extras(grade: Grade) -> dict[str, Any]:
    """What a grade adds to its completion's `env_extras`: the vote key and the grading status."""
    return {"vote_key": grade.vote_key, "grading": grade.status}


class MathGrader:
    """Grades math answers in the shared worker pool, each answer within `timeout_s`.

    Its workers start here (GradingUnavailableError, saying what to do, when they cannot), so that a grader
    that cannot grade fails before any rollout is generated.
    """

    def __init__(self, timeout_s: float = DEFAULT_GRADING_TIMEOUT_S, workers: int = DEFAULT_GRADING_WORKERS) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise ValueError(f"grading_timeout_s must be a number > 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.grade_function: Callable[[str, Any], Grade] = grade_answer
        """What a worker runs per answer: a picklable function of (response, ground truth); doubles swap it."""
        self.pool = shared_grading_pool(workers)
        self.pool.start()

    async def grade(self, responses: Sequence[str], ground_truths: Sequence[Any]) -> list[Grade]:
        """One `Grade` per response (a timed-out one: reward 0, status "timeout"); GradingUnavailableError when
        an answer could not be graded for a reason that is not the answer's."""
        return await self.pool.grade(responses, ground_truths, self.timeout_s, self.grade_function)

    async def vote_keys(self, answers: Sequence[str | None]) -> list[str | None]:
        """`math_vote_key` of each answer under the grading deadline (None when it times out)."""
        return await self.pool.vote_keys(answers, self.timeout_s)


@register_environment("math")
class MathEnvironment(EnvironmentInterface):
    """Single-step math: grades the last assistant message against `metadata[i]["ground_truth"]`.

    `grading_timeout_s` bounds each answer's grading (the worker is killed past it; the answer scores 0);
    `grading_workers` is the number of grading processes (shared with other environments that ask for it).
    """

    def __init__(
        self, grading_timeout_s: float = DEFAULT_GRADING_TIMEOUT_S, grading_workers: int = DEFAULT_GRADING_WORKERS
    ) -> None:
        self.grader = MathGrader(grading_timeout_s, grading_workers)

    async def step(
        self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"{len(message_logs)} message logs but {len(metadata)} metadata entries")
        truths = [ground_truth_of(m, i) for i, m in enumerate(metadata)]
        responses = [last_assistant_content(log) or "" for log in message_logs]
        grades = await self.grader.grade(responses, truths)
        n = len(grades)
        return EnvironmentReturn(
            observations=[Observation(role="environment", content="")] * n,
            metadata=[dict(m or {}) for m in metadata],
            next_stop_strings=[None] * n,
            rewards=[g.reward for g in grades],
            terminateds=[True] * n,
            answers=[g.answer for g in grades],
            extras=[grade_extras(g) for g in grades],
        )

    async def vote_keys(self, answers: Sequence[str | None]) -> list[str | None]:
        """math-verify equivalence (`math_vote_key`), computed in the grading workers under the same deadline."""
        return await self.grader.vote_keys(answers)
