"""Streamed chat completions (`stream: true`) over a real socket, read with the official `openai` client.

A streamed answer, joined the way the client joins chunks (`ChatCompletionStreamState`), equals the
non-streamed answer to the same request: content, tool calls, logprobs, token ids, finish reason. A scripted
policy (real tokenizer ids of chosen text, logprobs from a forward pass of the tiny model) drives a 3-turn
tool-calling loop; the tiny model itself (the hf engine streaming token by token) serves sampled choices.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from nemo_rl_ext.models.generation.hf_backend import HfGeneration
from nemo_rl_ext.serving.policy_server import PolicyServer
from nemo_rl_ext.testing import Fault, ScriptedGeneration, forward_logprobs

MAX_MODEL_LEN = 1024
"""The context length of this module's engine (the `backend` fixture, tests/unit/serving/conftest.py)."""
CHAT = "/v1/chat/completions"
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in sf and ny?"}]
# the scripted policy's three turns: a call after some text, two calls alone, then the answer
TURNS = [
    'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "sf"}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "ny"}}</tool_call>\n'
    '<tool_call>{"name": "get_weather", "arguments": {"city": "la"}}</tool_call>',
    "It is cold in sf, warm in ny and sunny in la.",
]


def client_for(server: PolicyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def joined(chunks: list) -> Any:
    """The completion the official client assembles from `chunks`."""
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def summary(choice: Any) -> dict[str, Any]:
    """What must agree between a streamed and a non-streamed choice (tool-call ids are fresh each time)."""
    message = choice.message
    extra = message.model_extra or {}
    return {
        "content": message.content,
        "tool_calls": [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []],
        "finish_reason": choice.finish_reason,
        "logprobs": None if choice.logprobs is None else [(e.token, e.logprob) for e in choice.logprobs.content],
        **{key: extra.get(key) for key in TOKEN_FIELDS},
    }


@pytest.fixture(scope="module")
def server(backend, tiny_model_and_tokenizer) -> Iterator[PolicyServer]:
    with PolicyServer(backend, tiny_model_and_tokenizer[1], served_model_name="tiny") as srv:
        yield srv


# ---- a tool-calling loop, streamed and not --------------------------------------------------------------


def tool_loop(server: PolicyServer, stream: bool) -> list[tuple[dict[str, Any], list]]:
    """Three turns of the client's tool loop; each turn's (answer summary, chunks or [])."""
    client, messages, turns = client_for(server), list(QUESTION), []
    for turn in range(3):
        kwargs = dict(model="scripted", messages=messages, tools=[WEATHER_TOOL], logprobs=True, seed=turn)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            choice = joined(chunks).choices[0]
        else:
            chunks, choice = [], client.chat.completions.create(**kwargs).choices[0]
        turns.append((summary(choice), chunks))
        message = choice.message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                "arguments": c.function.arguments}}
                 for c in message.tool_calls or []]
        messages.append({"role": "assistant", "content": message.content, "tool_calls": calls,
                         **{key: message.model_extra[key] for key in TOKEN_FIELDS}})
        for call in calls:
            city = json.loads(call["function"]["arguments"])["city"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": f'{{"city": "{city}"}}'})
    return turns


def test_a_streamed_tool_loop_equals_the_non_streamed_one(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    gen = ScriptedGeneration(
        tokenizer, TURNS, eos=True,
        logprobs=lambda prompt, ids, config: forward_logprobs(model, prompt, ids, config.temperature).tolist(),
    )
    with PolicyServer(gen, tokenizer, served_model_name="scripted") as srv:
        plain = tool_loop(srv, stream=False)
        streamed = tool_loop(srv, stream=True)
    assert [s for s, _ in streamed] == [s for s, _ in plain]
    assert gen.prompts[3:] == gen.prompts[:3]  # each turn's prompt ids too
    first, second, third = (s for s, _ in plain)
    assert first["content"] == "Let me check." and [c[1]["city"] for c in first["tool_calls"]] == ["sf"]
    assert second["content"] is None and [c[1]["city"] for c in second["tool_calls"]] == ["ny", "la"]
    assert third["finish_reason"] == "stop" and third["content"] == TURNS[2] and not third["tool_calls"]
    # it streamed: content and calls arrived before the last chunk, which alone carries the token ids
    chunks = streamed[0][1]
    deltas = [c.choices[0].delta for c in chunks if c.choices[0].finish_reason is None]
    assert sum(bool(d.content) for d in deltas) > 3
    assert any(d.tool_calls for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (d.model_extra or {}).get("generation_token_ids") for d in deltas)
    assert len(chunks[-1].choices[0].delta.model_extra["generation_token_ids"]) == len(first["generation_token_ids"])


# ---- sampled choices of the tiny model, usage --------------------------------------------------------


def test_n_streamed_choices_equal_the_non_streamed_ones_and_usage_comes_last(server) -> None:
    client = client_for(server)
    kwargs = dict(model="tiny", messages=QUESTION, max_tokens=12, temperature=1.0, seed=7, n=2, logprobs=True)
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    *choice_chunks, last = chunks
    assert last.choices == [] and last.usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == \
        plain.usage.model_dump(include={"prompt_tokens", "completion_tokens"})
    assert all(c.usage is None and len(c.choices) == 1 for c in choice_chunks)
    assert [c.choices[0].delta.role for c in choice_chunks[:2]] == ["assistant", "assistant"]
    assert [c.choices[0].index for c in choice_chunks[:2]] == [0, 1]
    streamed = joined(choice_chunks)
    assert [summary(c) for c in streamed.choices] == [summary(c) for c in plain.choices]
    assert summary(plain.choices[0]) != summary(plain.choices[1])  # seeds 7 and 8: two different choices
    per_choice = [sum(c.choices[0].index == i for c in choice_chunks) for i in (0, 1)]
    assert min(per_choice) > 3, per_choice  # each choice came in several chunks
    without = list(client.chat.completions.create(stream=True, **{**kwargs, "n": 1}))
    assert all(c.choices and c.usage is None for c in without)  # no usage chunk unless asked


# ---- an abandoned stream frees its batch slot ----------------------------------------------------------


def cancelled_count(server: PolicyServer) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    match = re.search(r'requests_cancelled_total\{reason="client_disconnect",route="/v1/chat/completions"\} (\S+)',
                      text)
    return float(match.group(1)) if match else 0.0


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_stream_abandoned_after_three_chunks_leaves_the_batch(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    backend = HfGeneration(model, tokenizer, max_model_len=4096)  # its own counters start at 0
    backend._eos_ids = frozenset({-1})  # no EOS: the generation ends only by its budget or by cancellation
    long_tokens = 2000
    try:
        with PolicyServer(backend, tokenizer) as server:
            stream = client_for(server).chat.completions.create(
                model="policy", messages=QUESTION, max_tokens=long_tokens, temperature=1.0, seed=1, stream=True
            )
            chunks = [next(stream) for _ in range(3)]
            stream.close()  # the client goes away
            assert chunks[0].choices[0].delta.role == "assistant" and chunks[2].choices[0].finish_reason is None
            wait_until(lambda: backend.num_cancelled == 1, 30, "the abandoned stream to be cancelled")
            wait_until(lambda: backend.engine_load().running == 0, 30, "its row to leave the batch")
            wait_until(lambda: cancelled_count(server) == 1, 30, "the cancellation to be counted")
        assert backend.num_generated_tokens < long_tokens // 4, backend.num_generated_tokens
    finally:
        backend.shutdown()


def requests_count(server: PolicyServer, status: int) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    match = re.search(rf'requests_total\{{route="/v1/chat/completions",status="{status}"\}} (\S+)', text)
    return float(match.group(1)) if match else 0.0


def test_twenty_quick_disconnects_are_twenty_cancelled_499s(tiny_model_and_tokenizer) -> None:
    """A stream the client leaves is counted when it is over: status 499 and one cancellation, also when the
    client left before the first event (the event generator never started). Before: every stream was counted
    200 when the route returned it, and 20 quick disconnects once counted 19 cancellations."""
    model, tokenizer = tiny_model_and_tokenizer
    backend = HfGeneration(model, tokenizer, max_model_len=4096)
    backend._eos_ids = frozenset({-1})  # no EOS: only the budget or a cancellation ends a generation
    body = {"model": "policy", "messages": QUESTION, "max_tokens": 2000, "temperature": 1.0, "stream": True}
    try:
        with PolicyServer(backend, tokenizer) as server, httpx.Client(timeout=30) as http:
            for seed in range(20):
                with http.stream("POST", server.url + "/v1/chat/completions", json={**body, "seed": seed}) as r:
                    assert r.status_code == 200  # left as soon as the headers came
            wait_until(lambda: requests_count(server, 499) == 20, 60, "20 streams counted 499")
            wait_until(lambda: cancelled_count(server) == 20, 30, "20 cancellations counted")
            assert requests_count(server, 200) == 0
            with http.stream("POST", server.url + "/v1/chat/completions",
                             json={**body, "max_tokens": 3, "seed": 99}) as whole:
                lines = [line for line in whole.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            wait_until(lambda: requests_count(server, 200) == 1, 30, "the stream read to its end counted 200")
            assert requests_count(server, 499) == 20 and cancelled_count(server) == 20
    finally:
        backend.shutdown()


# ---- bad stream_options: a 400 naming the field, the requests beside it unaffected ---------------------


BAD_OPTIONS = [
    ("yes", "stream_options"),
    ({"include_usage": True, "chunk_size": 4}, "stream_options.chunk_size"),
    ({"include_usage": "true"}, "stream_options.include_usage"),
]


async def test_malformed_stream_options_are_400_and_other_streams_go_on(server) -> None:
    good = [{"messages": QUESTION, "max_tokens": 8, "seed": i, "temperature": 1.0, "stream": True,
             "stream_options": {"include_usage": True}} for i in range(3)]
    bad = [{"messages": QUESTION, "max_tokens": 8, "stream": True, "stream_options": options}
           for options, _ in BAD_OPTIONS]
    bad.append({"messages": QUESTION, "max_tokens": 8, "stream_options": {"include_usage": True}})  # no stream
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        answers = await asyncio.gather(*(http.post(CHAT, json=b) for b in [*good[:2], *bad, good[2]]))
    refused = answers[2:-1]
    for answer, field in zip(refused, [f for _, f in BAD_OPTIONS] + ["stream_options"], strict=True):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == field and field.split(".")[-1] in error["message"], error
    for answer in (answers[0], answers[1], answers[-1]):
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in answer.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        *chunks, usage = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == 8



# ---- failures after the stream started: an error event, then [DONE] -------------------------------------


def test_a_failed_or_late_generation_ends_its_stream_with_an_error_event(tiny_model_and_tokenizer) -> None:
    gen = ScriptedGeneration(tiny_model_and_tokenizer[1], [RuntimeError("engine died"), Fault.HANG], pick="call")
    with PolicyServer(gen, tiny_model_and_tokenizer[1], request_timeout_s=0.5) as server:
        answers = [httpx.post(server.url + CHAT, json={"messages": QUESTION, "stream": True}, timeout=60)
                   for _ in range(2)]
        for answer, code, words in zip(answers, (500, 504), ("engine died", "request_timeout_s=0.5"), strict=True):
            assert answer.status_code == 200  # the stream had started
            events = [e[len("data: "):] for e in answer.text.split("\n\n") if e]
            assert events[-1] == "[DONE]" and json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
            error = json.loads(events[-2])["error"]
            assert error["code"] == code and words in error["message"], error
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert re.search(r'requests_cancelled_total\{reason="timeout",route="/v1/chat/completions"\} 1\.0', metrics)
