"""The per-task reward profile of an eval and the per-prompt difficulty file, computed from the completion lines
(only the latencies come from timings.jsonl).

What is reproducible, and what is not:
- completions.jsonl is byte-reproducible: the same config and seeds give the same lines (sorted by prompt and
  sample) from one process, a resumed run or merged shards. It holds no wall-clock measurement.
- The rollout timings live next to it in timings.jsonl (timings.py): one entry per written completion.
- summary.json is a pure function of the completion lines, except `profile.overall.latency_s` and
  `profile.tasks.*.latency_s` (read from timings.jsonl): two runs with the same completions write summaries
  equal modulo `profile.*.latency_s`, byte for byte once `untimed_bytes` drops those (`without_timings`
  does the same to a parsed summary).

The profile (summary.json's `profile`): `overall` and `tasks` (one entry per agent, or task, sorted), each a
`TaskProfile`: prompts, samples, errors and error rate (errors are infrastructure failures, counted, never
scored); over the non-error samples: every metric of `metric_defs()` that is `in_profile` (the summary's
values: `mean_reward`, `pass_at_k` and `maj_at_k` built in, then each registered metric, `<name>_at_k` per k or
`<name>`), truncation rate, mean turns, generated tokens (the model's own tokens: the assistant messages' `num_tokens`)
and rollout latency (from timings.jsonl: the samples without an entry there, e.g. written before timings were
recorded, are left out, and `latency_s.num_samples` says how many had one); and the histogram of the prompts'
solved fractions.

The difficulty file (`difficulty.jsonl`, next to summary.json), for a curriculum or dynamic sampling to read:
one JSON object per prompt, in prompt order, with the keys

    prompt_idx       int         the dataset row (as in completions.jsonl)
    agent            str         the row's agent (or task)
    num_samples      int         its non-error samples
    num_solved       int         those with reward >= eval.reward_threshold (summary.json's reward_threshold)
    solved_fraction  float|null  num_solved / num_samples; null when every sample was an error
    num_errors       int         its error samples (not in num_samples)

e.g. `{"prompt_idx":3,"agent":"math","num_samples":4,"num_solved":1,"solved_fraction":0.25,"num_errors":0}`.
Prompts with solved_fraction 0 or 1 are the ones a group-relative advantage learns nothing from.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from nemo_rl_ext.evals.lines import CompletionLine, JsonView
from nemo_rl_ext.evals.metrics import metric_defs
from nemo_rl_ext.evals.store import dumps
from nemo_rl_ext.evals.timings import Timings

PROFILE_PLOT = "reward_profile.png"
"""The profile's PNG, in the output folder."""
DIFFICULTY_FILE = "difficulty.jsonl"
"""The per-prompt difficulty file, in the output folder (format in the module docstring)."""
DIFFICULTY_BINS: tuple[str, ...] = ("0", "(0, 0.2)", "[0.2, 0.4)", "[0.4, 0.6)", "[0.6, 0.8)", "[0.8, 1)", "1")
"""The histogram's bins of a prompt's solved fraction: none solved, five fifths in between, all solved."""
TIMING_KEYS = frozenset({"latency_s"})
"""summary.json keys whose values are wall-clock measurements (they differ between otherwise identical runs)."""


