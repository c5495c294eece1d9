"""The eval's summary (summary.json) as a typed record, and its computation from the completions on disk.

`EvalSummary.to_json()` gives exactly the keys, in exactly the order, that summary.json has always held, then
the reward profile (`profile`, see profile.py). The summary is a pure function of the file's lines, so a
resumed run reports what an uninterrupted one does, byte for byte, except the profile's `latency_s` entries:
they are measurements, read from timings.jsonl (timings.py).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from nemo_rl_ext.data.records import PROMPT_TOO_LONG, DatumSpec
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.lines import CompletionLine, JsonView
from nemo_rl_ext.evals.metrics import PromptSamples, aggregate_eval_metrics, vote_key
from nemo_rl_ext.evals.profile import RewardProfile, reward_profile
from nemo_rl_ext.evals.store import CompletionStore
from nemo_rl_ext.evals.timings import Timings, read_timings

MAX_LISTED_ERRORS = 50
"""Error samples listed by name in the summary (all of them are counted)."""

Status = Literal["ok", "errors_allowed", "errors_left"]
"""ok: no errors; errors_allowed: some, within `eval.max_error_rate`; errors_left: more (the run failed)."""


@dataclass(frozen=True, eq=False)
class ErrorSample(JsonView):
    """One (prompt, sample) pair whose latest line is an error, as the summary lists it."""

    prompt_idx: int
    """The dataset row."""
    sample_idx: int
    """The sample of that row."""
    agent: str
    """The row's agent (or task)."""
    error: str | None
    """The infrastructure failure, briefly."""

    def to_json(self) -> dict[str, Any]:
        """The object in summary.json's `error_samples`."""
        return {"prompt_idx": self.prompt_idx, "sample_idx": self.sample_idx, "agent": self.agent, "error": self.error}

    @classmethod
    def of_line(cls, line: CompletionLine) -> ErrorSample:
        """The entry for an error line."""
        return cls(line.prompt_idx, line.sample_idx, line.agent, line.error)


@dataclass(frozen=True, eq=False)
class GymAgentMetrics(JsonView):
    """One agent's entry in summary.json's `gym_metrics`: NeMo Gym's own `/aggregate_metrics` answer for the
    agent's results, or the error that kept Gym from answering."""

    agent_metrics: Mapping[str, Any] | None = None
    """Gym's `agent_metrics` (None: not answered)."""
    key_metrics: Mapping[str, Any] | None = None
    """Gym's `key_metrics`, the headline numbers the report shows (None: not answered)."""
    error: str | None = None
    """Why Gym did not answer (None: it did)."""

    def to_json(self) -> dict[str, Any]:
        """`{"agent_metrics": ..., "key_metrics": ...}`, or `{"error": ...}`."""
        if self.error is not None:
            return {"error": self.error}
        return {"agent_metrics": self.agent_metrics, "key_metrics": self.key_metrics}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> GymAgentMetrics:
        """The entry of a parsed summary.json, or of gym_aggregate_metrics.json (its `group_level_metrics` are
        left out)."""
        return cls(obj.get("agent_metrics"), obj.get("key_metrics"), obj.get("error"))


