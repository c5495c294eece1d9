"""Parsing Qwen/Hermes `<tool_call>` blocks out of model text."""

from __future__ import annotations

import dataclasses

import pytest

from nemo_rl_ext.data.tool_calls import (
    MAX_TOOL_CALL_CHARS,
    MAX_TOOL_CALL_DEPTH,
    ToolCall,
    parse_tool_calls,
)


def test_single_call_is_parsed_and_removed_from_content() -> None:
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    content, calls, errors = parse_tool_calls(text)
    assert content == "Let me compute."
    assert errors == []
    assert calls == [
        ToolCall(
            name="calculator",
            arguments={"expression": "2+3"},
            raw='<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>',
        )
    ]


def test_several_calls_keep_text_order_and_surrounding_content() -> None:
    text = (
        'A <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> B\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call> C'
    )
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.calls] == ["a", "b"]
    assert parsed.calls[0].arguments == {"x": 1}
    assert parsed.content == "A  B\n C"
    assert parsed.errors == []


def test_string_arguments_are_decoded() -> None:
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"7*6\\"}"}</tool_call>'
    _, calls, errors = parse_tool_calls(text)
    assert errors == []
    assert calls[0].arguments == {"expression": "7*6"}


def test_missing_arguments_mean_no_arguments() -> None:
    _, calls, _ = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert calls[0].arguments == {}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "invalid JSON"),
        ('["calculator"]', "expected a JSON object"),
        ('{"arguments": {}}', "'name'"),
        ('{"name": "calculator", "arguments": [1, 2]}', "must be an object"),
        ('{"name": "calculator", "arguments": "{not json"}', "not valid JSON"),
        ("   ", "empty tool call"),
    ],
)
def test_malformed_call_is_an_error_entry_and_stays_in_content(body: str, message: str) -> None:
    text = f"before <tool_call>{body}</tool_call> after"
    content, calls, errors = parse_tool_calls(text)
    assert calls == []
    assert len(errors) == 1 and message in errors[0] and errors[0].startswith("tool call 1")
    assert content == text


def test_a_malformed_call_does_not_hide_a_good_one() -> None:
    text = '<tool_call>{oops}</tool_call>\n<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    content, calls, errors = parse_tool_calls(text)
    assert [c.name for c in calls] == ["calculator"]
    assert len(errors) == 1 and errors[0].startswith("tool call 1:")
    assert content == "<tool_call>{oops}</tool_call>"


def test_unclosed_trailing_call_is_parsed() -> None:
    # what a generation stopped at the stop string "</tool_call>" looks like when the engine drops it
    content, calls, errors = parse_tool_calls(
        'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n'
    )
    assert content == "ok" and errors == []
    assert calls[0].arguments == {"expression": "1"}


def test_unclosed_trailing_garbage_is_reported_as_unclosed() -> None:
    _, calls, errors = parse_tool_calls('<tool_call>{"name": "calc')
    assert calls == [] and "unclosed" in errors[0]


def test_code_fenced_json_is_accepted() -> None:
    _, calls, errors = parse_tool_calls(
        '<tool_call>\n```json\n{"name": "f", "arguments": {}}\n```\n</tool_call>'
    )
    assert errors == [] and calls[0].name == "f"


def test_text_without_calls_is_unchanged() -> None:
    assert parse_tool_calls("  The answer is \\boxed{4}.\n") == ("The answer is \\boxed{4}.", [], [])


def test_tool_call_is_frozen() -> None:
    call = ToolCall(name="f", arguments={}, raw="")
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.name = "g"  # type: ignore[misc]


# ---- hostile calls: bounded size and depth, an error entry and never an exception ----------------------

HOSTILE_BODIES = {
    "100k-deep arguments": '{"name": "calculator", "arguments": ' + "[" * 100_000 + "}",
    "deep arguments within the size limit": '{"name": "calculator", "arguments": ' + "[" * 10_000 + "}",
    "deep JSON-string arguments": '{"name": "calculator", "arguments": "' + "[" * 10_000 + '"}',
    "deep, balanced": '{"name": "f", "arguments": {"x": ' + "[" * 5_000 + "]" * 5_000 + "}}",
    "oversized": '{"name": "calculator", "arguments": {"expression": "1+1", "pad": "'
    + "x" * (MAX_TOOL_CALL_CHARS + 1) + '"}}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_BODIES))
def test_hostile_calls_are_errors_not_exceptions(name: str) -> None:
    _, calls, errors = parse_tool_calls(f"<tool_call>{HOSTILE_BODIES[name]}</tool_call>")
    assert calls == [] and len(errors) == 1, errors
    assert "nested" in errors[0] or "characters long" in errors[0], errors[0]


def test_limits_are_parameters_with_named_defaults() -> None:
    nested = '{"name": "f", "arguments": {"x": [[[1]]]}}'  # depth 5
    assert parse_tool_calls(f"<tool_call>{nested}</tool_call>", max_depth=5).calls[0].name == "f"
    errors = parse_tool_calls(f"<tool_call>{nested}</tool_call>", max_depth=4).errors
    assert errors and "nested 5 levels deep, more than the 4 allowed" in errors[0]
    errors = parse_tool_calls(f"<tool_call>{nested}</tool_call>", max_chars=20).errors
    assert errors and f"{len(nested)} characters long, more than the 20 allowed" in errors[0]
    # brackets inside strings are not nesting; an ordinary call is far inside both limits
    text = '<tool_call>{"name": "f", "arguments": {"s": "' + "[" * 100 + '"}}</tool_call>'
    assert parse_tool_calls(text).calls[0].arguments == {"s": "[" * 100}
    assert MAX_TOOL_CALL_DEPTH >= 16 and MAX_TOOL_CALL_CHARS >= 4096
