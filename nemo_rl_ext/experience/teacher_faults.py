"""A record scored by its teacher, or, when the teacher fails (after its own retries), what the fault policy
says: every completion it was to score becomes an error completion (infrastructure: never scored as data,
retried on resume), or the rollout raises (`on_error: raise`)."""

from __future__ import annotations

import dataclasses
import logging

from nemo_rl_ext.data.records import PromptGroupRecord, StopReason
from nemo_rl_ext.distillation.scoring import TeacherScorer, reverse_kl_terms, scoreable
from nemo_rl_ext.experience.fault_policy import FaultPolicy, RolloutError, describe

logger = logging.getLogger(__name__)


async def scored_or_failed(scorer: TeacherScorer, record: PromptGroupRecord, policy: FaultPolicy) -> PromptGroupRecord:
    """`record` scored by `scorer` with its `distill/*` group metrics; on a teacher failure, the fault policy's
    answer (error completions, or `RolloutError`). A ValueError (scores that do not fit the ids: a bug or a
    teacher that answers another sequence) is raised as it is."""
    try:
        scored = await scorer.score_record(record)
    except ValueError:
        raise
    except Exception as exc:
        teacher = scorer.teacher_for(record.agent_name)
        what = f"teacher {teacher.name if teacher is not None else '?'}: {describe(exc)}"
        if policy.on_error == "raise":
            raise RolloutError(f"row {record.prompt_idx}: {what}") from exc
        logger.warning("row %s: %s; its completions are error completions", record.prompt_idx, what)
        return teacher_failed(record, what)
    terms = reverse_kl_terms(scored.completions)
    if not terms:
        return scored
    kl = sum(terms) / len(terms)
    metrics = {**scored.rollout_metrics, "distill/reverse_kl": kl, f"agent/{scored.agent_name}/distill/reverse_kl": kl,
               "distill/scored_tokens": float(len(terms))}
    return dataclasses.replace(scored, rollout_metrics=metrics)


def teacher_failed(record: PromptGroupRecord, error: str) -> PromptGroupRecord:
    """`record` with every completion the teacher was to score turned into an error completion (reward 0, no
    reward components, `error`), as a failed rollout is; `env_extras["teacher_error"]` marks why."""
    completions = tuple(
        dataclasses.replace(c, stop_reason=StopReason.ERROR, error=error[:500], reward=0.0, reward_components={},
                            env_extras={**c.env_extras, "teacher_error": True})
        if scoreable(c) else c
        for c in record.completions
    )
    errors = float(sum(c.stop_reason is StopReason.ERROR for c in completions))
    metrics = {**record.rollout_metrics, "rollout/errors": errors, "distill/teacher_failures": 1.0}
    return dataclasses.replace(record, completions=completions, rollout_metrics=metrics)
