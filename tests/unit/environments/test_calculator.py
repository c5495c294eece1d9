"""The calculator tool: safe arithmetic, its errors, its schema and prompt."""

from __future__ import annotations

import time

import pytest

from nemo_rl_ext.environments.calculator import (
    CALCULATOR_SYSTEM_PROMPT,
    MAX_EXPRESSION_CHARS,
    CalculatorError,
    calculator_tool_schema,
    evaluate_expression,
    format_number,
)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 + 3 * 4", 14),
        ("(2 + 3) * 4", 20),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("2 ** -2", 0.25),
        ("-3 ** 2", -9),
        ("(-3) ** 2", 9),
        ("--5", 5),
        ("+5", 5),
        ("1.5e3 + 0.5", 1500.5),
        ("1_000 * 3", 3000),
        ("  12  ", 12),
        ("(17 * 23) ** 2 / 5", 30576.2),
        ("2 ** 1000 // 2 ** 999", 2),
    ],
)
def test_arithmetic(expression: str, expected: float) -> None:
    result = evaluate_expression(expression)
    assert result == pytest.approx(expected)
    assert type(result) is type(expected)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os')", "function calls are not allowed"),
        ("__import__('os').system('true')", "not allowed"),
        ("x + 1", "names are not allowed: 'x'"),
        ("(1).real", "attribute access is not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 2", "only numbers"),
        ("[1, 2]", "unsupported syntax: List"),
        ("1, 2", "unsupported syntax: Tuple"),
        ("1 if 1 else 2", "unsupported syntax: IfExp"),
        ("lambda: 1", "unsupported syntax: Lambda"),
        ("1 < 2", "unsupported syntax: Compare"),
        ("2 ^ 3", "use ** for powers"),
        ("~1", "not supported"),
        ("1 / 0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("1e308 * 10", "not finite"),
        ("2.0 ** 5000", "too large"),
        ("", "empty expression"),
        ("2 +", "invalid expression"),
        ("1" * 400, "too large"),
        ("2 ** (10 ** 30) ", "too large"),
    ],
)
def test_errors(expression: str, message: str) -> None:
    with pytest.raises(CalculatorError, match=message.replace("(", r"\(").replace("*", r"\*")):
        evaluate_expression(expression)


@pytest.mark.parametrize("expression", ["9**9**9", "10**10**10**10", "(10**300) ** 10**300", "99**99**99"])
def test_huge_powers_fail_fast(expression: str) -> None:
    start = time.perf_counter()
    with pytest.raises(CalculatorError, match="too large"):
        evaluate_expression(expression)
    assert time.perf_counter() - start < 0.5


def test_products_cannot_grow_without_bound() -> None:
    with pytest.raises(CalculatorError, match="too large"):
        evaluate_expression("*".join(["10**300"] * 30))


def test_long_and_deep_inputs_are_refused() -> None:
    with pytest.raises(CalculatorError, match="longer than"):
        evaluate_expression("1+" * MAX_EXPRESSION_CHARS + "1")
    with pytest.raises(CalculatorError):
        evaluate_expression("(" * 240 + "1" + ")" * 240)


def test_non_string_expression_is_an_error() -> None:
    with pytest.raises(CalculatorError, match="must be a string"):
        evaluate_expression(12)  # type: ignore[arg-type]


def test_format_number() -> None:
    assert format_number(14) == "14"
    assert format_number(2.0) == "2"
    assert format_number(3.5) == "3.5"
    assert format_number(0.1 + 0.2) == "0.3"
    assert format_number(2**100) == str(2**100)


def test_schema_is_openai_function_format_and_fresh() -> None:
    schema = calculator_tool_schema()
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "calculator"
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert function["parameters"]["required"] == ["expression"]
    schema["function"]["name"] = "mutated"
    assert calculator_tool_schema()["function"]["name"] == "calculator"


def test_system_prompt_teaches_format_and_boxed_answer() -> None:
    assert "<tool_call>" in CALCULATOR_SYSTEM_PROMPT and "</tool_call>" in CALCULATOR_SYSTEM_PROMPT
    assert '{"name": "calculator", "arguments": {"expression": ' in CALCULATOR_SYSTEM_PROMPT
    assert "\\boxed{}" in CALCULATOR_SYSTEM_PROMPT
