"""bench/learning.py's tasks: seeded generators of training and held-out problems that share no problem.

- `arithmetic`: "What is a + b?" style questions. Each operator has its own operand range (`+` and `-`: 10..99,
  `*`: 1..9 by default, the issue's 2-digit additions and subtractions and 1-digit products). Every (a, op, b) of
  an operator's range is enumerated, shuffled with the seed, and split in proportion held-out : training, so no
  (a, op, b) is in both; each split then takes an equal share per operator where the operator has enough
  problems, the others filling what a small operator lacks (1-digit products have only 81).
- `say_yes`: "Say yes. <word>", answer "yes" (the task a random tiny model learns in seconds; the functional
  test's). Training and held-out words are disjoint.
- `guess_number` (multi-turn, the `guess_number` environment): "I am thinking of a whole number from L to H.
  Guess it.", answer the secret. Every (L, H, secret) with L in `guess_lows` and H - L + 1 in `guess_widths` is
  enumerated, shuffled with the seed and split in proportion held-out : training, so no game is in both.
- `guess_123` (multi-turn, scripted for a random tiny model): "Guess 1, 2 or 3. <word>", the secret 1, 2 or 3 in
  turn over the shuffled words; training and held-out words are disjoint.
- `signal_word` (multi-turn, scripted for a random tiny model, the `signal_word` environment): "Woof: dog. Meow:
  cat. <word>"; the model's first turn is free, the environment then says "Woof." or "Meow." (drawn per problem:
  alternating over the seeded shuffle of the words, so each split is balanced), and the answer is "dog" or "cat"
  accordingly. The prompt does not say which: only the environment's reply does. Training and held-out words
  are disjoint (disjoint prompts; the two signals and answers are the task, in both splits).

Each row: {"id", "question", "answer", "op"} (`op`: the operator, or "yes"), the JSONL the project's data loader
reads (`question`/`answer`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
"""The operators the arithmetic task knows."""

DEFAULT_RANGES = {"+": (10, 99), "-": (10, 99), "*": (1, 9)}
"""Default inclusive operand range per operator."""

YES_WORDS = (
    "apple river blue seven cat hello tree water fire mountain dog bird fish time day year good bad big small "
    "new old long short fast slow hot cold happy sad red green black white book car house banana orange city "
    "today tomorrow weather search query model world number answer value total result first then final zero "
    "one two three four five six eight nine ten hundred please thank"
).split()
"""The words of the say_yes task's prompts (split between training and held-out)."""
SIGNALS = (("Woof.", "dog"), ("Meow.", "cat"))
"""What the signal_word task's environment says, and the answer each asks for."""


@dataclass(frozen=True)
class TaskSpec:
    """Which task, how many problems, and (arithmetic) which operators and operand ranges."""

    name: str
    """The task: "arithmetic", "say_yes", "guess_number", "guess_123" or "signal_word"."""
    train_size: int
    """Training problems."""
    heldout_size: int
    """Held-out problems."""
    seed: int = 0
    """Seed of the shuffle and the split."""
    ops: tuple[str, ...] = ("+", "-", "*")
    """Operators (arithmetic)."""
    ranges: tuple[tuple[str, int, int], ...] = tuple((op, lo, hi) for op, (lo, hi) in DEFAULT_RANGES.items())
    """(operator, low, high) inclusive operand ranges (arithmetic)."""
    guess_lows: tuple[int, int] = (1, 60)
    """Inclusive range of a game's lowest number (guess_number)."""
    guess_widths: tuple[int, int] = (3, 10)
    """Inclusive range of how many numbers a game has (guess_number)."""


