"""The policy server under hostile input and faults, over a real socket: one bad request never fails another.

A bad sampling field, an abandoned connection, a slow or huge prompt, a request's own chat template, deeply
nested JSON, a missing API key: each is answered (or cancelled) alone, and the other requests, `/health`
included, go on.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from nemo_rl_ext.models.generation.hf_backend import HfGeneration
from nemo_rl_ext.serving.policy_server import (
    DEFAULT_MAX_TOKENS,
    PolicyServer,
    build_parser,
    generation_defaults,
)

MAX_MODEL_LEN = 4096
"""The context length of this module's engine (the `backend` fixture, tests/unit/serving/conftest.py)."""
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
CHAT = "/v1/chat/completions"
API_KEY_ENV = "NEMO_RL_EXT_API_KEY"


@pytest.fixture(scope="module")
def server(backend, tiny_model_and_tokenizer) -> Iterator[PolicyServer]:
    _, tokenizer = tiny_model_and_tokenizer
    with PolicyServer(backend, tokenizer) as srv:
        yield srv


@pytest.fixture
def serve(backend, tiny_model_and_tokenizer):
    """Start a policy server over the tiny model (or another `tokenizer`); stopped at teardown."""
    _, tokenizer = tiny_model_and_tokenizer
    started: list[PolicyServer] = []

    def start(tokenizer: Any = tokenizer, **kwargs: Any) -> PolicyServer:
        started.append(PolicyServer(backend, tokenizer, **kwargs).start())
        return started[-1]

    yield start
    for srv in started:
        srv.stop()


def post(server: PolicyServer, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST `body` as JSON; NaN and Infinity are written as Python's json writes them (JavaScript style)."""
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=json.dumps(body), headers=headers, timeout=60)


def error_of(answer: httpx.Response, status: int) -> dict[str, Any]:
    assert answer.status_code == status, answer.text[:500]
    return answer.json()["error"]


# ---- 1. bad sampling fields: a 400 for that request, the others batched with it finish ------------------


async def test_a_bad_seed_fails_only_its_own_request(serve) -> None:
    server = serve()
    bodies = [{"messages": QUESTION, "max_tokens": 4, "temperature": 1.0, "seed": i} for i in range(19)]
    bodies.insert(7, {"messages": QUESTION, "max_tokens": 4, "temperature": 1.0, "seed": 2**70})
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        answers = await asyncio.gather(*(http.post(CHAT, json=b) for b in bodies))
    bad = answers.pop(7)
    assert [a.status_code for a in answers] == [200] * 19, [a.text[:200] for a in answers]
    error = error_of(bad, 400)
    assert error["param"] == "seed" and str(2**70) in error["message"], error


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"seed": 2**63 - 2, "n": 3}, "seed"),
        ({"temperature": 1e-40}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": 2**40}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 1000}, "n"),
        ({"stop": ["x"] * 100}, "stop"),
        ({"stop": "y" * 1000}, "stop"),
        ({"stop_token_ids": [5, 2**40]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(5000))}, "stop_token_ids"),
        ({"top_logprobs": 50}, "top_logprobs"),
        ({"logprobs": "maybe"}, "logprobs"),
    ],
)
def test_every_sampling_field_is_bounded_at_the_api(server, change, field) -> None:
    error = error_of(post(server, CHAT, {"messages": QUESTION, "max_tokens": 2, **change}), 400)
    assert error["param"] == field and field in error["message"], error


# ---- 2. a client that goes away has its generation cancelled --------------------------------------------


