"""Reading the answer of a response: the answer text it gives, and the number that answer is. Standard library only.

The `math` environment extracts answers with `extract_answer` before math-verify compares them; the NeMo Gym
resources server the project ships (`nemo_rl_ext/gym/servers/resources_servers/arithmetic_grader`) runs in
Gym's own venv, which has no math-verify (nor torch), and reads numbers with `answer_number`; bench/learning.py's
strict reading is `strict_correct`. Nothing here imports more than `re` and `fractions`, so Gym's venv can import
this module (`nemo_rl_ext/__init__.py` and `nemo_rl_ext/data/__init__.py` import nothing).
"""

from __future__ import annotations

import re
from fractions import Fraction

_FINAL_ANSWER = re.compile(r"(?:final answer|answer is|answer:)\s*(?:is\s*)?:?\s*(.+)", re.IGNORECASE)
NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:/\d+)?")
"""A number as an answer writes it: `-12`, `1,234`, `3.5`, `7/2`."""
_BOXED_OR_BRACE = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
_SPECIAL_TOKEN = re.compile(r"<\|[^|<>\s]{1,40}\|>")
_QUOTES = ('"', "'", "`")


def extract_answer(text: str) -> str | None:
    """The answer a response gives: the last `\\boxed{}`, else a "final answer: ..." line, else the last number.

    Only the text after the last `</think>` counts, so a reasoning block's scratch numbers are not answers;
    special tokens decoded into the text (`<|im_end|>`) are ignored.
    """
    text = _SPECIAL_TOKEN.sub("", text.rsplit("</think>", 1)[-1])
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    for match in reversed(list(_FINAL_ANSWER.finditer(text))):
        answer = match.group(1).strip().strip("*$ ").rstrip(".").strip("*$ ")
        if answer:
            return answer
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def clean_answer(answer: str) -> str:
    """The answer without surrounding spaces, quotes or `$`, or a trailing period (`"21."` -> `21`)."""
    text = answer.strip().strip("$").strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in _QUOTES:
        text = text[1:-1].strip()
    if text.endswith(".") and not text.endswith(".."):
        text = text[:-1].rstrip()
    return text


def squashed(text: str) -> str:
    """The text without whitespace or `$` (what two spellings of one answer share)."""
    return re.sub(r"\s+|\$", "", text)


def parse_number(text: str) -> Fraction | None:
    """The exact value of `text` when the whole of it is one number (`-12`, `1,234`, `3.50`, `7/2`), else None."""
    text = text.strip()
    if NUMBER.fullmatch(text) is None:
        return None
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):  # 1/0
        return None


def answer_number(response: str) -> Fraction | None:
    """The number a response answers with: its answer (`extract_answer`, cleaned as the `math` environment
    cleans it) when that is a number, else the last number inside that answer (`x = 7`, `3 + 4 = 7`,
    `7 apples`); None when the response gives no number."""
    answer = extract_answer(response)
    if answer is None:
        return None
    answer = clean_answer(answer)
    value = parse_number(answer)
    if value is not None:
        return value
    numbers = NUMBER.findall(answer)
    return parse_number(numbers[-1]) if numbers else None


def number_correct(response: str | None, expected: str) -> bool:
    """True when the number the response answers with (`answer_number`) equals the expected number."""
    if response is None:
        return False
    truth = parse_number(clean_answer(str(expected)))
    return truth is not None and answer_number(response) == truth


def strict_correct(answer_text: str | None, expected: str) -> bool:
    """True when the answer, stripped of surrounding whitespace, is exactly the expected answer."""
    return answer_text is not None and answer_text.strip() == expected.strip()


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, stripped; one pass."""
    opened: list[int | None] = []  # per open brace: where its box's content starts, or None for a plain `{`
    best: tuple[int, int] | None = None
    for match in _BOXED_OR_BRACE.finditer(text):
        token = match.group()
        if token == "}":
            start = opened.pop() if opened else None
            if start is not None and (best is None or start > best[0]):
                best = (start, match.start())
        else:
            opened.append(match.end() if token != "{" else None)
    return None if best is None else text[best[0] : best[1]].strip()