def difficulty_bin(num_solved: int, num_samples: int) -> str:
    """The `DIFFICULTY_BINS` label of a prompt with `num_solved` of `num_samples` (>= 1) samples solved."""
    if num_solved == 0:
        return DIFFICULTY_BINS[0]
    if num_solved == num_samples:
        return DIFFICULTY_BINS[-1]
    return DIFFICULTY_BINS[1 + min(5 * num_solved // num_samples, 4)]  # integer arithmetic: exact edges


def without_timings(obj: Any) -> Any:
    """A copy of a parsed JSON value (summary.json) without its `TIMING_KEYS`, at any depth."""
    if isinstance(obj, Mapping):
        return {k: without_timings(v) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, list | tuple):
        return [without_timings(v) for v in obj]
    return obj


def untimed_bytes(data: bytes, indent: bool = False) -> bytes:
    """A JSON document (summary.json: `indent=True`) rewritten by `dumps` without its `TIMING_KEYS`, key
    order kept: what two runs with the same completions agree on byte for byte."""
    return dumps(without_timings(orjson.loads(data)), indent=indent)


@dataclass(frozen=True, eq=False)
class Spread(JsonView):
    """Mean and percentiles of a per-sample quantity over the samples that have it."""

    num_samples: int
    """Samples measured."""
    mean: float | None
    """Their mean (None: no sample measured)."""
    p50: float | None
    """Their median (numpy's linear-interpolation percentile; None: no sample measured)."""
    p95: float | None
    """Their 95th percentile (as p50)."""

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of these values."""
        if not values:
            return cls(0, None, None, None)
        arr = np.asarray(values, dtype=np.float64)
        p50, p95 = np.percentile(arr, [50, 95])
        return cls(len(arr), float(arr.mean()), float(p50), float(p95))

    def to_json(self) -> dict[str, Any]:
        """{num_samples, mean, p50, p95}."""
        return {"num_samples": self.num_samples, "mean": self.mean, "p50": self.p50, "p95": self.p95}


@dataclass(frozen=True, eq=False)
class TaskProfile(JsonView):
    """The reward profile of one task (agent), or of every prompt together."""

    num_prompts: int
    """Prompts."""
    num_samples: int
    """(prompt, sample) pairs, errors included."""
    num_errors: int
    """Pairs whose line is an error (infrastructure failures; not scored)."""
    error_rate: float
    """num_errors / num_samples."""
    metrics: Mapping[str, float | Mapping[int, float] | None]
    """Metric name -> the summary's value for this task, for each `in_profile` metric of `metric_defs()` in its
    order: a per-k metric as k -> value for each k some prompt has k non-error samples for (JSON key
    `<name>_at_k`), the others a float, None when nothing was scored (JSON key `<name>`)."""
    truncation_rate: float | None
    """Fraction of the non-error samples that hit the length limit (None: none)."""
    mean_turns: float | None
    """Mean assistant turns of the non-error samples (None: none)."""
    generated_tokens: Spread
    """Tokens the model generated per non-error sample (the assistant messages' `num_tokens`)."""
    latency_s: Spread
    """Rollout wall seconds of the non-error samples that have an entry in timings.jsonl."""
    difficulty: Mapping[str, int]
    """`DIFFICULTY_BINS` label -> prompts whose solved fraction falls in it (every bin, in order)."""
    num_prompts_unscored: int
    """Prompts left out of `difficulty` because every sample was an error."""

    @property
    def mean_reward(self) -> float | None:
        """Mean over prompts of the prompt's mean reward (the summary's `mean_reward`; None: nothing scored)."""
        value = self.metrics.get("mean_reward")
        return value if not isinstance(value, Mapping) else None

    @property
    def pass_at_k(self) -> Mapping[int, float]:
        """k -> pass@k (the summary's value), for each k that some prompt has k non-error samples for."""
        return self.per_k("pass")

    @property
    def maj_at_k(self) -> Mapping[int, float]:
        """k -> maj@k, likewise."""
        return self.per_k("maj")

    def per_k(self, name: str) -> Mapping[int, float]:
        """k -> the per-k metric `name` ({} when the profile has no such metric)."""
        value = self.metrics.get(name)
        return value if isinstance(value, Mapping) else {}

    def to_json(self) -> dict[str, Any]:
        """The task's object in summary.json's `profile` (the ks as string keys)."""
        metrics = {
            f"{name}_at_k" if isinstance(v, Mapping) else name: (
                {str(k): x for k, x in v.items()} if isinstance(v, Mapping) else v
            )
            for name, v in self.metrics.items()
        }
        return {
            "num_prompts": self.num_prompts,
            "num_samples": self.num_samples,
            "num_errors": self.num_errors,
            "error_rate": self.error_rate,
            **metrics,
            "truncation_rate": self.truncation_rate,
            "mean_turns": self.mean_turns,
            "generated_tokens": self.generated_tokens.to_json(),
            "latency_s": self.latency_s.to_json(),
            "difficulty": dict(self.difficulty),
            "num_prompts_unscored": self.num_prompts_unscored,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TaskProfile:
        """The task profile of a parsed summary.json entry (every key that is not a field is a metric)."""
        fields = {k: v for k, v in obj.items() if k in cls.__dataclass_fields__}
        metrics: dict[str, float | Mapping[int, float] | None] = {}
        for key, v in obj.items():
            if key in cls.__dataclass_fields__:
                continue
            if key.endswith("_at_k") and isinstance(v, Mapping):
                metrics[key.removesuffix("_at_k")] = {int(k): x for k, x in v.items()}
            else:
                metrics[key] = v
        return cls(
            **{
                **fields,
                "metrics": metrics,
                "generated_tokens": Spread(**obj["generated_tokens"]),
                "latency_s": Spread(**obj["latency_s"]),
            }
        )


@dataclass(frozen=True, eq=False)
class PromptDifficulty(JsonView):
    """One line of difficulty.jsonl: how many of a prompt's samples were solved."""

    prompt_idx: int
    """The dataset row."""
    agent: str
    """Its agent (or task)."""
    num_samples: int
    """Its non-error samples."""
    num_solved: int
    """Those with reward >= the eval's reward_threshold."""
    num_errors: int
    """Its error samples (not in num_samples)."""

    @property
    def solved_fraction(self) -> float | None:
        """num_solved / num_samples; None when every sample was an error."""
        return self.num_solved / self.num_samples if self.num_samples else None

    def to_json(self) -> dict[str, Any]:
        """The difficulty.jsonl object (keys as the module docstring lists them)."""
        return {
            "prompt_idx": self.prompt_idx,
            "agent": self.agent,
            "num_samples": self.num_samples,
            "num_solved": self.num_solved,
            "solved_fraction": self.solved_fraction,
            "num_errors": self.num_errors,
        }


@dataclass(frozen=True, eq=False)
class RewardProfile(JsonView):
    """summary.json's `profile`: overall and per task; the per-prompt rows go to difficulty.jsonl instead."""

    overall: TaskProfile
    """Every prompt together."""
    tasks: Mapping[str, TaskProfile]
    """Agent (or task) -> its profile, sorted by name."""
    prompts: tuple[PromptDifficulty, ...] | None = field(default=None)
    """The rows of difficulty.jsonl, in prompt order; None when read back from summary.json (not stored there)."""

    def to_json(self) -> dict[str, Any]:
        """{"overall": ..., "tasks": {agent: ...}} (the prompts are not part of it)."""
        return {"overall": self.overall.to_json(), "tasks": {a: t.to_json() for a, t in self.tasks.items()}}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RewardProfile:
        """The profile of a parsed summary.json `profile` (without its prompts)."""
        return cls(
            TaskProfile.from_json(obj["overall"]), {a: TaskProfile.from_json(t) for a, t in obj["tasks"].items()}
        )


def generated_tokens(line: CompletionLine) -> int:
    """Tokens the model generated in the sample: the `num_tokens` of its assistant messages."""
    return sum(m.num_tokens for m in line.message_log if m.role == "assistant")


def _task_profile(
    groups: Sequence[Sequence[CompletionLine]], threshold: float, metrics: Mapping[str, float], prefix: str,
    ks: Sequence[int], timings: Timings,
) -> TaskProfile:
    lines = [x for g in groups for x in g]
    scored = [x for x in lines if not x.is_error]
    hist = dict.fromkeys(DIFFICULTY_BINS, 0)
    unscored = 0
    for group in groups:
        ok = [x for x in group if not x.is_error]
        if ok:
            hist[difficulty_bin(sum(x.reward >= threshold for x in ok), len(ok))] += 1
        else:
            unscored += 1
    return TaskProfile(
        num_prompts=len(groups),
        num_samples=len(lines),
        num_errors=len(lines) - len(scored),
        error_rate=(len(lines) - len(scored)) / len(lines) if lines else 0.0,
        metrics={
            m.name: {k: metrics[key] for k in ks if (key := f"{prefix}{m.name}@{k}") in metrics} if m.per_k
            else metrics.get(f"{prefix}{m.name}")
            for m in metric_defs() if m.in_profile
        },
        truncation_rate=sum(x.truncated for x in scored) / len(scored) if scored else None,
        mean_turns=sum(x.num_turns for x in scored) / len(scored) if scored else None,
        generated_tokens=Spread.of([generated_tokens(x) for x in scored]),
        latency_s=Spread.of(
            [timings[key] for x in scored if (key := (x.prompt_idx, x.sample_idx)) in timings]
        ),
        difficulty=hist,
        num_prompts_unscored=unscored,
    )


def reward_profile(
    groups: Sequence[Sequence[CompletionLine]],
    ks: Sequence[int],
    threshold: float,
    metrics: Mapping[str, float],
    timings: Timings | None = None,
) -> RewardProfile:
    """The profile of the prompts' lines (`groups[i]`: one line per sample of prompt i, its result or latest
    error; every line of a group has the same `prompt_idx` and `agent`).

    `metrics`: `aggregate_eval_metrics` of the same prompts (with `ks` and `threshold`); every `in_profile` metric
    of `metric_defs()` is read from it, so the profile and the summary's table can never disagree. `timings`
    (`read_timings` of the folder; None: none) gives the latencies. The rest is computed from the lines here."""
    timings = timings or {}
    by_agent: dict[str, list[Sequence[CompletionLine]]] = {}
    for group in groups:
        by_agent.setdefault(group[0].agent, []).append(group)
    prompts = tuple(
        PromptDifficulty(
            prompt_idx=g[0].prompt_idx,
            agent=g[0].agent,
            num_samples=sum(not x.is_error for x in g),
            num_solved=sum(not x.is_error and x.reward >= threshold for x in g),
            num_errors=sum(x.is_error for x in g),
        )
        for g in groups
    )
    return RewardProfile(
        overall=_task_profile(groups, threshold, metrics, "", ks, timings),
        tasks={
            a: _task_profile(by_agent[a], threshold, metrics, f"agent/{a}/", ks, timings) for a in sorted(by_agent)
        },
        prompts=prompts,
    )


def write_difficulty(path: Path, prompts: Sequence[PromptDifficulty]) -> None:
    """Write difficulty.jsonl (one object per prompt, in the given order) atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(dumps(p.to_json()) + b"\n" for p in prompts))
    os.replace(tmp, path)
