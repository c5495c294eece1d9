"""Attaching a teacher's scores to a record: one forward over each completion's whole token sequence (every
message's exact ids, concatenated), the logprob (and top-k) at each assistant token kept on its message."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nemo_rl_ext.data.records import Completion, Message, PromptGroupRecord, StopReason
from nemo_rl_ext.distillation.teacher import Teacher, TeacherScores


def attach_scores(completion: Completion, scores: TeacherScores) -> Completion:
    """`completion` with each assistant message's `teacher_logprobs` (and top-k) read off `scores`, the scores of
    `completion.token_ids` (entry i scores id i + 1)."""
    expected = len(completion.token_ids) - 1
    if len(scores.logprobs) != expected:
        raise ValueError(f"teacher returned {len(scores.logprobs)} scores for {expected + 1} ids")
    messages: list[Message] = []
    offset = 0
    for m in completion.message_log:
        n = len(m.token_ids)
        if m.role == "assistant" and n:
            if offset == 0:
                raise ValueError("an assistant message opens the sequence: its first id has no context to score")
            span = slice(offset - 1, offset - 1 + n)
            m = dataclasses.replace(
                m, teacher_logprobs=tuple(scores.logprobs[span]),
                teacher_topk_ids=None if scores.topk_ids is None else tuple(scores.topk_ids[span]),
                teacher_topk_logprobs=None if scores.topk_logprobs is None else tuple(scores.topk_logprobs[span]),
            )
        messages.append(m)
        offset += n
    return dataclasses.replace(completion, message_log=tuple(messages))


def scoreable(completion: Completion) -> bool:
    """True for a completion the teacher scores: not an error, and with at least one generated token."""
    return completion.stop_reason is not StopReason.ERROR and any(
        m.role == "assistant" and m.token_ids for m in completion.message_log
    )


@dataclass(frozen=True)
class TeacherScorer:
    """The teachers of a run by agent, and the top-k they keep: scores the completions of a record."""

    teachers: Mapping[str, Teacher]
    """Agent -> its teacher (agents that share a checkpoint share one object, when deduplicated)."""
    default: Teacher | None = None
    """The teacher of agents not in `teachers`; None: such agents are not distilled."""
    top_k: int = 0
    """Teacher top-k logprobs kept per token (0: none)."""

    def teacher_for(self, agent: str) -> Teacher | None:
        """The teacher of `agent`, or None (not distilled)."""
        return self.teachers.get(agent, self.default)

    async def score_record(self, record: PromptGroupRecord) -> PromptGroupRecord:
        """`record` with its scoreable completions scored by its agent's teacher in one batched call, and the
        scoring's seconds and tokens in its rollout metrics; `TeacherError` (or the teacher's own exception)
        when the teacher fails: the caller's fault policy decides what that does."""
        picked = [i for i, c in enumerate(record.completions) if scoreable(c)]
        teacher = self.teacher_for(record.agent_name)
        if teacher is None or not picked:
            return record
        sequences = [record.completions[i].token_ids for i in picked]
        start = time.perf_counter()
        scores = await teacher.score(sequences, self.top_k)
        seconds = time.perf_counter() - start
        completions = list(record.completions)
        for i, s in zip(picked, scores, strict=True):
            completions[i] = attach_scores(completions[i], s)
        tokens = float(sum(len(s) for s in sequences))
        metrics = {**record.rollout_metrics, "distill/teacher_time_s": seconds, "distill/teacher_tokens": tokens}
        return dataclasses.replace(record, completions=tuple(completions), rollout_metrics=metrics)

    def close(self) -> None:
        """Close every teacher once."""
        for teacher in {id(t): t for t in (*self.teachers.values(), self.default) if t is not None}.values():
            teacher.close()


def reverse_kl_terms(completions: Sequence[Completion]) -> list[float]:
    """generation logprob - teacher logprob of every scored assistant token (its mean estimates the reverse KL
    KL(student || teacher) over the sampled tokens)."""
    terms: list[float] = []
    for c in completions:
        for m in c.message_log:
            if m.teacher_logprobs is not None and m.generation_logprobs is not None:
                terms += [g - t for g, t in zip(m.generation_logprobs, m.teacher_logprobs, strict=True)]
    return terms
