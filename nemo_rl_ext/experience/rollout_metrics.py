"""Rollout metrics: pure functions from completions to a flat, slash-namespaced dict.

Plain Python, not numpy: groups are small (N completions of one prompt) and this runs once per group,
where numpy's per-call overhead cost more than the arithmetic (bench/overhead.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from nemo_rl_ext.data.records import Completion, PromptGroupRecord, StopReason
from nemo_rl_ext.distillation.scoring import reverse_kl_terms


def token_counts(completion: Completion, prompt_len: int) -> tuple[int, int, int]:
    """(generated, environment, total) token counts of one completion.

    Generated tokens are the assistant messages' after the prompt; environment tokens are every other
    message after the prompt; total counts the prompt too.
    """
    log = completion.message_log
    generated = environment = 0
    for m in log[prompt_len:]:
        if m.role == "assistant":
            generated += len(m.token_ids)
        else:
            environment += len(m.token_ids)
    prompt = sum(len(m.token_ids) for m in log[:prompt_len])
    return generated, environment, prompt + generated + environment


def _mean(values: Sequence[float]) -> float:
    return float(sum(values)) / len(values)


def _std(values: Sequence[float]) -> float:
    """Population standard deviation (numpy's default, ddof=0)."""
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    values = [float(v) for v in values]
    return {
        f"{prefix}/mean": _mean(values),
        f"{prefix}/std": _std(values),
        f"{prefix}/min": min(values),
        f"{prefix}/max": max(values),
    }


def rollout_metrics(
    completions: Sequence[Completion], prompt_lens: Sequence[int], wall_time_s: float | None = None
) -> dict[str, float]:
    """Metrics over completions (of one group or many); `prompt_lens[i]` = prompt messages of completion i.

    `rollout/wall_time_s` is there when `wall_time_s` is given (the caller that owns the clock adds it otherwise).
    """
    wall = {} if wall_time_s is None else {"rollout/wall_time_s": float(wall_time_s)}
    if not completions:
        return {"rollout/num_samples": 0.0, **wall}
    counts = [token_counts(c, n) for c, n in zip(completions, prompt_lens, strict=True)]
    reasons = [c.stop_reason for c in completions]
    metrics = {
        "rollout/num_samples": float(len(completions)),
        **_stats("rollout/reward", [c.reward for c in completions]),
        **_stats("rollout/turns", [c.num_turns for c in completions]),
        "rollout/tokens/generated/mean": _mean([g for g, _, _ in counts]),
        "rollout/tokens/environment/mean": _mean([e for _, e, _ in counts]),
        "rollout/tokens/total/mean": _mean([t for _, _, t in counts]),
        "rollout/tokens/total/max": float(max(t for _, _, t in counts)),
        "rollout/truncation_rate": _mean([c.truncated for c in completions]),
        "rollout/natural_termination_rate": _mean([r is StopReason.NATURAL for r in reasons]),
        "rollout/max_turns_rate": _mean([r is StopReason.MAX_TURNS for r in reasons]),
        "rollout/errors": float(sum(r is StopReason.ERROR for r in reasons)),
        "rollout/grading_timeouts": float(sum(c.env_extras.get("grading") == "timeout" for c in completions)),
        **wall,
    }
    by_agent: dict[str, list[Completion]] = {}
    for c in completions:
        by_agent.setdefault(c.agent_name, []).append(c)
    for agent in sorted(by_agent):
        mine = by_agent[agent]
        rewards = [float(c.reward) for c in mine]
        metrics[f"agent/{agent}/num_samples"] = float(len(mine))
        metrics[f"agent/{agent}/reward/mean"] = _mean(rewards)
        metrics[f"agent/{agent}/reward/std"] = _std(rewards)
        metrics[f"agent/{agent}/turns/mean"] = _mean([c.num_turns for c in mine])
        metrics[f"agent/{agent}/errors"] = float(sum(c.stop_reason is StopReason.ERROR for c in mine))
    return metrics


def teacher_metrics(records: Sequence[PromptGroupRecord]) -> dict[str, float]:
    """On-policy distillation's metrics over several records (none when no token was scored): the reverse KL
    (mean per scored token of generation - teacher logprob) overall and per agent, the teacher's seconds
    (summed over groups) and tokens per second."""
    by_agent: dict[str, list[float]] = {}
    for r in records:
        for c in r.completions:
            by_agent.setdefault(c.agent_name, []).extend(reverse_kl_terms([c]))
    terms = [t for agent in by_agent.values() for t in agent]
    if not terms:
        return {}
    seconds = sum(r.rollout_metrics.get("distill/teacher_time_s", 0.0) for r in records)
    tokens = sum(r.rollout_metrics.get("distill/teacher_tokens", 0.0) for r in records)
    metrics = {"distill/reverse_kl": _mean(terms), "distill/scored_tokens": float(len(terms)),
               "distill/teacher_time_s": seconds, "distill/teacher_tokens_per_s": tokens / seconds if seconds else 0.0}
    for agent in sorted(by_agent):
        if by_agent[agent]:
            metrics[f"agent/{agent}/distill/reverse_kl"] = _mean(by_agent[agent])
    return metrics
