"""bench/learning.py's scoring and statistics: strict and lenient correctness of each held-out answer, per-prompt
scores from an eval's completions.jsonl, and the paired bootstrap of after - before.

- **strict**: the whole answer (the assistant's text, whitespace stripped) is the expected answer, nothing else
  (`strict_correct`, from `nemo_rl_ext/data/answers.py`: the project's Gym grader reports the same reading).
- **lenient**: the eval's grader said so (the completion's reward >= the threshold; for arithmetic the `math`
  environment's math-verify reading, which finds the number inside "The answer is 44.").

Standard library, numpy and that module only (no torch), so the unit tests and the report import it cheaply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rl_ext.data.answers import strict_correct


def lenient_correct(reward: float, threshold: float = 1.0) -> bool:
    """True when the grader's reward reaches the threshold (the eval's own reading of the answer)."""
    return reward >= threshold


def assistant_text(line: Mapping[str, Any]) -> str | None:
    """The last assistant message of a completions.jsonl line (None when there is none)."""
    for message in reversed(line.get("message_log") or []):
        if message.get("role") == "assistant":
            return message.get("content")
    return None


class ErrorSamplesLeft(ValueError):
    """An eval left error samples (infrastructure failures, not answers): re-run it to retry them."""


@dataclass(frozen=True)
class PromptScores:
    """One eval's per-prompt scores (index = the row's prompt_idx in the held-out file)."""

    strict: np.ndarray
    """Per prompt: the share of its samples that are strictly correct (0 or 1 for a greedy eval)."""
    lenient: np.ndarray
    """Per prompt: the share of its samples the grader passed."""
    truncated: np.ndarray
    """Per prompt: the share of its samples cut at the token limit."""
    num_samples: int
    """Samples per prompt (every prompt has this many non-error samples)."""


def read_scores(completions: Path, expected: Sequence[str], threshold: float = 1.0) -> PromptScores:
    """Per-prompt strict / lenient / truncation shares from an eval's completions.jsonl.

    `expected[i]` is the answer of prompt_idx i. Raises ValueError naming what is wrong when a prompt is missing,
    an error sample is left, or the prompts have different sample counts (a paired comparison needs them whole)."""
    by_prompt: dict[int, list[tuple[bool, bool, bool]]] = {}
    for raw in completions.read_text().splitlines():
        if not raw.strip():
            continue
        line = json.loads(raw)
        if line["stop_reason"] == "error":
            raise ErrorSamplesLeft(f"{completions}: prompt {line['prompt_idx']} sample {line['sample_idx']} is an error "
                             f"sample ({line.get('error')}); re-run the eval to retry it")
        idx = line["prompt_idx"]
        if not 0 <= idx < len(expected):
            raise ValueError(f"{completions}: prompt_idx {idx} is outside the {len(expected)} held-out rows")
        text = assistant_text(line)
        by_prompt.setdefault(idx, []).append(
            (strict_correct(text, expected[idx]), lenient_correct(line["reward"], threshold), line["truncated"]))
    missing = sorted(set(range(len(expected))) - set(by_prompt))
    if missing:
        raise ValueError(f"{completions}: {len(missing)} held-out prompt(s) have no completion, e.g. {missing[:5]}")
    counts = {len(v) for v in by_prompt.values()}
    if len(counts) != 1:
        raise ValueError(f"{completions}: prompts have different sample counts {sorted(counts)}")
    table = np.array([[np.mean([s[j] for s in by_prompt[i]]) for j in range(3)] for i in range(len(expected))])
    return PromptScores(strict=table[:, 0], lenient=table[:, 1], truncated=table[:, 2], num_samples=counts.pop())


@dataclass(frozen=True)
class PairedDiff:
    """The mean paired difference after - before over prompts, with its percentile bootstrap interval."""

    before: float
    """Mean score before."""
    after: float
    """Mean score after."""
    diff: float
    """after - before (the mean of the per-prompt differences)."""
    low: float
    """Lower end of the interval."""
    high: float
    """Upper end of the interval."""

    def excludes_zero(self) -> bool:
        """True when the whole interval lies on one side of 0."""
        return self.low > 0.0 or self.high < 0.0

    def to_json(self) -> dict[str, float]:
        """The fields as a JSON object."""
        return {"before": self.before, "after": self.after, "diff": self.diff, "low": self.low, "high": self.high}


def paired_bootstrap(before: Sequence[float] | np.ndarray, after: Sequence[float] | np.ndarray, *,
                     seed: int = 0, resamples: int = 10_000, confidence: float = 0.95) -> PairedDiff:
    """The paired bootstrap of mean(after - before): resample prompt indices with replacement (a seeded numpy
    Generator), take the mean difference of each resample, and report the percentile interval."""
    b = np.asarray(before, dtype=np.float64)
    a = np.asarray(after, dtype=np.float64)
    if b.shape != a.shape or b.ndim != 1 or b.size == 0:
        raise ValueError(f"need two equal-length non-empty 1-D score arrays, got shapes {b.shape} and {a.shape}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    diffs = a - b
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, diffs.size, size=(resamples, diffs.size))
    means = diffs[idx].mean(axis=1)
    tail = (1.0 - confidence) / 2.0 * 100.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return PairedDiff(before=float(b.mean()), after=float(a.mean()), diff=float(diffs.mean()),
                      low=float(low), high=float(high))


def by_group(values: np.ndarray, groups: Sequence[str]) -> dict[str, np.ndarray]:
    """Split per-prompt values by each prompt's group label (e.g. the operator), in first-seen order."""
    out: dict[str, list[float]] = {}
    for value, group in zip(values, groups, strict=True):
        out.setdefault(group, []).append(float(value))
    return {g: np.array(v) for g, v in out.items()}


def mean_interval(values: Sequence[float] | np.ndarray, *, seed: int = 0, resamples: int = 10_000,
                  confidence: float = 0.95) -> PairedDiff:
    """The mean of per-prompt scores with its percentile bootstrap interval: `paired_bootstrap` against all
    zeros, so the resampling is the paired one's, problem for problem (`after`, `diff`, `low`, `high`)."""
    v = np.asarray(values, dtype=np.float64)
    return paired_bootstrap(np.zeros_like(v), v, seed=seed, resamples=resamples, confidence=confidence)


def turn_profile(completions: Path) -> dict[str, Any]:
    """A multi-turn eval's turns: the share of samples solved on the first assistant turn and on a later one,
    the mean assistant turns, and per environment reply (e.g. "Higher.") the count of each next assistant turn,
    which shows whether the model's next move depends on what the environment said."""
    first = later = turns = n = 0
    after: dict[str, dict[str, int]] = {}
    for raw in completions.read_text().splitlines():
        if not raw.strip():
            continue
        line = json.loads(raw)
        log = line.get("message_log") or []
        assistant = [i for i, m in enumerate(log) if m.get("role") == "assistant"]
        n, turns = n + 1, turns + len(assistant)
        if line["reward"] >= 1.0:
            first, later = first + (len(assistant) == 1), later + (len(assistant) > 1)
        for i in assistant[1:]:
            reply = (log[i - 1].get("content") or "").strip()
            move = (log[i].get("content") or "").strip()
            after.setdefault(reply, {})
            after[reply][move] = after[reply].get(move, 0) + 1
    if n == 0:
        raise ValueError(f"{completions}: no completions")
    return {"solved_first_turn": first / n, "solved_later_turn": later / n, "mean_turns": turns / n,
            "next_move_after_reply": after}
