"""NeMo-RL's 2026 `RolloutManager` keyword arguments (`timeouts`, `retry_policy`, `mask_env_flagged_samples`),
read into our fault policy and Gym settings where we have the feature, refused by name where we do not.

NeMo-RL's meanings (its `nemo_rl/experience/rollout_manager.py`): `RolloutTimeouts` holds deadlines in seconds,
None for none: `rollout_s` for a NeMo Gym prompt's whole group of rows, `generation_s` per generation turn,
`env_s` per environment step. `RolloutRetryPolicy` holds attempt budgets (1: no retry): `max_infra_attempts`
and `max_data_attempts` for a prompt whose rollout failed for infrastructure or deterministic reasons,
`max_gym_row_attempts` for a Gym row that never arrived, exponential backoff from `backoff_base_s` capped at
`max_backoff_s`, and how many prompts may be dropped (`max_skipped_prompts`, `max_consecutive_dropped_prompts`).
`mask_env_flagged_samples` (Gym): a result whose `instance_config.mask_sample` is true leaves the loss.
NeMo-RL's own instances, ours, or dicts with these keys are accepted alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.gym.config import GymConfig


@dataclass(frozen=True)
class RolloutTimeouts:
    """NeMo-RL's deadlines inside one rollout, in seconds; None keeps ours (our fault policy's)."""

    rollout_s: float | None = None
    """NeMo Gym: one deadline for a prompt's whole group of rows (not implemented: NotImplementedError)."""
    generation_s: float | None = None
    """Native: the deadline of one generation call (`FaultPolicy.generation_timeout_s`)."""
    env_s: float | None = None
    """Native: the deadline of one environment step (`FaultPolicy.env_step_timeout_s`)."""