@dataclass(frozen=True, eq=False)
class EvalSummary(JsonView):
    """What an eval found (summary.json); also readable by its JSON keys (`summary["metrics"]`)."""

    rollout_mode: str
    """single_turn, multi_turn or nemo_gym (`rollouts.mode_name`: NeMo-RL's `eval.rollout_mode`), or a plugin's mode."""
    model: str
    """`policy.model_name`."""
    dataset_path: str
    """`eval.dataset_path`."""
    num_prompts: int
    """Prompts evaluated."""
    num_completions: int
    """(prompt, sample) pairs, errors included."""
    ks: tuple[int, ...]
    """The ks of the @k metrics, ascending."""
    reward_threshold: float
    """A sample is correct when its reward is >= this."""
    agents: tuple[str, ...]
    """The agents (or tasks) of the prompts, sorted."""
    stop_reasons: Mapping[str, int]
    """How many pairs ended for each stop reason, by name (sorted)."""
    status: Status
    """ok, errors_allowed or errors_left (judged against `max_error_rate`)."""
    num_errors: int
    """Pairs whose latest line is an error (not scored)."""
    error_rate: float
    """num_errors / num_completions."""
    max_error_rate: float
    """`eval.max_error_rate`."""
    error_samples: tuple[ErrorSample, ...]
    """The first MAX_LISTED_ERRORS error pairs, in prompt order."""
    truncation_rate: float | None
    """Fraction of the non-error samples that hit the length limit (None: no such samples)."""
    mean_turns: float | None
    """Mean assistant turns of the non-error samples (None: no such samples)."""
    metrics: Mapping[str, float]
    """`aggregate_eval_metrics` over the prompts: flat, slash-namespaced keys."""
    gym_metrics: Mapping[str, GymAgentMetrics] | None = None
    """nemo_gym mode: agent -> Gym's own `/aggregate_metrics` answer (or its error); None otherwise."""
    profile: RewardProfile | None = None
    """The per-task reward profile (profile.py); None for a summary written before it existed."""
    report_metrics: tuple[str, ...] | None = None
    """The metrics the table shows, in order (`eval.metrics`); None: the default (every metric with `in_report`).
    `metrics` has every metric either way."""
    num_data_errors: int = 0
    """Of `num_errors`, the pairs whose row was refused as malformed (Gym's HTTP 4xx): not infrastructure,
    not retried by a resume, and not judged against `max_error_rate` (the CLI exits 2 naming the rows)."""
    data_error_rows: tuple[int, ...] = ()
    """The prompts (dataset rows) with a data error, the first MAX_LISTED_ERRORS, ascending."""
    num_prompts_too_long: int = 0
    """Prompts with a sample whose prompt alone left no room to generate (`policy.max_model_len`,
    `rollouts.max_seq_len`): it ended truncated at 0 turns."""
    longest_prompt_too_long: int | None = None
    """The longest of those prompts, in tokens (None: none, or lengths unknown)."""
    gym_logs: str | None = None
    """nemo_gym mode with `rollouts.gym.launch`: the folder of the Gym servers' logs (relative to the eval
    folder when inside it); None otherwise."""
    reward_components: Mapping[str, Mapping[str, float]] | None = None
    """Named reward components (multi-reward environments): name -> {"mean", "min", "max", "num_samples"} over
    the non-error samples that report it, names sorted; None where no sample reports any."""

    def to_json(self) -> dict[str, Any]:
        """The summary.json object (the older keys in their order, then the data-error and prompt-length counts;
        `gym_metrics`, `profile`, `report_metrics`, `gym_logs`, when set)."""
        out: dict[str, Any] = {
            "rollout_mode": self.rollout_mode,
            "model": self.model,
            "dataset_path": self.dataset_path,
            "num_prompts": self.num_prompts,
            "num_completions": self.num_completions,
            "ks": list(self.ks),
            "reward_threshold": self.reward_threshold,
            "agents": list(self.agents),
            "stop_reasons": dict(self.stop_reasons),
            "status": self.status,
            "num_errors": self.num_errors,
            "error_rate": self.error_rate,
            "max_error_rate": self.max_error_rate,
            "error_samples": [e.to_json() for e in self.error_samples],
            "truncation_rate": self.truncation_rate,
            "mean_turns": self.mean_turns,
            "metrics": dict(self.metrics),
            "num_data_errors": self.num_data_errors,
            "data_error_rows": list(self.data_error_rows),
            "num_prompts_too_long": self.num_prompts_too_long,
            "longest_prompt_too_long": self.longest_prompt_too_long,
        }
        if self.gym_metrics is not None:
            out["gym_metrics"] = {agent: m.to_json() for agent, m in self.gym_metrics.items()}
        if self.profile is not None:
            out["profile"] = self.profile.to_json()
        if self.report_metrics is not None:
            out["report_metrics"] = list(self.report_metrics)
        if self.gym_logs is not None:
            out["gym_logs"] = self.gym_logs
        if self.reward_components is not None:
            out["reward_components"] = {name: dict(stats) for name, stats in self.reward_components.items()}
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> EvalSummary:
        """The summary of a parsed summary.json."""
        fields = {k: v for k, v in obj.items() if k in cls.__dataclass_fields__}
        return cls(
            **{
                **fields,
                "ks": tuple(obj["ks"]),
                "agents": tuple(obj["agents"]),
                "error_samples": tuple(ErrorSample(**e) for e in obj["error_samples"]),
                "data_error_rows": tuple(obj.get("data_error_rows", ())),
                "profile": None if obj.get("profile") is None else RewardProfile.from_json(obj["profile"]),
                "report_metrics": None if obj.get("report_metrics") is None else tuple(obj["report_metrics"]),
                "gym_metrics": None if obj.get("gym_metrics") is None else {
                    agent: GymAgentMetrics.from_json(entry) for agent, entry in obj["gym_metrics"].items()
                },
            }
        )