def _quota(pools: dict[str, list], size: int, split: str) -> dict[str, int]:
    """An equal share of `size` per pool, what a small pool cannot give going to the others in turn."""
    take = dict.fromkeys(pools, 0)
    left = size
    while left > 0:
        open_pools = [k for k in pools if take[k] < len(pools[k])]
        if not open_pools:
            raise ValueError(f"the {split} split has only {sum(map(len, pools.values()))} distinct problems "
                             f"({size} asked): widen the operand ranges (--range) or ask for fewer problems")
        share = max(1, left // len(open_pools))
        for key in open_pools:
            extra = min(share, len(pools[key]) - take[key], left)
            take[key] += extra
            left -= extra
    return take


def _arithmetic(spec: TaskSpec) -> tuple[list[dict], list[dict]]:
    ranges = {op: (lo, hi) for op, lo, hi in spec.ranges}
    unknown = [op for op in spec.ops if op not in OPS or op not in ranges]
    if unknown:
        raise ValueError(f"operators {unknown}: known are {sorted(OPS)}, each with an operand range")
    rng = random.Random(spec.seed)
    share = spec.heldout_size / (spec.heldout_size + spec.train_size)
    held_pools, train_pools = {}, {}
    for op in spec.ops:
        lo, hi = ranges[op]
        pool = [(a, op, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
        rng.shuffle(pool)
        cut = max(1, round(len(pool) * share))
        held_pools[op], train_pools[op] = pool[:cut], pool[cut:]
    splits = []
    for pools, size, split in ((train_pools, spec.train_size, "training"),
                               (held_pools, spec.heldout_size, "held-out")):
        take = _quota(pools, size, split)
        rows = [t for op in spec.ops for t in pools[op][:take[op]]]
        rng.shuffle(rows)
        splits.append([{"question": f"What is {a} {op} {b}?", "answer": str(OPS[op](a, b)), "op": op}
                       for a, op, b in rows])
    return splits[0], splits[1]


def _say_yes(spec: TaskSpec) -> tuple[list[dict], list[dict]]:
    if spec.train_size + spec.heldout_size > len(YES_WORDS):
        raise ValueError(f"say_yes has {len(YES_WORDS)} words: train + held-out must not exceed that")
    words = list(YES_WORDS)
    random.Random(spec.seed).shuffle(words)
    rows = [{"question": f"Say yes. {w}", "answer": "yes", "op": "yes"} for w in words]
    return rows[:spec.train_size], rows[spec.train_size:spec.train_size + spec.heldout_size]


def _guess_number(spec: TaskSpec) -> tuple[list[dict], list[dict]]:
    (low_min, low_max), (w_min, w_max) = spec.guess_lows, spec.guess_widths
    if w_min < 1 or w_max < w_min or low_max < low_min:
        raise ValueError(f"guess_number: lows {spec.guess_lows} and widths {spec.guess_widths} must be LOW:HIGH "
                         "ranges with widths >= 1")
    games = [(lo, lo + w - 1, s) for lo in range(low_min, low_max + 1) for w in range(w_min, w_max + 1)
             for s in range(lo, lo + w)]
    if spec.train_size + spec.heldout_size > len(games):
        raise ValueError(f"guess_number has {len(games)} distinct games with these lows and widths: train + "
                         "held-out must not exceed that (widen --guess-lows / --guess-widths)")
    rng = random.Random(spec.seed)
    rng.shuffle(games)
    rows = [{"question": f"I am thinking of a whole number from {lo} to {hi}. Guess it.", "answer": str(s),
             "op": f"width {hi - lo + 1}"} for lo, hi, s in games]
    return rows[spec.heldout_size:spec.heldout_size + spec.train_size], rows[:spec.heldout_size]


def _guess_123(spec: TaskSpec) -> tuple[list[dict], list[dict]]:
    if spec.train_size + spec.heldout_size > len(YES_WORDS):
        raise ValueError(f"guess_123 has {len(YES_WORDS)} words: train + held-out must not exceed that")
    words = list(YES_WORDS)
    random.Random(spec.seed).shuffle(words)
    rows = [{"question": f"Guess 1, 2 or 3. {w}", "answer": str(i % 3 + 1), "op": f"secret {i % 3 + 1}"}
            for i, w in enumerate(words)]
    return rows[:spec.train_size], rows[spec.train_size:spec.train_size + spec.heldout_size]


def _signal_word(spec: TaskSpec) -> tuple[list[dict], list[dict]]:
    words = [w for w in YES_WORDS if w not in {a for _, a in SIGNALS}]  # no prompt names an answer
    if spec.train_size + spec.heldout_size > len(words):
        raise ValueError(f"signal_word has {len(words)} words: train + held-out must not exceed that")
    random.Random(spec.seed).shuffle(words)
    train, heldout = words[:spec.train_size], words[spec.train_size:spec.train_size + spec.heldout_size]

    def rows(split: list[str]) -> list[dict]:
        return [{"question": f"Woof: dog. Meow: cat. {w}", "answer": SIGNALS[i % 2][1], "op": SIGNALS[i % 2][0]}
                for i, w in enumerate(split)]

    return rows(train), rows(heldout)


def make_task(spec: TaskSpec) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows), with ids, for the spec; no question is in both."""
    makers = {"arithmetic": _arithmetic, "say_yes": _say_yes, "guess_number": _guess_number,
              "guess_123": _guess_123, "signal_word": _signal_word}
    if spec.name not in makers:
        raise ValueError(f"task {spec.name!r}: known tasks are {sorted(makers)}")
    train, heldout = makers[spec.name](spec)
    for prefix, rows in (("train", train), ("heldout", heldout)):
        for i, row in enumerate(rows):
            row["id"] = f"{prefix}-{i:05d}"
    return train, heldout


def write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    """Write rows as JSON lines (creating the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def parse_ranges(text: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """`["+:10:99", "*:1:9"]` -> (("+", 10, 99), ("*", 1, 9)), defaults for operators not named."""
    ranges = dict(DEFAULT_RANGES)
    for item in text:
        try:
            op, lo, hi = item.split(":")
            ranges[op] = (int(lo), int(hi))
        except ValueError:
            raise ValueError(f"operand range {item!r}: write OP:LOW:HIGH, e.g. '+:10:99'") from None
    return tuple((op, lo, hi) for op, (lo, hi) in ranges.items())


def parse_pair(text: str, option: str) -> tuple[int, int]:
    """`"3:10"` -> (3, 10); anything else is a ValueError naming the option."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{option} {text!r}: write LOW:HIGH, e.g. '3:10'") from None
    return lo, hi