def raw_request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_abandoned_requests_leave_the_batch_and_the_next_request_is_quick(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    backend = HfGeneration(model, tokenizer, max_model_len=4096)  # its own counters start at 0
    # No EOS: a long request then ends only by its budget or by cancellation, never by sampling EOS while
    # the server is still noticing the disconnect (which takes longer on a loaded machine).
    backend._eos_ids = frozenset({-1})
    with PolicyServer(backend, tokenizer) as server:
        try:
            check_abandoned_requests_are_cancelled(server, backend)
        finally:
            backend.shutdown()


def check_abandoned_requests_are_cancelled(server: PolicyServer, backend: HfGeneration) -> None:
    n, long_tokens = 16, 2000
    passes, requests = backend.num_forward_passes, backend.num_requests
    body = {"messages": QUESTION, "max_tokens": long_tokens, "temperature": 1.0}
    clients = []
    for i in range(n):
        clients.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        clients[-1].sendall(raw_request(CHAT, {**body, "seed": i}))
    # every long request is in the engine (the continuous batcher starts decoding with the first one), and
    # decoding has started: only then do the clients give up
    wait_until(lambda: backend.num_requests >= requests + n, 60, "the long requests to reach the engine")
    wait_until(lambda: backend.num_forward_passes >= passes + 3, 60, "the long requests to start decoding")
    for sock in clients:  # the clients give up
        sock.close()
    start = time.monotonic()
    answer = post(server, CHAT, {"messages": QUESTION, "max_tokens": 4, "temperature": 0})
    latency = time.monotonic() - start
    assert answer.status_code == 200, answer.text
    short_tokens = len(answer.json()["choices"][0]["message"]["generation_token_ids"])
    steps = backend.num_forward_passes - passes
    print(f"short request after {n} abandoned: {latency:.2f} s, {steps} forward passes")
    # Without cancellation the abandoned batch runs its 2000 steps (16 x 2000 tokens) before the short one.
    assert steps < long_tokens // 4
    wait_until(lambda: backend.num_cancelled == n, 30, "every abandoned request to be cancelled")
    abandoned_tokens = backend.num_generated_tokens - short_tokens
    assert abandoned_tokens < n * long_tokens // 4, abandoned_tokens


class SlowStepHfGeneration(HfGeneration):
    """The hf backend with every forward pass slowed by `step_s`: a generation outlasts a deadline whatever
    the machine's speed (seed 3 samples well over 100 tokens before EOS)."""

    step_s = 0.02

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.step_s)
        return super()._forward(*args, **kwargs)


