"""The pieces of a streamed answer, without a server: what is sent early never differs from the final answer.

`ToolCallStream` splits text into content and tool calls as it arrives; `TextStream` decodes ids as they
arrive. Both may hold text back, never send text the non-streamed answer would not have (the last chunk
then sends what is left, cut from that answer).
"""

from __future__ import annotations

import asyncio

import pytest

from nemo_rl_ext.data.tool_calls import parse_tool_calls
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig, TokenDelta
from nemo_rl_ext.serving.chat_stream import ToolCallStream
from nemo_rl_ext.serving.streaming import StreamOptions, TextStream, choice_events
from nemo_rl_ext.testing import ScriptedGeneration

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "sf"}}</tool_call>'
CALL2 = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
TEXTS = [
    "plain text, trailing space  ",
    "  leading space and no call",
    "Let me check.\n" + CALL,
    "  Hi " + CALL + "\n",
    CALL + "\n\nDone.  ",
    "a <tool_call>not json</tool_call> b " + CALL + " c",
    "x " + CALL + '<tool_call>{"name": "get_time", "arguments": {}}',  # an unclosed last call
    CALL + CALL2,
    "less < than and <tool but no call <tool_c",
    "",
]


def final_content(text: str) -> str:
    """The content of the non-streamed answer (`PolicyService._choice`), None as ""."""
    parsed = parse_tool_calls(text)
    return (parsed.content or "") if parsed.calls else text


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("piece", [1, 4, 10_000])
def test_tool_call_stream_never_sends_what_the_final_answer_lacks(text: str, piece: int) -> None:
    stream, sent, calls = ToolCallStream(), "", []
    for start in range(0, len(text), piece):
        content, new_calls = stream.add(text[start : start + piece])
        sent += content
        calls += new_calls
        assert final_content(text).startswith(sent), (text, sent)
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in parsed.calls[: len(calls)]]
    closed = [c for c in parsed.calls if c.raw.endswith("</tool_call>")]
    assert len(calls) == len(closed)  # every closed call was sent before the end


def test_content_and_calls_are_sent_as_soon_as_they_are_known() -> None:
    stream = ToolCallStream()
    head = "Let me check.\n"
    seen = [stream.add(ch) for ch in head + CALL + " Done"]
    assert seen[0] == ("L", [])  # content goes out with its first character
    assert "".join(c for c, _ in seen[: len(head + CALL)]) == "Let me check."  # the newline waits
    assert [i for i, (_, calls) in enumerate(seen) if calls] == [len(head + CALL) - 1]  # with its closing tag
    assert "".join(c for c, _ in seen) == "Let me check.\n Done" == final_content(head + CALL + " Done")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_and_tokenizer):
    return tiny_model_and_tokenizer[1]


def stream_ids(stream: TextStream, ids: list[int]) -> list[str]:
    return [stream.add([i]) for i in ids]


def test_text_stream_decodes_split_characters_whole(tokenizer) -> None:
    text = "héllo wörld ✓ 你好, streaming"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = stream_ids(TextStream(tokenizer, skip_special_tokens=True), ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(bool(p) for p in pieces) > len(text) // 4  # text went out as it came, not at the end


def test_text_stream_holds_back_stop_strings_and_ending_tokens(tokenizer) -> None:
    ids = tokenizer("abc STOP def", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, skip_special_tokens=True, stop_strings=("STOP", "zzzzzz"))
    assert "".join(stream_ids(stream, ids)) == "abc "  # never any of "STOP" or what follows it
    eos = tokenizer.eos_token_id
    ids = tokenizer("ok then", add_special_tokens=False)["input_ids"] + [eos]
    stream = TextStream(tokenizer, skip_special_tokens=False, hold_ids=[eos])
    assert "".join(stream_ids(stream, ids)) == "ok then"  # the EOS that ends it is not part of the text
    stream = TextStream(tokenizer, skip_special_tokens=False, hold_ids=[eos])
    assert "".join(stream_ids(stream, [eos, *ids])) == tokenizer.decode([eos]) + "ok then"  # not last: text


def test_stream_options_refuse_unknown_keys_and_non_bools() -> None:
    assert StreamOptions.model_validate({"include_usage": True}).include_usage
    for bad in ({"include_usage": "yes"}, {"include_usage": 1}, {"continuous_usage_stats": True}):
        with pytest.raises(ValueError):
            StreamOptions.model_validate(bad)


async def test_choice_events_keep_each_choice_in_order_and_end_after_every_output(tokenizer) -> None:
    gen = ScriptedGeneration(tokenizer, ["one two three", "four five"], pick="call", eos=True)
    configs = [GenerationConfig(max_new_tokens=20)] * 2
    events = [e async for e in choice_events(gen, [1, 2, 3], configs, timeout_s=30)]
    for index, expected in enumerate(gen.calls):
        mine = [e for i, e in events if i == index]
        ids = [t for e in mine[:-1] for t in e.output_ids]
        assert all(isinstance(e, TokenDelta) for e in mine[:-1]) and ids == list(expected.output.output_ids)
        assert mine[-1] == expected.output and mine[-1].finish_reason is FinishReason.EOS
    assert {i for i, _ in events[:4]} == {0, 1}  # the choices interleave


async def test_choice_events_raise_past_the_deadline_and_cancel_the_generations(tokenizer) -> None:
    gen = ScriptedGeneration(tokenizer, ["slow"], delay_s=30)
    with pytest.raises(TimeoutError):
        async for _ in choice_events(gen, [1, 2], [GenerationConfig(max_new_tokens=4)], timeout_s=0.05):
            pass
    await asyncio.sleep(0)
    assert [c.output for c in gen.calls] == [None]  # cancelled before it answered