def summarize(
    cfg: EvalConfig,
    datums: Sequence[DatumSpec],
    expected: Mapping[int, int],
    store: CompletionStore,
    timings: Timings | None = None,
) -> EvalSummary:
    """The summary of the lines on disk for `datums` (a pure function of the file's lines).

    Each (prompt, sample) counts once, as its result or, when it has none, as its latest error. Metrics,
    truncation rate and mean turns are over the non-error samples; the errors are counted (`num_errors`,
    per agent in `metrics`), listed (`error_samples`, the first MAX_LISTED_ERRORS) and, but for data errors
    (malformed rows: `num_data_errors`, `data_error_rows`), judged against `eval.max_error_rate` (`status`).
    Prompts whose prompt alone left no room to generate are counted (`num_prompts_too_long`). The reward
    profile (`profile`) is computed from the same lines, its latencies from `timings` (None: `read_timings`
    of the store's folder).
    """
    groups = _groups(datums, expected, store)
    prompts = [_prompt_samples(group) for group in groups]
    lines = [x for group in groups for x in group]
    ks = cfg.ks
    scored = [x for x in lines if not x.is_error]
    metrics = {**aggregate_eval_metrics(prompts, ks, cfg.eval.reward_threshold), **distill_metrics(scored)}
    return EvalSummary(
        rollout_mode=cfg.rollouts.mode_name,
        model=cfg.policy.model_name,
        dataset_path=cfg.eval.dataset_path,
        num_prompts=len(prompts),
        num_completions=len(lines),
        ks=tuple(ks),
        reward_threshold=cfg.eval.reward_threshold,
        agents=tuple(sorted({p.agent_name for p in prompts})),
        stop_reasons=dict(sorted(Counter(x.stop_reason for x in lines).items())),
        **_error_fields(lines, cfg.eval.max_error_rate),
        **_too_long_fields(lines),
        truncation_rate=sum(x.truncated for x in scored) / len(scored) if scored else None,
        mean_turns=sum(x.num_turns for x in scored) / len(scored) if scored else None,
        metrics=metrics,
        profile=reward_profile(
            groups, ks, cfg.eval.reward_threshold, metrics,
            read_timings(store.path.parent) if timings is None else timings,
        ),
        report_metrics=cfg.eval.metrics,
        reward_components=component_stats(scored),
    )


def distill_metrics(scored: Sequence[CompletionLine]) -> dict[str, float]:
    """`distill/reverse_kl` (overall and `/<agent>`): the summed KL terms over the summed scored tokens of the
    lines a teacher scored (a mean per token, exact across shards and resumes), and `distill/scored_tokens`;
    empty when no line was scored."""
    sums: dict[str, list[float]] = {}
    for line in scored:
        if line.distill.get("scored_tokens"):
            for key in ("", f"/{line.agent}"):
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += line.distill["reverse_kl_sum"]
                acc[1] += line.distill["scored_tokens"]
    if not sums:
        return {}
    out = {f"distill/reverse_kl{key}": kl / n for key, (kl, n) in sorted(sums.items())}
    return out | {"distill/scored_tokens": sums[""][1]}


def component_stats(scored: Sequence[CompletionLine]) -> dict[str, dict[str, float]] | None:
    """Mean, min, max and count of each named reward component over `scored` (None: no line has any)."""
    values: dict[str, list[float]] = {}
    for line in scored:
        for name, value in line.reward_components.items():
            values.setdefault(name, []).append(float(value))
    if not values:
        return None
    return {
        name: {"mean": math.fsum(v) / len(v), "min": min(v), "max": max(v), "num_samples": len(v)}
        for name, v in sorted(values.items())
    }


def _groups(
    datums: Sequence[DatumSpec], expected: Mapping[int, int], store: CompletionStore
) -> list[list[CompletionLine]]:
    """Each datum's lines, one per sample (its result, or its latest error); every sample must have one."""
    groups = []
    for d in datums:
        group = [store.line(d.idx, s) for s in range(expected[d.idx])]
        missing = [s for s, x in enumerate(group) if x is None]
        assert not missing, f"prompt {d.idx} has samples without a line: {missing}"
        groups.append([x for x in group if x is not None])
    return groups


def _prompt_samples(group: Sequence[CompletionLine]) -> PromptSamples:
    """What the metrics see of a prompt's lines: the rewards and vote keys of its results, its error count."""
    scored = [x for x in group if not x.is_error]
    return PromptSamples(
        agent_name=group[0].agent,
        rewards=tuple(x.reward for x in scored),
        answers=tuple(None if x.answer is None else vote_key(x.answer, x.env_extras) for x in scored),
        num_errors=len(group) - len(scored),
    )


def _error_fields(lines: Sequence[CompletionLine], max_error_rate: float) -> dict[str, Any]:
    """The summary's error counts, listed errors and `status` (data errors are judged by the CLI, not here)."""
    n = len(lines)
    errors = [x for x in lines if x.is_error]
    data_errors = [x for x in errors if x.is_data_error]
    status: Status
    if not errors:
        status = "ok"
    elif (len(errors) - len(data_errors)) / n <= max_error_rate:
        status = "errors_allowed"
    else:
        status = "errors_left"
    return {
        "status": status,
        "num_errors": len(errors),
        "error_rate": len(errors) / n,
        "max_error_rate": max_error_rate,
        "error_samples": tuple(ErrorSample.of_line(x) for x in errors[:MAX_LISTED_ERRORS]),
        "num_data_errors": len(data_errors),
        "data_error_rows": tuple(sorted({x.prompt_idx for x in data_errors}))[:MAX_LISTED_ERRORS],
    }


def _too_long_fields(lines: Sequence[CompletionLine]) -> dict[str, Any]:
    """The summary's count of prompts too long to generate from, and the longest of them in tokens."""
    too_long = [x for x in lines if x.prompt_too_long]
    lengths = [t for x in too_long if isinstance(t := x.env_extras[PROMPT_TOO_LONG].get("prompt_tokens"), int)]
    return {
        "num_prompts_too_long": len({x.prompt_idx for x in too_long}),
        "longest_prompt_too_long": max(lengths) if lengths else None,
    }