async def test_a_generation_past_its_deadline_is_cancelled_too(tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    slow = SlowStepHfGeneration(model, tokenizer, max_model_len=4096)
    try:
        with PolicyServer(slow, tokenizer, request_timeout_s=0.5) as server:
            answer = post(server, CHAT, {"messages": QUESTION, "max_tokens": 3000, "temperature": 1.0, "seed": 3})
            assert error_of(answer, 504)["message"].startswith("generation did not finish")
            await asyncio.to_thread(wait_until, lambda: slow.num_cancelled == 1, 30, "cancelled")
            assert slow.num_generated_tokens < 3000
    finally:
        slow.shutdown()


# ---- 3. slow and huge requests never hold up the event loop; oversized bodies get a 413 ----------------


class SlowTemplateTokenizer:
    """The real tokenizer, except that rendering a chat template takes `delay_s` (a huge or slow prompt)."""

    def __init__(self, tokenizer: Any, delay_s: float) -> None:
        self._tokenizer, self.delay_s, self.rendering = tokenizer, delay_s, threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.rendering.set()
        time.sleep(self.delay_s)
        return self._tokenizer.apply_chat_template(*args, **kwargs)


async def test_health_answers_while_a_slow_prompt_renders(serve, tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    slow = SlowTemplateTokenizer(tokenizer, delay_s=3.0)
    server = serve(slow)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        completion = asyncio.ensure_future(http.post(CHAT, json={"messages": QUESTION, "max_tokens": 2}))
        tokenize = asyncio.ensure_future(http.post("/tokenize", json={"messages": QUESTION}))
        assert await asyncio.to_thread(slow.rendering.wait, 30)
        start = time.monotonic()
        health = await http.get("/health")
        latency = time.monotonic() - start
        assert health.status_code == 200
        assert latency < 1.0, f"/health took {latency:.2f} s while a prompt rendered"
        assert (await completion).status_code == 200 and (await tokenize).status_code == 200


def test_oversized_bodies_get_413(serve) -> None:
    server = serve(max_request_bytes=10_000)
    small = {"messages": QUESTION, "max_tokens": 2}
    big = {"messages": [{"role": "user", "content": "x" * 20_000}], "max_tokens": 2}
    assert post(server, CHAT, small).status_code == 200
    for path in (CHAT, "/tokenize"):
        error = error_of(post(server, path, big), 413)
        assert "20" in error["message"] and "at most 10000" in error["message"], error
    data = json.dumps(big).encode()

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit holds while the body streams in
        for i in range(0, len(data), 4096):
            yield data[i : i + 4096]

    streamed = httpx.post(server.url + CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in streamed.request.headers
    assert "at most 10000" in error_of(streamed, 413)["message"]


def test_default_body_limit_is_a_few_megabytes(serve) -> None:
    server = serve()
    body = {"messages": [{"role": "user", "content": "x" * (20 * 2**20)}], "max_tokens": 2}
    assert "at most 16777216" in error_of(post(server, "/tokenize", body), 413)["message"]


# ---- 4. a request's own chat template is refused unless the server trusts them ---------------------------


def test_request_chat_templates_are_refused_unless_trusted(serve, tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    server = serve()
    for path in (CHAT, "/tokenize"):
        for extra, field in (
            ({"chat_template_kwargs": {"chat_template": template}}, "chat_template_kwargs.chat_template"),
            ({"chat_template": template}, "chat_template"),
        ):
            error = error_of(post(server, path, {"messages": QUESTION, "max_tokens": 2, **extra}), 400)
            assert error["param"] == field and "--trust-request-chat-template" in error["message"], error
    trusting = serve(trust_request_chat_template=True)
    expected = tokenizer("<<What is 2 + 2?>>", add_special_tokens=False)["input_ids"]
    for extra in ({"chat_template_kwargs": {"chat_template": template}}, {"chat_template": template}):
        assert post(trusting, "/tokenize", {"messages": QUESTION, **extra}).json()["tokens"] == expected


# ---- 5. JSON nested too deep is a 400, not a RecursionError --------------------------------------------


def test_deeply_nested_json_is_a_400(serve) -> None:
    server = serve()
    deep = "[" * 100_000 + "]" * 100_000
    answer = httpx.post(
        server.url + CHAT, content='{"messages": ' + deep + "}", headers={"content-type": "application/json"}
    )
    assert "100 levels deep" in error_of(answer, 400)["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}]
    error = error_of(post(server, CHAT, {"messages": messages, "max_tokens": 2}), 400)
    assert error["param"] == "messages.1.tool_calls.0.function.arguments"
    assert "levels deep" in error["message"]
    nested: Any = "x"
    for _ in range(150):  # parses fine, but deeper than the server accepts
        nested = {"k": nested}
    error = error_of(post(server, "/tokenize", {"messages": QUESTION, "chat_template_kwargs": nested}), 400)
    assert error["param"] == "chat_template_kwargs" and "levels deep" in error["message"]
    assert post(server, CHAT, {"messages": QUESTION, "max_tokens": 2}).status_code == 200


# ---- 6. an optional API key -----------------------------------------------------------------------------


def test_api_key_is_required_when_set_and_health_stays_open(serve) -> None:
    server = serve(api_key="s3cret")
    assert server.host == "127.0.0.1"
    assert httpx.get(server.url + "/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        for method, path in (("POST", CHAT), ("POST", "/tokenize"), ("GET", "/v1/models")):
            answer = httpx.request(
                method, server.url + path, json={"messages": QUESTION}, headers=headers, timeout=60
            )
            error = error_of(answer, 401)
            assert error["type"] == "AuthenticationError" and "API key" in error["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=server.base_url, api_key="s3cret", max_retries=0, timeout=60)
    assert client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=2).choices


def test_the_cli_reads_the_key_from_the_environment_in_process_servers_do_not(serve, monkeypatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert build_parser().parse_args(["--model", "tiny"]).api_key == "from-env"
    assert build_parser().parse_args(["--model", "tiny", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv(API_KEY_ENV)
    assert build_parser().parse_args(["--model", "tiny"]).api_key is None
    # The server that Gym rollouts start in process has no key (Gym sends the placeholder "dummy").
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    server = serve()
    dummy = {"Authorization": "Bearer dummy"}
    assert post(server, CHAT, {"messages": QUESTION, "max_tokens": 2}, headers=dummy).status_code == 200


def test_the_cli_caps_requests_that_set_no_max_tokens(serve) -> None:
    """`--max-tokens` (default 256, like vLLM's `--override-generation-config max_tokens`) is what a request
    without max_tokens may generate; without a cap one request generates until the context is full."""
    assert build_parser().parse_args(["--model", "tiny"]).max_tokens == DEFAULT_MAX_TOKENS == 256
    assert generation_defaults(0) is None  # --max-tokens 0: up to the context length, vLLM's own default
    for bad in ("-1", "lots"):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(["--model", "tiny", "--max-tokens", bad])
        assert exited.value.code == 2
    args = build_parser().parse_args(["--model", "tiny", "--max-tokens", "3"])
    server = serve(default_config=generation_defaults(args.max_tokens))
    uncapped = post(server, CHAT, {"messages": QUESTION, "temperature": 0}).json()
    assert (uncapped["usage"]["completion_tokens"], uncapped["choices"][0]["finish_reason"]) == (3, "length")
    own = post(server, CHAT, {"messages": QUESTION, "temperature": 0, "max_tokens": 6}).json()
    assert (own["usage"]["completion_tokens"], own["choices"][0]["finish_reason"]) == (6, "length")
