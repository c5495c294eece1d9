"""Math answer grading with math-verify: extract the answer, compare it with the ground truth, key its vote.

Pure functions with no deadline of their own: some answers make sympy run for minutes (a huge binomial, a
`\\frac` nested 20 deep), and math-verify's own timeouts use `signal.alarm`, which only works in the main
thread, so they are off here (`parsing_timeout=None`, `timeout_seconds=None`). Environments call these
functions in killable worker processes with a per-answer deadline (`grading_pool.py`); what the timeouts
guarded against most often, a power tower such as `9^{9^{9}}`, is also refused before `verify`
(`_is_too_large`). Answer extraction is linear in the response length, so it is safe to call in-process.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from nemo_rl_ext.data.answers import clean_answer as _cleaned
from nemo_rl_ext.data.answers import extract_answer
from nemo_rl_ext.data.answers import squashed as _squashed

if TYPE_CHECKING:
    import sympy

# sympy, mpmath and math-verify (about 0.3 s to import) are imported by the functions that parse, not with this
# module: a process that never grades math (a string_match eval, the CLIs' start-up) does without them. A
# grading pool's forkserver preloads them once for its workers (GRADER_MODULES).
GRADER_MODULES = ("sympy", "mpmath", "math_verify")
"""The modules grading imports on first use."""

logger = logging.getLogger(__name__)


def _not_timeout_disabled_warning(record: logging.LogRecord) -> bool:
    """math-verify warns that its timeouts are off; callers bound grading in worker processes instead."""
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_not_timeout_disabled_warning)

MAX_ANSWER_CHARS = 1000
"""Longer extracted answers are not parsed (reward 0): no real answer is that long."""
MAX_RESULT_DIGITS = 100_000
"""Answers whose value has more decimal digits than this (a power tower, a huge factorial) are wrong."""
VOTE_KEY_DIGITS = 12
"""Significant digits of the vote key of an irrational number (`2\\sqrt{2}` and `\\sqrt{8}` share one)."""

GradingStatus = Literal["ok", "timeout"]


@dataclass(frozen=True)
class Grade:
    """The verdict on one response."""

    reward: float
    """1.0 when the answer matches the ground truth, else 0.0."""
    answer: str | None
    """The answer extracted from the response, or None when none was found (or grading timed out)."""
    vote_key: str | None = None
    """The answer's maj@k vote key (`math_vote_key`); a correct answer gets its ground truth's key."""
    status: GradingStatus = "ok"
    """ok; timeout: grading ran past its deadline and was killed (a grade that fails for any other reason is
    not a Grade: `grading_pool.GradingUnavailableError`, an error completion)."""


def grade_answer(response: str, ground_truth: Any) -> Grade:
    """Grade one response against its ground truth and key its vote; never raises, has no deadline."""
    answer = extract_answer(response)
    if answer is None:
        return Grade(reward=0.0, answer=None)
    truth = str(ground_truth).strip()
    if len(answer) > MAX_ANSWER_CHARS:
        return Grade(reward=0.0, answer=answer, vote_key=_squashed(answer))
    try:
        correct = _matches(answer, truth)
    except Exception:  # a grading bug or a sympy corner case must not kill the rollout
        logger.warning("grading failed for answer %.200r against %.200r", answer, ground_truth, exc_info=True)
        correct = False
    return Grade(reward=1.0 if correct else 0.0, answer=answer, vote_key=math_vote_key(truth if correct else answer))


def grade_answers(responses: Sequence[str], ground_truths: Sequence[Any]) -> list[Grade]:
    """Grade a batch in order, in this process (no deadline: environments use `GradingPool`)."""
    return [grade_answer(r, g) for r, g in zip(responses, ground_truths, strict=True)]


def math_vote_key(answer: str | None) -> str | None:
    """The maj@k vote key of a math answer: equal for spellings math-verify parses to the same value.

    Numbers key by exact value (`21`, `21.`, `"21"`, `21.0` -> "21"; `0.5`, `1/2`, `\\frac{1}{2}` -> "1/2"),
    other numeric expressions by their value to VOTE_KEY_DIGITS digits, `x = 3` like `3`, anything else by
    sympy's canonical text of the parse (`1+x` and `x+1` are one vote), and what does not parse by its text
    without spaces and `$`. Never raises; no deadline of its own (run it in a grading worker).
    """
    if answer is None:
        return None
    text = _cleaned(answer)
    if len(text) > MAX_ANSWER_CHARS:
        return _squashed(text)
    import sympy  # lazy: GRADER_MODULES load on first grading

    try:
        parsed = _parsed(text)
        if not parsed or not isinstance(parsed[0], sympy.Basic) or _is_too_large(parsed[0]):
            return _squashed(text)
        return _expression_key(parsed[0])
    except Exception:
        logger.warning("vote key failed for answer %.200r", answer, exc_info=True)
        return _squashed(text)


def _expression_key(expr: sympy.Basic) -> str:
    import sympy  # lazy: GRADER_MODULES load on first grading

    if isinstance(expr, sympy.Eq) and isinstance(expr.lhs, sympy.Symbol):
        return _expression_key(expr.rhs)
    if isinstance(expr, sympy.Rational):
        return str(expr)
    if isinstance(expr, sympy.Float):
        return str(sympy.Rational(str(expr))) if expr.is_finite else str(expr)
    if isinstance(expr, sympy.Expr) and expr.is_number:
        value = expr.evalf(VOTE_KEY_DIGITS + 3)
        if isinstance(value, sympy.Float) and value.is_finite:
            return format(float(value), f".{VOTE_KEY_DIGITS}g")
    return str(expr)


@lru_cache(maxsize=4096)
def _parsed(text: str) -> tuple[Any, ...]:
    """math-verify's parse of an answer (boxed so that the whole string is the target), without signals."""
    from math_verify import parse  # lazy: GRADER_MODULES load on first grading

    boxed = text if "\\boxed" in text else f"\\boxed{{{text}}}"
    result = parse(boxed, parsing_timeout=None) or parse(text, parsing_timeout=None)
    return tuple(result)


