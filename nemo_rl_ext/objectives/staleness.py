"""The staleness rules of asynchronous GRPO, as pure functions: a group's version, admission, lag metrics.

Versions count policy updates: version v is the weights after v training steps (an asynchronous run refits
the engine after every step, so the version of the weights that step t trains is t - 1, and the engine's
`weight_version` plus a constant offset is the policy version). A trained group's lag is the version of
the weights that train on it minus the oldest version any of its tokens was generated under.

Admission is AReaL's rule (Fu et al., 2025, "AReaL", eq. for the staleness-aware controller): a group
started now, at version V, can be trained no later than at version V + max_lag; the steps that still train
at versions <= V + max_lag are `V + max_lag + 1 - steps_taken` (one step per version), and together they
take that many times `num_prompts_per_step` groups. A new group is started only while the groups in flight
plus those finished and waiting are fewer than that (plus `oversample`), and never when no such step is
left: a group that could only be trained more than `max_lag` versions behind is never started.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nemo_rl_ext.data.records import PromptGroupRecord


def token_versions(record: PromptGroupRecord) -> list[int]:
    """The engine weight version of every generated token of the group (empty when the records carry none,
    as NeMo Gym's do)."""
    return [
        v
        for completion in record.completions
        for message in completion.message_log
        if message.generation_weight_versions
        for v in message.generation_weight_versions
    ]


def group_version(record: PromptGroupRecord, *, offset: int, start_version: int) -> int:
    """The policy version of the group's oldest token: the minimum over its generated spans plus `offset`
    (engine -> policy versions), or `start_version` (the version when it started, which no token of it can
    be older than) when the record carries no versions."""
    versions = token_versions(record)
    return min(versions) + offset if versions else start_version


def open_steps(version: int, steps_taken: int, max_lag: int) -> int:
    """How many steps not yet taken still train at a version <= `version + max_lag`."""
    return version + max_lag + 1 - steps_taken


def admission_budget(version: int, steps_taken: int, *, max_lag: int, per_step: int, oversample: int) -> int:
    """Most groups that may be in flight or waiting now (see the module docstring); 0 when no open step."""
    steps = open_steps(version, steps_taken, max_lag)
    return steps * per_step + oversample if steps > 0 else 0


def lag_metrics(lags: Sequence[int], max_lag: int) -> dict[str, float]:
    """The histogram of the trained groups' lags: `async/lag/<k>` for every k in 0..max_lag (and any larger
    lag, which would be a bug), with `async/lag/max` and `async/lag/mean`."""
    counts = {k: 0 for k in range(max_lag + 1)}
    for lag in lags:
        counts[lag] = counts.get(lag, 0) + 1
    metrics = {f"async/lag/{k}": float(n) for k, n in sorted(counts.items())}
    metrics["async/lag/max"] = float(max(lags)) if lags else 0.0
    metrics["async/lag/mean"] = float(sum(lags) / len(lags)) if lags else 0.0
    return metrics


def lag_histogram(metrics: Iterable[dict[str, float]]) -> dict[int, int]:
    """The lag histogram summed over several steps' metrics (for reports)."""
    total: dict[int, int] = {}
    for m in metrics:
        for key, value in m.items():
            if key.startswith("async/lag/") and key.rsplit("/", 1)[1].isdigit():
                k = int(key.rsplit("/", 1)[1])
                total[k] = total.get(k, 0) + int(value)
    return dict(sorted(total.items()))
