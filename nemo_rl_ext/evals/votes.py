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

import math
import operator
from bisect import bisect_right
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


def _drawn_at_most(multiplicity: int, x: int, after: int, budget: int) -> np.ndarray:
    """w[c] = ways to draw c samples of an answer with `multiplicity` samples that neither outnumbers nor ties
    the winner's x draws, except a tie drawn wholly from its `after` samples that lie after the winner's first
    (c <= budget)."""
    w = np.array([float(math.comb(multiplicity, c)) for c in range(min(x - 1, budget) + 1)])
    if x <= budget:
        w = np.append(w, float(math.comb(after, x)))
    return w


def cons_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> float:
    """NeMo-RL's cons@k of one prompt: exact over all C(n, k) k-subsets (module docstring).

    Computation. Answer a wins a subset with x draws, its first draw at its sample p, when every other answer b
    is drawn fewer than x times, or exactly x times all from its samples after p (then a comes first in the
    subset). So the winning subsets are counted per (x, p) as C(a's samples after p, x - 1) times the coefficient
    of t^(k-x) in the product of the other answers' generating functions (`_drawn_at_most`; answers with fewer
    than x samples can never tie, and are pooled as (1 + t)^pool). Only answers whose first sample is correct
    contribute. The cost is a few convolutions of length <= k per (x, sample), not C(n, k) subsets.
    """
    k = _checked(answers, correct, k)
    n = len(answers)
    positions: dict[Hashable | None, list[int]] = {}
    for i, a in enumerate(answers):
        positions.setdefault(a, []).append(i)
    groups = list(positions.values())
    total = 0.0
    for x in range(1, k + 1):
        big = [g for g in groups if len(g) >= x]
        if not big:
            break
        budget = k - x
        pool = n - sum(len(g) for g in big)
        pooled = np.array([float(math.comb(pool, c)) for c in range(budget + 1)])
        for gi, mine in enumerate(big):
            if not correct[mine[0]]:
                continue  # the subsets it wins score its first sample: 0
            for j, p in enumerate(mine):
                ways = math.comb(len(mine) - j - 1, x - 1)
                if ways == 0:
                    break  # fewer than x - 1 of its samples lie after p, also for every later p
                poly = pooled
                for gb, other in enumerate(big):
                    if gb != gi:
                        after = len(other) - bisect_right(other, p)
                        poly = np.convolve(poly, _drawn_at_most(len(other), x, after, budget))[: budget + 1]
                total += ways * float(poly[budget])
    return total / math.comb(n, k)