def _matches(answer: str, ground_truth: str) -> bool:
    answer = _cleaned(answer)
    gold, predicted = _parsed(ground_truth), _parsed(answer)
    if not gold or not predicted:
        return _squashed(answer) == _squashed(ground_truth)
    if any(_is_too_large(p) for p in predicted):
        return False
    from math_verify import verify  # lazy: GRADER_MODULES load on first grading

    return verify(list(gold), list(predicted), timeout_seconds=None)


def _is_too_large(expr: Any) -> bool:
    """True when a numeric power or factorial in `expr` has more than MAX_RESULT_DIGITS digits.

    Checks inner nodes first and stops at the first huge one, so every value evaluated here is of bounded size.
    """
    import sympy  # lazy: GRADER_MODULES load on first grading

    if not isinstance(expr, sympy.Basic):
        return False
    for node in sympy.postorder_traversal(expr):
        if node.free_symbols:
            continue
        if isinstance(node, sympy.Pow):
            base_digits, exponent_digits = _log10_abs(node.base), _log10_abs(node.exp)
            if base_digits is None or exponent_digits is None or base_digits in (0.0, -math.inf):
                continue
            # log10(digits of base**exponent) = log10(|exponent|) + log10(|log10 |base||)
            if exponent_digits + math.log10(abs(base_digits)) > math.log10(MAX_RESULT_DIGITS):
                return True
        elif isinstance(node, sympy.factorial):
            argument_digits = _log10_abs(node.args[0])
            if argument_digits is not None and argument_digits > math.log10(MAX_RESULT_DIGITS / 5):
                return True
    return False


def _log10_abs(expr: sympy.Basic) -> float | None:
    """log10 |expr| (-inf for zero), or None when `expr` does not evaluate to a finite real number."""
    import mpmath  # lazy: GRADER_MODULES load on first grading
    import sympy  # lazy: GRADER_MODULES load on first grading

    try:
        value = expr.evalf(15)
        if not isinstance(value, sympy.Float) or not value.is_finite:
            return None
        if value == 0:
            return -math.inf
        return float(mpmath.log10(mpmath.mpf(abs(value))))
    except (TypeError, ValueError, ArithmeticError):
        return None
