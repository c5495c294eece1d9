"""Eval metrics over the N samples of one prompt, and their aggregation over prompts.

Our per-prompt metrics are exact expectations over the C(n, k) equally likely k-subsets of the prompt's
n samples (drawn without replacement), so they use every sample and have no sampling noise of their own. Two
more majority votes are built in under their own projects' names (votes.py): NeMo-Skills' `majority@k` (the
first k samples in sample order) and NeMo-RL's `cons@k` (every k-subset, voted and scored NeMo-RL's way); the
three differ on the same samples, and docs/fidelity.md says how.
Aggregation averages per-prompt values over prompts (macro average) and reports a standard error.

Error samples (stop_reason "error": a dead server, a failed generation, an environment that raised) are
not answers: a prompt's n is its number of non-error samples, and the errors are only counted. A prompt
that errors leave with n < k is excluded from that k's metrics and counted in `num_prompts_short@k`.

The metrics are one list (`metric_defs()`: the built-ins, then what `register_metric` added) that the
aggregation here, the report's table and the reward profile (profile.py) iterate; docs/extending.md shows how
to add one.
"""

from __future__ import annotations

import math
import operator
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nemo_rl_ext.data.records import PromptGroupRecord, StopReason
from nemo_rl_ext.environments.interfaces import default_vote_key
from nemo_rl_ext.evals.votes import cons_at_k, majority_at_k