@dataclass(frozen=True)
class RolloutRetryPolicy:
    """NeMo-RL's retry budgets (attempts; 1: no retry); see `apply_nemo_rl_options` for what each becomes."""

    max_infra_attempts: int
    """Attempts of a generation that failed for a reason other than bad input (`FaultPolicy.generation_retries` + 1)."""
    max_data_attempts: int
    """Attempts of a prompt that failed deterministically; only 1 is implemented (bad input is never retried)."""
    max_gym_row_attempts: int
    """Attempts of one NeMo Gym row (`GymConfig.max_attempts`)."""
    backoff_base_s: float = 1.0
    """First retry delay of a generation, doubling each retry (`FaultPolicy.retry_backoff_s`)."""
    max_backoff_s: float = 30.0
    """Cap on a retry delay; ours has none, so only a cap the delays never reach is accepted."""
    max_skipped_prompts: int = 0
    """Prompts that may be dropped after their data budget; only 0 (ours records or raises, never drops)."""
    max_consecutive_dropped_prompts: int = 0
    """Consecutive prompts that may be dropped after their infra budget; only 0, as above."""

    @classmethod
    def single_attempt(cls, **overrides: Any) -> RolloutRetryPolicy:
        """No retries at all (NeMo-RL's policy when a `RolloutManager` is given none), with `overrides`."""
        return cls(**{"max_infra_attempts": 1, "max_data_attempts": 1, "max_gym_row_attempts": 1, **overrides})

    def __post_init__(self) -> None:
        budgets = {k: getattr(self, k) for k in ("max_infra_attempts", "max_data_attempts", "max_gym_row_attempts")}
        bad = [f"{k} must be an int >= 1, got {v!r}" for k, v in budgets.items()
               if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        for k in ("backoff_base_s", "max_backoff_s", "max_skipped_prompts", "max_consecutive_dropped_prompts"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                bad.append(f"{k} must be a number >= 0, got {v!r}")
        if bad:
            raise ValueError("RolloutRetryPolicy: " + "; ".join(bad))


_TIMEOUT_FIELDS = {"generation_s": "generation_timeout_s", "env_s": "env_step_timeout_s"}
"""`RolloutTimeouts` field -> the `FaultPolicy` field it sets."""
_RETRY_DEFAULTS = {"backoff_base_s": 1.0, "max_backoff_s": 30.0, "max_skipped_prompts": 0,
                   "max_consecutive_dropped_prompts": 0}
"""The `RolloutRetryPolicy` fields with defaults (NeMo-RL's)."""


def apply_nemo_rl_options(
    *,
    use_nemo_gym: bool,
    fault_policy: FaultPolicy | None,
    gym_config: Any,
    timeouts: Any = None,
    retry_policy: Any = None,
    mask_env_flagged_samples: bool | None = None,
) -> tuple[FaultPolicy | None, Any]:
    """The fault policy and Gym settings with NeMo-RL's options applied (None options change nothing).

    NotImplementedError names every option value we have no feature for (as NeMo-RL's impls do, native
    rollouts ignore the Gym-only ones). A value that contradicts one set explicitly in `fault_policy` or
    `gym_config` is a ValueError naming both.
    """
    unsupported: list[str] = []
    policy: dict[str, Any] = {}  # FaultPolicy field -> (value, the option that set it)
    gym: dict[str, Any] = {}
    if timeouts is not None:
        t = _read(timeouts, "timeouts", {"rollout_s": None, "generation_s": None, "env_s": None})
        if t["rollout_s"] is not None and use_nemo_gym:
            unsupported.append("timeouts.rollout_s (one deadline for a Gym prompt's whole group): ours bounds each "
                               "row's /run request instead (gym_config.row_timeout_s)")
        for name, ours in _TIMEOUT_FIELDS.items():
            if t[name] is not None:
                policy[ours] = (t[name], f"timeouts.{name}")
    if retry_policy is not None:
        fields = {"max_infra_attempts": ..., "max_data_attempts": ..., "max_gym_row_attempts": ..., **_RETRY_DEFAULTS}
        r = _read(retry_policy, "retry_policy", fields)
        RolloutRetryPolicy(**r)  # its checks: budgets >= 1, delays and drop counts >= 0
        unsupported += _unsupported_retries(r)
        policy["generation_retries"] = (r["max_infra_attempts"] - 1, "retry_policy.max_infra_attempts - 1")
        policy["retry_backoff_s"] = (r["backoff_base_s"], "retry_policy.backoff_base_s")
        if use_nemo_gym:
            gym["max_attempts"] = (r["max_gym_row_attempts"], "retry_policy.max_gym_row_attempts")
    if mask_env_flagged_samples and use_nemo_gym:
        unsupported.append("mask_env_flagged_samples=True (Gym results flagged instance_config.mask_sample leave "
                           "the loss): ours never reads the flag; pass False for that")
    if unsupported:
        raise NotImplementedError("RolloutManager: not implemented here: " + "; ".join(unsupported))
    return _with(fault_policy, policy, "fault_policy"), _gym_with(gym_config, gym)


def _read(options: Any, name: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `options` (an object with these attributes, or a mapping); `...` marks a required one."""
    get = options.get if isinstance(options, Mapping) else lambda k, d: getattr(options, k, d)
    values = {k: get(k, default) for k, default in fields.items()}
    missing = [k for k, v in values.items() if v is ...]
    problems = [f"missing {', '.join(missing)}"] if missing else []
    unknown = sorted(set(options) - set(fields)) if isinstance(options, Mapping) else []
    if unknown:
        problems.append(f"unknown key(s) {', '.join(map(str, unknown))} (known: {', '.join(fields)})")
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems) + f" (got {options!r})")
    return values


def _unsupported_retries(r: Mapping[str, Any]) -> list[str]:
    problems = []
    if r["max_data_attempts"] != 1:
        problems.append(f"retry_policy.max_data_attempts={r['max_data_attempts']} (retrying deterministic failures): "
                        "ours never retries bad input (ValueError); only 1 is accepted")
    for key in ("max_skipped_prompts", "max_consecutive_dropped_prompts"):
        if r[key] != 0:
            problems.append(f"retry_policy.{key}={r[key]} (dropping prompts): ours records a failed rollout as an "
                            "error completion or raises (fault_policy.on_error), never drops it; only 0 is accepted")
    retries = r["max_infra_attempts"] - 1
    longest = r["backoff_base_s"] * 2 ** (retries - 1) if retries > 0 else 0.0
    if longest > r["max_backoff_s"]:
        problems.append(f"retry_policy.max_backoff_s={r['max_backoff_s']} (a cap on retry delays): ours doubles "
                        f"without a cap, and its longest delay here would be {longest:g}s")
    return problems


def _with(base: FaultPolicy | None, updates: Mapping[str, tuple[Any, str]], name: str) -> FaultPolicy | None:
    """`base` (or the default policy) with `updates`, validated; None when there is nothing to change."""
    if not updates:
        return base
    given = base.model_dump(exclude_unset=True) if base is not None else {}
    _check_conflicts(given, updates, name)
    try:
        return FaultPolicy.model_validate({**given, **{k: v for k, (v, _) in updates.items()}})
    except ValidationError as err:
        raise ValueError(_named(err, updates)) from None


def _gym_with(gym_config: Any, updates: Mapping[str, tuple[Any, str]]) -> Any:
    """`gym_config` (a GymConfig or its dict; None stays None for the implementation to report) with `updates`."""
    if not updates or gym_config is None:
        return gym_config
    if isinstance(gym_config, GymConfig):
        given = gym_config.model_dump(exclude_unset=True)
    elif isinstance(gym_config, Mapping):
        given = dict(gym_config)
    else:
        return gym_config  # the implementation reports what it is
    _check_conflicts(given, updates, "gym_config")
    merged = {**given, **{k: v for k, (v, _) in updates.items()}}
    if isinstance(gym_config, GymConfig):
        try:
            return GymConfig.model_validate(merged)
        except ValidationError as err:
            raise ValueError(_named(err, updates)) from None
    return merged


def _check_conflicts(given: Mapping[str, Any], updates: Mapping[str, tuple[Any, str]], name: str) -> None:
    clashes = [f"{option}={value!r} contradicts {name}.{key}={given[key]!r}"
               for key, (value, option) in updates.items() if key in given and given[key] != value]
    if clashes:
        raise ValueError("RolloutManager: " + "; ".join(clashes))


def _named(err: ValidationError, updates: Mapping[str, tuple[Any, str]]) -> str:
    """A validation error of our settings, named by the NeMo-RL option that set each bad field."""
    parts = []
    for e in err.errors():
        key = str(e["loc"][0]) if e["loc"] else ""
        where = updates[key][1] if key in updates else key
        parts.append(f"{where}: {e['msg']} (got {e['input']!r})")
    return "RolloutManager: " + "; ".join(parts)
