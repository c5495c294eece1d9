"""The OpenAI-compatible policy server, over a real socket with the official `openai` client.

Real tiny-model completions check ids and logprobs against a forward pass; a scripted backend (defined
here) replies with the real tokenizer ids of chosen text, to get tool calls and EOS endings out of a
random model. `tests/data/gym_vllm_model_requests.jsonl` holds request bodies captured from NeMo Gym's
`vllm_model` server (three requests of a captured NeMo Gym run: a first chat turn, a later one whose assistant message
carries the previous turn's token ids, and a `/tokenize` call with that conversation).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from nemo_rl_ext.models.generation import FinishReason, GenerationConfig, GenerationInterface
from nemo_rl_ext.models.tiny import IM_END, TOOLS_PREAMBLE
from nemo_rl_ext.serving.policy_server import PolicyServer
from nemo_rl_ext.testing import Fault, ScriptedGeneration, forward_logprobs

MAX_MODEL_LEN = 1024
GYM_REQUESTS = Path(__file__).parents[2] / "data" / "gym_vllm_model_requests.jsonl"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in sf?"}]
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"city": "sf", "weather": "cold"}'}
TOOL_CALL_TEXT = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "sf"}}</tool_call>'


# ---- helpers and test doubles ------------------------------------------------------------------------


class ScoredScript(ScriptedGeneration):
    """Replies with the real tokenizer ids of the text given to `reply` (plus EOS if asked), scored by a
    forward pass; a reply without EOS ends as if max_tokens cut it."""

    def __init__(self, model, tokenizer, max_model_len: int = MAX_MODEL_LEN) -> None:
        super().__init__(tokenizer, (), finish_reason=FinishReason.MAX_NEW_TOKENS, max_model_len=max_model_len,
                         logprobs=lambda prompt, ids, config: forward_logprobs(model, prompt, ids, config.temperature).tolist())

    def reply(self, text: str, *, eos: bool = True) -> list[int]:
        """Script the next replies; returns their ids."""
        ids = self.encode(text) + ([self.tokenizer.eos_token_id] if eos else [])
        self.replies = [ids]
        return ids


def failing_generation(error: Exception | None) -> ScriptedGeneration:
    """Raises `error` on every request; with no error, never answers."""
    return ScriptedGeneration(None, [Fault.HANG if error is None else error], max_model_len=MAX_MODEL_LEN)


def client_for(server: PolicyServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def chat_template_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def post(server: PolicyServer, path: str, body: Any) -> httpx.Response:
    url = server.url + path
    if isinstance(body, str | bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url, json=body, timeout=60)


# ---- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(backend, tiny_model_and_tokenizer) -> Iterator[PolicyServer]:
    """The tiny model behind the server; requests without max_tokens get 16 new tokens."""
    _, tokenizer = tiny_model_and_tokenizer
    defaults = GenerationConfig(max_new_tokens=16)
    with PolicyServer(backend, tokenizer, served_model_name="tiny", default_config=defaults) as srv:
        yield srv


@pytest.fixture
def scripted(tiny_model_and_tokenizer) -> Iterator[tuple[ScoredScript, PolicyServer]]:
    model, tokenizer = tiny_model_and_tokenizer
    gen = ScoredScript(model, tokenizer)
    with PolicyServer(gen, tokenizer, served_model_name="scripted") as srv:
        yield gen, srv


@pytest.fixture
def serve(tiny_model_and_tokenizer) -> Iterator[Callable[[GenerationInterface], PolicyServer]]:
    """Start a server for any backend; stopped at teardown."""
    _, tokenizer = tiny_model_and_tokenizer
    started: list[PolicyServer] = []

    def start(generation: GenerationInterface, **kwargs: Any) -> PolicyServer:
        started.append(PolicyServer(generation, tokenizer, **kwargs).start())
        return started[-1]

    yield start
    for srv in started:
        srv.stop()


# ---- the chat template with tools ----------------------------------------------------------------------


def test_tiny_template_lists_tools_in_the_system_block(tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    with_tools = tok.apply_chat_template(
        QUESTION, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True
    )
    system, rest = with_tools.split(IM_END + "\n", 1)
    assert system.startswith("<|im_start|>system\nYou are helpful.\n\n" + TOOLS_PREAMBLE)
    assert "\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in system
    assert rest == "<|im_start|>user\nWeather in sf?<|im_end|>\n<|im_start|>assistant\n"
    no_system = tok.apply_chat_template(QUESTION[1:], tools=[WEATHER_TOOL], tokenize=False)
    assert no_system.startswith("<|im_start|>system\n" + TOOLS_PREAMBLE)
    plain = tok.apply_chat_template(QUESTION, tokenize=False)
    assert (
        plain
        == "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWeather in sf?<|im_end|>\n"
    )


# ---- health, models, tokenize ------------------------------------------------------------------------


def test_health_and_models(server: PolicyServer) -> None:
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1" and server.port > 0
    assert httpx.get(server.url + "/health").status_code == 200
    models = client_for(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_request_messages_are_normalised_for_the_template(server, tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "sf"}'},
    }
    request = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in sf?"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [call]},
        TOOL_RESULT,
    ]
    strict_tool = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}
    expected = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin sf?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call, "function": {**call["function"], "arguments": {"city": "sf"}}}],
        },
        TOOL_RESULT,
    ]
    tokens = post(server, "/tokenize", {"messages": request, "tools": [strict_tool]}).json()["tokens"]
    assert tokens == chat_template_ids(tok, expected, [WEATHER_TOOL])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "sf"}}</tool_call>' in tok.decode(tokens)
    prefill = [*QUESTION, {"role": "assistant", "content": "It is"}]
    body = {"messages": prefill, "add_generation_prompt": False, "continue_final_message": True}
    text = tok.apply_chat_template(prefill, continue_final_message=True, tokenize=False)
    assert (
        text.endswith("It is") and post(server, "/tokenize", body).json()["tokens"] == tok(text)["input_ids"]
    )


def test_tokenize_prompt_form(server: PolicyServer, tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    body = post(server, "/tokenize", {"prompt": "What is 7 + 5?", "return_token_strs": True}).json()
    assert body["tokens"] == tok("What is 7 + 5?")["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])


# ---- real completions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_completion_ids_and_logprobs_match_a_forward_pass(
    server, tiny_model_and_tokenizer, temperature
) -> None:
    model, tok = tiny_model_and_tokenizer
    response = client_for(server).chat.completions.create(
        model="tiny",
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        max_tokens=12,
        temperature=temperature,
        seed=7,
        logprobs=True,
        top_logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    choice = response.choices[0]
    message = choice.message.model_extra
    prompt, generated, logprobs = (
        message["prompt_token_ids"],
        message["generation_token_ids"],
        message["generation_log_probs"],
    )
    assert prompt == chat_template_ids(tok, QUESTION, [WEATHER_TOOL])
    assert 0 < len(generated) == len(logprobs) <= 12
    assert [e.token for e in choice.logprobs.content] == [f"token_id:{t}" for t in generated]
    assert [e.logprob for e in choice.logprobs.content] == logprobs
    assert all(e.top_logprobs == [] and e.bytes == list(e.token.encode()) for e in choice.logprobs.content)
    expected = forward_logprobs(model, prompt, generated, temperature)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=1e-4)
    ended = generated[-1] == tok.eos_token_id
    assert choice.finish_reason == ("stop" if ended else "length")
    assert choice.message.content == tok.decode(
        generated[:-1] if ended else generated, skip_special_tokens=True
    )
    assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == len(generated)
    assert response.usage.total_tokens == len(prompt) + len(generated)
    tokenized = post(
        server, "/tokenize", {"model": "tiny", "messages": QUESTION, "tools": [WEATHER_TOOL]}
    ).json()
    assert tokenized["tokens"] == prompt


def test_logprob_tokens_are_text_without_token_id_flag(server, tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    client = client_for(server)
    response = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, logprobs=True)
    generated = response.choices[0].message.model_extra["generation_token_ids"]
    assert [e.token for e in response.choices[0].logprobs.content] == [tok.decode([t]) for t in generated]
    without = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4)
    assert without.choices[0].logprobs is None
    assert len(without.choices[0].message.model_extra["generation_log_probs"]) > 0  # always on the message


def test_return_token_ids_adds_vllm_fields(server) -> None:
    body = {"messages": QUESTION, "max_tokens": 3, "return_token_ids": True}
    answer = post(server, "/v1/chat/completions", body).json()
    message = answer["choices"][0]["message"]
    assert answer["prompt_token_ids"] == message["prompt_token_ids"]
    assert answer["choices"][0]["token_ids"] == message["generation_token_ids"]


def test_n_choices_and_content_parts(server) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "sf?"}]}
    ]
    response = client_for(server).chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, n=2, seed=1, temperature=1.0
    )
    assert [c.index for c in response.choices] == [0, 1]
    prompts = {tuple(c.message.model_extra["prompt_token_ids"]) for c in response.choices}
    assert len(prompts) == 1
    as_string = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Weather\nsf?"}]}).json()
    assert list(prompts.pop()) == as_string["tokens"]
    total = sum(len(c.message.model_extra["generation_token_ids"]) for c in response.choices)
    assert response.usage.completion_tokens == total


def test_max_tokens_is_clipped_to_the_room_left(server, tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    # An earlier turn's ids make the prompt length exact: prefix + the template's text after it.
    turn = {"role": "assistant", "content": "x", "prompt_token_ids": [], "generation_token_ids": [5]}
    messages = [{"role": "user", "content": "hi"}, turn, {"role": "user", "content": "go on"}]
    tail = len(post(server, "/tokenize", {"messages": messages}).json()["tokens"]) - 1
    filler = (tok("hello world, " * 400)["input_ids"] * 2)[: MAX_MODEL_LEN - 3 - tail - 1]
    turn["prompt_token_ids"] = filler
    body = {"messages": messages, "max_tokens": 500, "temperature": 0}
    answer = post(server, "/v1/chat/completions", body).json()
    message = answer["choices"][0]["message"]
    assert len(message["prompt_token_ids"]) == MAX_MODEL_LEN - 3
    assert len(message["generation_token_ids"]) == 3
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_concurrent_requests_share_batches(server, backend) -> None:
    batches_before = backend.num_batches
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
        bodies = [
            {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "max_tokens": 8}
            for i in range(8)
        ]
        answers = await asyncio.gather(*(http.post("/chat/completions", json=b) for b in bodies))
    assert [a.status_code for a in answers] == [200] * 8
    assert backend.num_batches - batches_before < 8


# ---- tool calls (scripted backend) ---------------------------------------------------------------------


def test_tool_call_is_parsed_with_logprobs_and_ids(scripted, tiny_model_and_tokenizer) -> None:
    model, tok = tiny_model_and_tokenizer
    gen, srv = scripted
    reply_ids = gen.reply(TOOL_CALL_TEXT, eos=True)
    response = client_for(srv).chat.completions.create(
        model="scripted",
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        logprobs=True,
        top_logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > len("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "sf"}
    message = choice.message.model_extra
    assert message["generation_token_ids"] == reply_ids
    assert message["prompt_token_ids"] == gen.prompts[-1] == chat_template_ids(tok, QUESTION, [WEATHER_TOOL])
    assert "get_weather" in tok.decode(gen.prompts[-1])  # the tools reached the prompt
    assert [e.token for e in choice.logprobs.content] == [f"token_id:{t}" for t in reply_ids]
    expected = forward_logprobs(model, message["prompt_token_ids"], reply_ids, 1.0)
    torch.testing.assert_close(torch.tensor(message["generation_log_probs"]), expected, atol=1e-4, rtol=1e-4)


def test_tool_calls_are_text_without_tools_or_with_tool_choice_none(scripted) -> None:
    gen, srv = scripted
    gen.reply(TOOL_CALL_TEXT)
    client = client_for(srv)
    for extra in ({}, {"tools": [WEATHER_TOOL], "tool_choice": "none"}):
        choice = client.chat.completions.create(model="scripted", messages=QUESTION, **extra).choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content == TOOL_CALL_TEXT


def test_sampling_parameters_map_to_the_generation_config(scripted) -> None:
    gen, srv = scripted
    gen.reply("ok")
    client = client_for(srv)
    response = client.chat.completions.create(
        model="scripted",
        messages=QUESTION,
        temperature=0.5,
        top_p=0.9,
        max_completion_tokens=7,
        max_tokens=99,
        seed=11,
        stop=["END"],
        n=2,
        extra_body={"top_k": 20, "stop_token_ids": [3]},
    )
    assert len(response.choices) == 2
    first, second = gen.configs[-2:]
    assert first == GenerationConfig(
        max_new_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=20,
        stop_strings=("END",),
        stop_token_ids=(3,),
        seed=11,
    )
    assert second == first.model_copy(update={"seed": 12})
    client.chat.completions.create(model="scripted", messages=QUESTION, stop="END", extra_body={"top_k": -1})
    config, prompt = gen.configs[-1], gen.prompts[-1]
    assert config.max_new_tokens == MAX_MODEL_LEN - len(prompt)  # no max_tokens: up to max_model_len
    assert config.top_k is None and config.stop_strings == ("END",)
    assert (config.temperature, config.top_p, config.seed) == (1.0, 1.0, None)


# ---- token-exact continuation --------------------------------------------------------------------------


def test_second_turn_starts_with_the_first_turns_ids(server, tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    client = client_for(server)
    first = client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=[WEATHER_TOOL], max_tokens=6
    )
    m1 = first.choices[0].message
    ids1 = m1.model_extra
    assert ids1["generation_token_ids"][-1] != tok.eos_token_id  # cut by max_tokens: the turn is not closed
    assistant = {
        "role": "assistant",
        "content": m1.content,
        "prompt_token_ids": ids1["prompt_token_ids"],
        "generation_token_ids": ids1["generation_token_ids"],
        "generation_log_probs": ids1["generation_log_probs"],
    }
    messages = [*QUESTION, assistant, TOOL_RESULT]
    second = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER_TOOL], max_tokens=4
    )
    prompt2 = second.choices[0].message.model_extra["prompt_token_ids"]
    prefix = ids1["prompt_token_ids"] + ids1["generation_token_ids"]
    assert prompt2[: len(prefix)] == prefix
    after = f"{IM_END}\n<|im_start|>tool\n{TOOL_RESULT['content']}{IM_END}\n<|im_start|>assistant\n"
    assert prompt2[len(prefix) :] == tok(after, add_special_tokens=False)["input_ids"]
    tokenized = post(server, "/tokenize", {"messages": messages, "tools": [WEATHER_TOOL]}).json()
    assert tokenized["tokens"] == prompt2


def test_continuation_after_eos_does_not_close_the_turn_twice(scripted, tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    gen, srv = scripted
    client = client_for(srv)
    gen.reply(TOOL_CALL_TEXT, eos=True)
    first = client.chat.completions.create(model="scripted", messages=QUESTION, tools=[WEATHER_TOOL])
    m1 = first.choices[0].message
    assistant = {
        "role": "assistant",
        "content": m1.content,
        "tool_calls": [c.model_dump() for c in m1.tool_calls],
        **{
            k: m1.model_extra[k] for k in ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
        },
    }
    gen.reply("It is cold.")
    client.chat.completions.create(
        model="scripted", messages=[*QUESTION, assistant, TOOL_RESULT], tools=[WEATHER_TOOL]
    )
    prefix = m1.model_extra["prompt_token_ids"] + m1.model_extra["generation_token_ids"]
    after = f"\n<|im_start|>tool\n{TOOL_RESULT['content']}{IM_END}\n<|im_start|>assistant\n"
    assert gen.prompts[-1] == prefix + tok(after, add_special_tokens=False)["input_ids"]


def test_ids_win_over_text_that_would_tokenize_differently(server, tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    text = "The answer is 42, thank you"
    byte_symbols = "".join(tok.convert_ids_to_tokens(tok(text)["input_ids"]))  # byte-level BPE symbols
    one_byte_each = tok.convert_tokens_to_ids(list(byte_symbols))  # one id per byte, never merged
    assert tok.decode(one_byte_each) == text
    assert (
        tok(tok.decode(one_byte_each), add_special_tokens=False)["input_ids"] != one_byte_each
    )  # no round trip
    old = {"role": "assistant", "content": "old", "prompt_token_ids": [7, 8], "generation_token_ids": [9]}
    prompt = chat_template_ids(tok, QUESTION)
    latest = {
        "role": "assistant",
        "content": "text that disagrees with the ids",
        "prompt_token_ids": prompt,
        "generation_token_ids": one_byte_each,
        "generation_log_probs": [-1.0] * len(one_byte_each),
    }
    messages = [*QUESTION, old, TOOL_RESULT, latest, {"role": "user", "content": "and tomorrow?"}]
    answer = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).json()
    prompt2 = answer["choices"][0]["message"]["prompt_token_ids"]
    assert prompt2[: len(prompt) + len(one_byte_each)] == prompt + one_byte_each
    assert post(server, "/tokenize", {"messages": messages}).json()["tokens"] == prompt2


# ---- captured NeMo Gym traffic -------------------------------------------------------------------------


def test_replay_of_gym_vllm_model_requests(server) -> None:
    records = [json.loads(line) for line in GYM_REQUESTS.read_text().splitlines()]
    answers = [post(server, r["path"], r["body"]) for r in records]
    assert [a.status_code for a in answers] == [200] * len(records), [a.text[:300] for a in answers]
    for record, answer in zip(records, answers, strict=True):
        body = answer.json()
        if record["path"] == "/tokenize":
            continue
        choice = body["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")
        assert message["role"] == "assistant" and isinstance(message["tool_calls"], list)
        generated = [int(e["token"].removeprefix("token_id:")) for e in choice["logprobs"]["content"]]
        assert generated == message["generation_token_ids"]
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == message["generation_log_probs"]
        assert all(isinstance(t, int) for t in message["prompt_token_ids"])
    # The second turn carries a fake earlier turn (prompt [1..5], generation [101, 102, 103]).
    second = answers[1].json()["choices"][0]["message"]["prompt_token_ids"]
    assert second[:8] == [1, 2, 3, 4, 5, 101, 102, 103]
    assert answers[2].json()["tokens"] == second  # /tokenize of the same messages


# ---- refused requests and failures ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"messages": []}, ["messages", "at least 1"]),
        ({"temperature": -1}, ["temperature", "-1"]),
        ({"top_logprobs": 21, "logprobs": True}, ["top_logprobs", "less than or equal to 20", "21"]),
        ({"top_logprobs": 3}, ["top_logprobs=3", "needs logprobs=true"]),
        ({"top_p": 0}, ["top_p", "0"]),
        ({"max_tokens": 0}, ["max_tokens", "0"]),
        ({"n": 0}, ["n", "0"]),
        ({"stream_options": {"include_usage": True}}, ["stream_options", "only allowed with stream=true"]),
        ({"stop": [""]}, ["stop", "empty"]),
        ({"top_k": -5}, ["top_k", "-5"]),
        ({"tool_choice": "required"}, ["tool_choice='required'"]),
        ({"presence_penalty": 0.5}, ["presence_penalty=0.5"]),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, ["maximum context length is 1024"]),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            ["'image_url'", "not supported"],
        ),
        (
            {"messages": [{"role": "assistant", "content": "a", "prompt_token_ids": [1]}]},
            ["generation_token_ids is missing"],
        ),
        (
            {"messages": [{"role": "user", "content": "a"}], "required_prefix_token_ids": [1, 2]},
            ["required_prefix"],
        ),
    ],
)
def test_bad_requests_are_400_naming_field_and_value(server, change, expected) -> None:
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": 2, **change}
    answer = post(server, "/v1/chat/completions", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    for part in expected:
        assert part in error["message"], (part, error["message"])


def test_openai_client_sees_bad_request_errors(server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client_for(server).chat.completions.create(model="tiny", messages=QUESTION, temperature=-1)
    assert info.value.status_code == 400 and "temperature" in str(info.value) and "-1" in str(info.value)


@pytest.mark.parametrize(("body", "expected"), [("{not json", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_malformed_bodies_are_400(server, body, expected) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        answer = post(server, path, body)
        assert answer.status_code == 400 and expected in answer.json()["error"]["message"]
    assert post(server, "/tokenize", {"model": "tiny"}).status_code == 400


def test_backend_failures_become_errors_not_hangs(serve) -> None:
    broken = serve(failing_generation(RuntimeError("engine exploded")))
    answer = post(broken, "/v1/chat/completions", {"messages": QUESTION})
    assert answer.status_code == 500 and "RuntimeError: engine exploded" in answer.json()["error"]["message"]
    refusing = serve(failing_generation(ValueError("prompt_token_ids holds ids outside [0, 1024)")))
    answer = post(refusing, "/v1/chat/completions", {"messages": QUESTION})
    assert answer.status_code == 400 and "outside [0, 1024)" in answer.json()["error"]["message"]
    stuck = serve(failing_generation(None), request_timeout_s=0.2)
    answer = post(stuck, "/v1/chat/completions", {"messages": QUESTION})
    assert answer.status_code == 504 and "request_timeout_s=0.2" in answer.json()["error"]["message"]


def test_server_stops_and_frees_the_port(tiny_model_and_tokenizer) -> None:
    model, tok = tiny_model_and_tokenizer
    srv = PolicyServer(ScoredScript(model, tok), tok).start()
    url = srv.url
    assert httpx.get(url + "/health").status_code == 200
    srv.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)


def test_the_options_are_one_dataclass_taken_whole_or_by_name(tiny_model_and_tokenizer) -> None:
    from nemo_rl_ext.serving.policy_server import PolicyService, ServerOptions, server_options

    model, tok = tiny_model_and_tokenizer
    options = ServerOptions(served_model_name="whole", request_timeout_s=3.0)
    assert server_options(options, served_model_name="named") == ServerOptions("named", request_timeout_s=3.0)
    with pytest.raises(TypeError, match=r"unknown policy-server option\(s\) \['api_kee', 'port_'\]"):
        server_options(api_kee="k", port_=1)
    service = PolicyService(ScoredScript(model, tok), tok, options, trust_request_chat_template=True)
    assert service.models()["data"][0]["id"] == "whole" and service.options.trust_request_chat_template
    with PolicyServer(ScoredScript(model, tok), tok, options, api_key="k") as srv:
        assert srv.served_model_name == "whole"
        assert httpx.get(f"{srv.base_url}/models").status_code == 401
        answer = httpx.get(f"{srv.base_url}/models", headers={"Authorization": "Bearer k"})
        assert answer.json()["data"][0]["id"] == "whole"