def _as_int(name: str, value: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _check_n_k(n: int, k: int) -> None:
    if n < 1:
        raise ValueError(f"need at least one sample, got n={n}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got k={k}")
    if k > n:
        raise ValueError(f"k={k} is larger than the number of samples n={n}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al. 2021): 1 - C(n-c, k) / C(n, k).

    The probability that a uniformly random k-subset of n samples, c of them correct, holds at least one
    correct sample. Computed in the stable product form 1 - prod_{i=n-c+1}^{n} (1 - k/i).
    """
    n, c, k = _as_int("n", n), _as_int("c", c), _as_int("k", k)
    if n < 0 or c < 0 or k < 0:
        raise ValueError(f"n, c and k must be non-negative, got n={n}, c={c}, k={k}")
    if c > n:
        raise ValueError(f"c={c} correct samples is more than n={n} samples")
    _check_n_k(n, k)
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k_rewards(rewards: Sequence[float], k: int, threshold: float = 1.0) -> float:
    """pass@k for non-binary rewards: a sample is correct when its reward is >= `threshold`."""
    c = sum(1 for r in rewards if r >= threshold)
    return pass_at_k(len(rewards), c, k)


def mean_reward(rewards: Sequence[float]) -> float:
    """Mean reward of the samples (ValueError when there are none)."""
    if len(rewards) == 0:
        raise ValueError("mean_reward of no samples")
    return float(math.fsum(rewards) / len(rewards))


def mean_at_k(rewards: Sequence[float], k: int) -> float:
    """Expected mean reward of a uniformly random k-subset of the samples.

    By linearity each sample is in a k-subset with probability k/n, so the expectation equals the mean of
    all n rewards for every valid k; k is still checked (1 <= k <= n) so that mean@k is reported exactly
    where pass@k and maj@k are.
    """
    _check_n_k(len(rewards), _as_int("k", k))
    return mean_reward(rewards)


def _capped_count_table(multiplicities: Sequence[int], cap: int, budget: int) -> np.ndarray:
    """table[s, t] = ways to draw s samples from answers with these multiplicities, each answer drawn at
    most `cap` times, exactly t answers drawn `cap` times (every multiplicity is >= cap)."""
    table = np.zeros((budget + 1, len(multiplicities) + 1))
    table[0, 0] = 1.0
    for m in multiplicities:
        new = np.zeros_like(table)
        for c in range(min(m, cap, budget) + 1):
            w = float(math.comb(m, c))
            if c < cap:
                new[c:, :] += w * table[: budget + 1 - c, :]
            else:
                new[c:, 1:] += w * table[: budget + 1 - c, :-1]
        table = new
    return table


def vote_key(answer: Any, env_extras: Mapping[str, Any] | None = None) -> str | None:
    """The maj@k vote of a sample: the `vote_key` its environment stored in `env_extras` when it graded the
    answer (math: spellings math-verify finds equivalent share one, see `EnvironmentInterface.vote_keys`),
    else `default_vote_key(answer)` (Gym rows, environments without keys, files written before keys
    existed); None (no answer) casts no vote."""
    if answer is None:
        return None
    stored = (env_extras or {}).get("vote_key")
    return str(stored) if stored is not None else default_vote_key(answer)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """Expected majority-vote accuracy of k samples, exact over all C(n, k) k-subsets.

    `answers` are vote keys (`vote_key`): samples with equal keys vote for the same answer, so pass keys,
    not raw answer strings (`21`, `21.` and `"21"` are one math answer and one key).

    Definition. For one k-subset: ignore samples whose answer is None; if none is left the score is 0.
    Otherwise the modes are the answers drawn most often; the score is the mean credit of the modes (a tie
    between t answers gives each 1/t of its credit, i.e. the expected score of a uniform tie-break). The
    credit of an answer is the fraction of all n samples with that answer that are marked correct (1 or 0
    when correctness is consistent per answer, as it is when correctness is a function of the answer).
    maj@k is the mean score over all k-subsets. maj@1 is the fraction of samples that are correct and
    carry an answer.

    Computation. For each answer a drawn x times (1 <= x <= k) to be a mode, the other answers are drawn
    at most x times each; a table over (samples drawn, answers tied at x) counts those draws, and the
    answers too rare to reach x are pooled with the None samples. Answers with equal multiplicity share one
    table, so the cost is O(k^2 * D) small array operations for D distinct answers (fast for n <= 64+).
    """
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"{n} answers but {len(correct)} correctness flags")
    k = _as_int("k", k)
    _check_n_k(n, k)
    counts = Counter(a for a in answers if a is not None)
    num_correct = Counter(a for a, ok in zip(answers, correct, strict=True) if a is not None and ok)
    credit_by_multiplicity: dict[int, float] = defaultdict(float)
    for answer, m in counts.items():
        credit_by_multiplicity[m] += num_correct[answer] / m
    num_none = n - sum(counts.values())
    total = 0.0
    for x in range(1, k + 1):
        big = sorted(m for m in counts.values() if m >= x)
        if not big:
            break
        pool = num_none + sum(m for m in counts.values() if m < x)
        budget = k - x
        free = np.array(
            [float(math.comb(pool, r)) for r in range(budget, -1, -1)]
        )  # free[s] = C(pool, budget-s)
        for m, credit in credit_by_multiplicity.items():
            if m < x or credit == 0.0:
                continue
            others = list(big)
            others.remove(m)
            table = _capped_count_table(others, x, budget)
            tie_share = 1.0 / np.arange(1, len(others) + 2)
            ways = float(free @ table @ tie_share)
            total += credit * math.comb(m, x) * ways
    return total / math.comb(n, k)


@dataclass(frozen=True)
class PromptSamples:
    """The scored samples of one prompt, as the metrics need them."""

    agent_name: str
    """The agent (or task) the prompt belongs to; metrics are also reported per agent."""
    rewards: tuple[float, ...]
    """Reward of each sample."""
    answers: tuple[str | None, ...]
    """Vote key of each sample's answer (`vote_key`; None: no answer), used by maj@k, majority@k and cons@k;
    in sample order (`sample_idx`), which majority@k (the first k) and cons@k (the first sample of an answer)
    depend on."""
    num_errors: int = 0
    """Samples that failed with an infrastructure error: not in `rewards`/`answers`, only counted."""

    def __post_init__(self) -> None:
        if len(self.rewards) != len(self.answers):
            raise ValueError(f"{len(self.rewards)} rewards but {len(self.answers)} answers")
        if self.num_errors < 0:
            raise ValueError(f"num_errors must be >= 0, got {self.num_errors}")
        if len(self.rewards) + self.num_errors == 0:
            raise ValueError("a prompt needs at least one sample")


def prompt_samples_from_record(record: PromptGroupRecord, answer_key: str = "answer") -> PromptSamples:
    """Build PromptSamples from a record: each answer (`completion.env_extras[answer_key]`) votes with its
    `vote_key` (the environment's key from `env_extras["vote_key"]`, else the answer's text; None when
    missing); errored completions are not samples, only counted in `num_errors`."""
    scored = [c for c in record.completions if c.stop_reason != StopReason.ERROR]
    answers = tuple(
        None if c.env_extras.get(answer_key) is None else vote_key(c.env_extras[answer_key], c.env_extras)
        for c in scored
    )
    return PromptSamples(
        agent_name=record.agent_name,
        rewards=tuple(float(c.reward) for c in scored),
        answers=answers,
        num_errors=len(record.completions) - len(scored),
    )


def _mean_and_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean, and the sample std (ddof=1) over sqrt(len); the stderr is 0 for a single value."""
    arr = np.asarray(values, dtype=np.float64)
    if len(arr) < 2:
        return float(arr.mean()), 0.0
    return float(arr.mean()), float(arr.std(ddof=1) / math.sqrt(len(arr)))


@dataclass(frozen=True)
class MetricDef:
    """One per-prompt eval metric: how it is computed over a prompt's samples and how the report shows it.

    Aggregation (`aggregate_eval_metrics`, hence the eval summary and GRPO validation), the report's table and
    the reward profile iterate `metric_defs()`, so a metric exists everywhere once it is registered."""

    name: str
    """Its name: the key is `name@k` for each k when `per_k`, else `name` (and the same under `agent/<a>/`)."""
    compute: Callable[[PromptSamples, tuple[bool, ...], int | None], float]
    """(samples, correct, k) -> the prompt's value; `correct[i]` is `samples.rewards[i] >= threshold`; only
    non-error samples are passed; k is None unless `per_k` (then 1 <= k <= n, n = len(samples.rewards))."""
    per_k: bool = True
    """True: computed for each k, over the prompts with n >= k; False: once, over the prompts with n >= 1."""
    description: str = ""
    """What it measures, in one line (report.md lists it under the table when the table shows the metric)."""
    report_format: str = ".3f"
    """The `format()` spec of its cells in the report (value and stderr)."""
    in_report: bool = True
    """Whether the report's table has its row(s) (one per k when `per_k`) by default; `eval.metrics`, when set,
    selects the rows instead."""
    in_profile: bool = True
    """Whether the reward profile (summary.json's `profile`, per task) carries it: `<name>_at_k` (k -> value) when
    `per_k`, else `<name>`; and the report's profile table its row(s)."""

    def keys(self, ks: Sequence[int]) -> list[str]:
        """Its metric keys for these ks (without the `/stderr` companions)."""
        return [f"{self.name}@{k}" for k in ks] if self.per_k else [self.name]


BUILTIN_METRICS: tuple[MetricDef, ...] = (
    MetricDef(
        "mean_reward",
        lambda p, correct, k: mean_reward(p.rewards),
        per_k=False,
        description="mean reward of the prompt's samples",
    ),
    MetricDef(
        "pass",
        lambda p, correct, k: pass_at_k(len(correct), sum(correct), k),
        description="probability that at least one of k samples is correct (unbiased estimator)",
    ),
    MetricDef(
        "maj",
        lambda p, correct, k: maj_at_k(p.answers, correct, k),
        description="ours: the mean over all k-subsets of the samples of the majority answer's credit (its fraction "
        "of correct samples); tied answers share it, a sample without an answer casts no vote",
    ),
    MetricDef("mean", lambda p, correct, k: mean_at_k(p.rewards, k), description="mean reward of k samples",
              in_profile=False),  # equal to mean_reward for every k: the profile has that
    MetricDef(
        "majority",
        lambda p, correct, k: majority_at_k(p.answers, correct, k),
        description="NeMo-Skills': the majority vote of the first k samples (by sample_idx); tied answers share "
        "the credit, a sample without an answer casts no vote",
        in_report=False,
        in_profile=False,
    ),
    MetricDef(
        "cons",
        lambda p, correct, k: cons_at_k(p.answers, correct, k),
        description="NeMo-RL's eval: the mean over all k-subsets of the vote's winner (a tie to the answer drawn "
        "first; no answer is a vote too), scored by the group's first sample with that answer",
        in_report=False,
        in_profile=False,
    ),
)
"""The metrics every eval computes (summary.json has them all), in report order. `majority` and `cons` are the
other projects' majority votes, named apart from ours (`maj`): in the report's table only when `eval.metrics`
lists them."""

_RESERVED = frozenset({"num_prompts", "num_samples", "num_errors", "num_prompts_short", "error_rate",
                       "truncation_rate", "mean_turns", "generated_tokens", "latency_s", "difficulty",
                       "num_prompts_unscored", "metrics"})
"""Count keys that aggregation writes itself, and the reward profile's own keys (profile.py `TaskProfile`): no
metric may take their names."""

_REGISTRY: dict[str, MetricDef] = {m.name: m for m in BUILTIN_METRICS}


def metric_defs() -> tuple[MetricDef, ...]:
    """Every registered metric, built-ins first, then the registered ones in registration order."""
    return tuple(_REGISTRY.values())


def register_metric(metric: MetricDef) -> MetricDef:
    """Add a metric to aggregation and report; returns it. ValueError on a name that is taken or is not a
    plain identifier (it becomes a slash-namespaced key, so no `@` or `/`)."""
    if not isinstance(metric, MetricDef):
        raise ValueError(f"register_metric takes a MetricDef, got {type(metric).__name__}")
    if not metric.name.isidentifier():
        raise ValueError(f"metric name {metric.name!r} must be an identifier (letters, digits, _)")
    if metric.name in _REGISTRY or metric.name in _RESERVED:
        raise ValueError(f"metric name {metric.name!r} is taken")
    if not callable(metric.compute):
        raise ValueError(f"metric {metric.name!r}: compute is not callable")
    _REGISTRY[metric.name] = metric
    return metric


def unregister_metric(name: str) -> None:
    """Remove a registered metric (built-ins stay); ValueError naming the registered ones otherwise."""
    if name not in _REGISTRY or any(m.name == name for m in BUILTIN_METRICS):
        extra = [m for m in _REGISTRY if all(b.name != m for b in BUILTIN_METRICS)]
        raise ValueError(f"{name!r} is not a registered (non-built-in) metric; registered: {extra}")
    del _REGISTRY[name]


def _compute(metric: MetricDef, p: PromptSamples, correct: tuple[bool, ...], k: int | None) -> float:
    try:
        return float(metric.compute(p, correct, k))
    except Exception as exc:
        at = "" if k is None else f"@{k}"
        exc.add_note(f"while computing metric {metric.name}{at} for a prompt of agent {p.agent_name!r}")
        raise


def _per_prompt_values(
    p: PromptSamples, ks: Sequence[int], threshold: float, defs: Sequence[MetricDef]
) -> dict[str, float]:
    """The prompt's metrics over its non-error samples; "short@k" = 1 where errors left it below k."""
    n = len(p.rewards)
    correct = tuple(r >= threshold for r in p.rewards)
    values = {m.name: _compute(m, p, correct, None) for m in defs if not m.per_k} if n else {}
    for k in ks:
        if k > n:
            if k <= n + p.num_errors:
                values[f"short@{k}"] = 1.0
            continue
        for m in defs:
            if m.per_k:
                values[f"{m.name}@{k}"] = _compute(m, p, correct, k)
    return values


def _aggregate(
    per_prompt: Sequence[dict[str, float]],
    prompts: Sequence[PromptSamples],
    ks: Sequence[int],
    prefix: str,
    defs: Sequence[MetricDef],
) -> dict[str, float]:
    out = {
        f"{prefix}num_prompts": float(len(per_prompt)),
        f"{prefix}num_samples": float(sum(len(p.rewards) for p in prompts)),
        f"{prefix}num_errors": float(sum(p.num_errors for p in prompts)),
    }
    for m in defs:
        scored = [v[m.name] for v in per_prompt if m.name in v] if not m.per_k else []
        if scored:
            mean, stderr = _mean_and_stderr(scored)
            out[f"{prefix}{m.name}"], out[f"{prefix}{m.name}/stderr"] = mean, stderr
    for k in ks:
        eligible = [v for v, p in zip(per_prompt, prompts, strict=True) if len(p.rewards) >= k]
        out[f"{prefix}num_prompts@{k}"] = float(len(eligible))
        out[f"{prefix}num_prompts_short@{k}"] = float(sum(f"short@{k}" in v for v in per_prompt))
        if not eligible:
            continue
        for m in defs:
            if m.per_k:
                key = f"{m.name}@{k}"
                mean, stderr = _mean_and_stderr([v[key] for v in eligible])
                out[f"{prefix}{key}"], out[f"{prefix}{key}/stderr"] = mean, stderr
    return out


def aggregate_eval_metrics(
    prompts: Sequence[PromptSamples], ks: Sequence[int], threshold: float = 1.0
) -> dict[str, float]:
    """Flat, slash-namespaced eval metrics over prompts, overall and per agent (`agent/<name>/...`).

    A sample is correct when its reward is >= `threshold` (pass@k and maj@k). Only non-error samples
    count: a prompt's n is `len(rewards)`, its `num_errors` are only counted. Keys, each also under
    `agent/<name>/`: `num_prompts` (all prompts), `num_samples` (non-error samples), `num_errors`,
    `mean_reward` and `mean_reward/stderr` (over prompts with n >= 1; absent when there are none), and
    for each k: `num_prompts@k` (prompts with n >= k), `num_prompts_short@k` (prompts that errors left
    with n < k although they had k or more samples), and, when `num_prompts@k` > 0, `pass@k`, `maj@k`,
    `mean@k`, `majority@k` (NeMo-Skills'), `cons@k` (NeMo-RL's) with their `/stderr`. A registered metric
    (`register_metric`) adds its keys the same way: per k after `cons@k`, else after `mean_reward`. A k larger than a prompt's n is skipped for that prompt: each @k
    metric is the mean over the prompts with n >= k only. stderr = sample std (ddof=1) of the per-prompt
    values / sqrt(number of those prompts), 0 for one prompt.
    """
    if len(prompts) == 0:
        raise ValueError("no prompts to aggregate")
    ks = sorted({_as_int("k", k) for k in ks})
    if ks and ks[0] < 1:
        raise ValueError(f"every k must be >= 1, got {ks[0]}")
    defs = metric_defs()
    per_prompt = [_per_prompt_values(p, ks, threshold, defs) for p in prompts]
    out = _aggregate(per_prompt, prompts, ks, "", defs)
    for agent in sorted({p.agent_name for p in prompts}):
        idx = [i for i, p in enumerate(prompts) if p.agent_name == agent]
        out.update(
            _aggregate([per_prompt[i] for i in idx], [prompts[i] for i in idx], ks, f"agent/{agent}/", defs)
        )
    return out
