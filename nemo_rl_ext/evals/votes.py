"""Two other projects' majority votes, each computed exactly by its own definition (ours, `maj@k`, is in metrics.py).

Every function takes one prompt's samples in sample order (`sample_idx`: the order of NeMo-Skills' seed files
`output-rs0..` and of NeMo-RL's groups): `answers[i]` is sample i's vote key (None: no answer) and `correct[i]`
whether it is correct (`reward >= eval.reward_threshold`).

- `majority_at_k`, NeMo-Skills' `majority@k` (`BaseMetrics._compute_majority_at_k`): a vote over the **first k**
  samples. Samples without an answer do not vote; if none is left the score is 0. The votes are counted per
  (answer, correct) pair, as NeMo-Skills counts them; the pairs drawn most often share the credit (the mean of
  their correctness). When correctness is a function of the answer, as when an environment grades the answer,
  the pairs are just the answers.
- `cons_at_k`, NeMo-RL's eval `cons@k` (`nemo_rl/evals/eval.py` `eval_cons_k`): the mean over **all C(n, k)
  k-subsets** of the n samples. In a subset the winner is `Counter(answers).most_common(1)`: the answer drawn
  most often, a tie going to the one drawn first (the earliest sample of the subset); a missing answer (None)
  is a vote like any other. The subset scores the correctness of the **first sample of the whole group** that
  gave the winning answer (`answers.index(winner)`).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np


def _checked(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> int:
    """The validated k (ValueError on a length mismatch or k outside 1..n)."""
    if isinstance(k, bool):
        raise ValueError("k must be an integer, got a bool")
    try:
        k = operator.index(k)
    except TypeError:
        raise ValueError(f"k must be an integer, got {k!r}") from None
    n = len(answers)
    if len(correct) != n:
        raise ValueError(f"{n} answers but {len(correct)} correctness flags")
    if n < 1:
        raise ValueError(f"need at least one sample, got n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..n={n}, got k={k}")
    return k


def majority_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """NeMo-Skills' majority@k of one prompt: the vote of its first k samples (module docstring).

    NeMo-Skills reports it for k >= 2 only; majority@1 here is whether the first sample is answered and correct.
    """
    k = _checked(answers, correct, k)
    votes = Counter((a, bool(ok)) for a, ok in zip(answers[:k], correct[:k], strict=True) if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    tied = [ok for (_, ok), count in votes.items() if count == top]
    return sum(tied) / len(tied)


MAX_CONS_SAMPLES = 1000
"""cons@k's largest sample count per prompt: C(1000, 500) ~ 2.7e299 still fits a float64."""


@functools.lru_cache(maxsize=8)
def _pascal(n: int) -> np.ndarray:
    """table[m, c] = C(m, c) for 0 <= m, c <= n (0 where c > m), as floats."""
    table = np.zeros((n + 1, n + 1))
    table[:, 0] = 1.0
    for m in range(1, n + 1):
        table[m, 1:] = table[m - 1, 1:] + table[m - 1, :-1]
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=4096)
def _below_x(multiplicity: int, x: int, size: int) -> np.ndarray:
    """The matrix M with rows @ M = each row (a polynomial in t, coefficient c in column c, `size` of them) times
    sum_{c<x} C(multiplicity, c) t^c, cut to `size` coefficients: M[i, j] = C(multiplicity, j - i) for j - i < x."""
    shift = np.arange(size)[None, :] - np.arange(size)[:, None]
    poly = np.array([float(math.comb(multiplicity, c)) for c in range(min(x, size))])
    matrix = np.where((shift >= 0) & (shift < len(poly)), poly[np.clip(shift, 0, len(poly) - 1)], 0.0)
    matrix.flags.writeable = False
    return matrix


def _times_factor(rows: np.ndarray, samples: np.ndarray, x: int, firsts: np.ndarray, comb: np.ndarray) -> np.ndarray:
    """Row r (a polynomial in t, cut to its length) times f_b at p = firsts[r], for the answer b whose samples
    are `samples`: sum_{c<x} C(m_b, c) t^c + C(b's samples after p, x) t^x (an x-tie only after p)."""
    size = rows.shape[1]
    out = rows @ _below_x(len(samples), x, size)
    if x < size:
        after = len(samples) - np.searchsorted(samples, firsts, side="right")
        out[:, x:] += comb[after, x][:, None] * rows[:, : size - x]
    return out


