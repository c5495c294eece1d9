"""The answer reading shared by the `math` environment, bench/learning.py's strict score and the project's NeMo Gym
grader (`nemo_rl_ext/data/answers.py`): hand-made answers, agreement with the math-verify grade the native bench
uses, and that the module imports nothing outside the standard library (Gym's venv imports it)."""

from __future__ import annotations

import ast
import subprocess
import sys
from fractions import Fraction

import pytest

from nemo_rl_ext.data.answers import answer_number, number_correct, parse_number, strict_correct
from nemo_rl_ext.environments.math_grading import grade_answer

# (the model's answer, the expected answer, lenient: the number read equals it, strict: the whole answer is it)
CASES = [
    ("44", "44", True, True),
    (" 44\n", "44", True, True),
    ("-32", "-32", True, True),
    ("The answer is -32.", "-32", True, False),
    ("-32", "32", False, False),
    ("44.", "44", True, False),
    ("44!", "44", True, False),
    ("**44**", "44", True, False),
    ("Final answer: 44", "44", True, False),
    ("To find 21 + 23, we add them: 21 + 23 = 44", "44", True, False),
    ("21 + 23 = 44. So 44 it is, not 45", "44", False, False),  # the last number is the answer
    ("\\boxed{44} is what 21 + 23 gives, 45 minus 1", "44", True, False),
    ("The answer is 1,234.", "1234", True, False),
    ("44.0", "44", True, False),
    ("4", "44", False, False),
    ("To find 21 + 23, we simply add them together:", "44", False, False),  # a truncated answer: 23 is read
    ("I do not know", "44", False, False),
    ("", "44", False, False),
]


@pytest.mark.parametrize(("text", "expected", "lenient", "strict"), CASES)
def test_lenient_and_strict_readings(text, expected, lenient, strict):
    assert number_correct(text, expected) is lenient
    assert strict_correct(text, expected) is strict


@pytest.mark.parametrize(("text", "expected", "lenient", "strict"), CASES)
def test_the_number_reading_agrees_with_the_math_environments_grade(text, expected, lenient, strict):
    """The Gym grader's reward is the native bench's lenient reading (math-verify on the extracted answer)."""
    assert number_correct(text, expected) is (grade_answer(text, expected).reward == 1.0)


@pytest.mark.parametrize(("text", "value"), [
    ("The answer is -7.", Fraction(-7)), ("x = 12", Fraction(12)), ("3 + 4 = 7", Fraction(7)),
    ("\\boxed{7/2}", Fraction(7, 2)), ("it is 2.50", Fraction(5, 2)), ("no number at all", None), ("", None),
])
def test_answer_number(text, value):
    assert answer_number(text) == value


@pytest.mark.parametrize(("text", "value"), [
    ("-12", Fraction(-12)), ("1,234", Fraction(1234)), ("7/2", Fraction(7, 2)), ("1/0", None), ("12a", None),
    ("- 12", None), ("", None),
])
def test_parse_number_takes_only_a_whole_number(text, value):
    assert parse_number(text) == value


def test_no_number_and_no_response_are_wrong():
    assert not number_correct(None, "44") and not strict_correct(None, "44")
    assert not number_correct("44", "forty-four")  # an expected answer that is no number matches nothing


def test_the_module_imports_only_the_standard_library():
    code = ("import sys; before = set(sys.modules); import nemo_rl_ext.data.answers; "
            "print(sorted(m.split('.')[0] for m in set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    loaded = set(ast.literal_eval(out.stdout))
    assert loaded - set(sys.stdlib_module_names) == {"nemo_rl_ext"}, loaded