def cons_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """NeMo-RL's cons@k of one prompt: exact over all C(n, k) k-subsets (module docstring).

    Computation. Answer a wins a subset with x draws, its first draw at its sample p, when every other answer b
    is drawn fewer than x times, or exactly x times all from its samples after p (then a comes first in the
    subset). So the subsets a wins are counted per (x, p): C(a's samples after p, x - 1) times the coefficient
    of t^(k-x) in the product over the other answers b of f_b = sum_{c<x} C(m_b, c) t^c + C(b's samples after p,
    x) t^x (answers with fewer than x samples never tie: they are pooled as (1 + t)^pool). Only answers whose
    first sample is correct contribute. The product without a's own factor is the product of the factors before
    a's (in any fixed order of the answers) and of those after it: both are built for every p at once, so the cost
    is two small matrix products per (x, answer), not C(n, k) subsets.
    """
    k = _checked(answers, correct, k)
    n = len(answers)
    if n > MAX_CONS_SAMPLES:
        raise ValueError(f"cons@k counts subsets in float64, up to {MAX_CONS_SAMPLES} samples a prompt; got {n}")
    comb = _pascal(n)
    positions: dict[Hashable | None, list[int]] = {}
    for i, a in enumerate(answers):
        positions.setdefault(a, []).append(i)
    groups = [np.array(g) for g in positions.values()]
    total = 0.0
    for x in range(1, k + 1):
        big = [g for g in groups if len(g) >= x]
        if not big:
            break
        size = k - x + 1  # coefficients t^0 .. t^(k-x)
        pool = n - sum(len(g) for g in big)
        if len(big) == 1:  # no other answer can tie: sum_p C(after p, x - 1) * C(pool, k - x) = C(m, x) C(pool, k - x)
            total += float(correct[big[0][0]]) * comb[len(big[0]), x] * comb[pool, size - 1]
            continue
        winners = [i for i, g in enumerate(big) if correct[g[0]]]  # the others' subsets score their first: 0
        if winners:
            total += _won_with(x, big, winners, size, pool, comb)
    return float(total) / math.comb(n, k)


def _won_with(x: int, big: list[np.ndarray], winners: list[int], size: int, pool: int, comb: np.ndarray) -> float:
    """The (weighted) count of the subsets that a correct answer wins with x draws (`cons_at_k`'s docstring):
    `big` are the samples of each answer with >= x of them, `winners` those whose first sample is correct,
    `size` = k - x + 1 coefficients, `pool` the samples of the answers with fewer than x."""
    # the rows, in winner order: each possible first draw p of a winner (>= x - 1 of its samples after p)
    firsts = [big[i][: len(big[i]) - x + 1] for i in winners]
    weights = np.concatenate([comb[len(big[i]) - 1 - np.arange(len(f)), x - 1]
                              for i, f in zip(winners, firsts, strict=True)])
    p = np.concatenate(firsts)
    bounds = dict(zip(winners, itertools.pairwise(np.cumsum([0, *map(len, firsts)])), strict=True))
    before = np.zeros((len(p), size))  # the rows' product of the factors of the answers before their own
    start, running = 0, np.tile(comb[pool, :size], (len(p), 1))
    for b in range(len(big)):  # running: the rows from `start` on (the later answers' rows)
        if b in bounds:
            lo, hi = bounds[b]
            before[lo:hi] = running[lo - start: hi - start]
            running, start = running[hi - start:], hi
        if len(running):
            running = _times_factor(running, big[b], x, p[start:], comb)
    later = np.zeros((len(p), size))  # ... and of the factors of the answers after their own
    end, running = len(p), np.zeros((len(p), size))
    running[:, 0] = 1.0
    for b in reversed(range(len(big))):  # running: the rows before `end` (the earlier answers' rows)
        if b in bounds:
            lo, hi = bounds[b]
            later[lo:hi] = running[lo:hi]
            running, end = running[:lo], lo
        if len(running):
            running = _times_factor(running, big[b], x, p[:end], comb)
    return float(weights @ np.einsum("rc,rc->r", before, later[:, ::-1]))
