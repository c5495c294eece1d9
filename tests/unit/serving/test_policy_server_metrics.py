"""The policy server's Prometheus `/metrics`, read over a real socket and parsed with prometheus_client's parser.

Requests, errors, cancellations (abandoned connections and timeouts), tokens served, time-to-first-token and
latency histograms, the engine's running and waiting rows and the weight version; one server's counts never
mix with another's; every cancelled request is logged (rate-limited). On main `/metrics` was a 404.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nemo_rl_ext.models.generation.hf_backend import HfGeneration
from nemo_rl_ext.models.generation.interfaces import (
    EngineLoad,
    GenerationConfig,
    GenerationOutput,
)
from nemo_rl_ext.serving.policy_server import PolicyServer
from nemo_rl_ext.testing.scripted_generation import ScriptedGeneration

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
CHAT = "/v1/chat/completions"
P = "nemo_rl_ext_"


@pytest.fixture
def backend(tiny_model_and_tokenizer) -> Iterator[HfGeneration]:
    model, tokenizer = tiny_model_and_tokenizer
    gen = HfGeneration(model, tokenizer, max_model_len=4096)
    yield gen
    gen.shutdown()


class SlowStepHfGeneration(HfGeneration):
    """The hf backend with every forward pass slowed by `step_s`: a long generation outlasts the test's waits
    whatever the machine's load."""

    step_s = 0.02

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.step_s)
        return super()._forward(*args, **kwargs)


def long_running(tiny_model_and_tokenizer, **kwargs: Any) -> HfGeneration:
    """A slowed hf engine whose generations end only by their budget or by cancellation (EOS never matches)."""
    model, tokenizer = tiny_model_and_tokenizer
    gen = SlowStepHfGeneration(model, tokenizer, max_model_len=4096, **kwargs)
    gen._eos_ids = frozenset({-1})
    return gen


def cancel_lines(caplog) -> list[str]:
    """The messages the policy server logged about cancelled requests."""
    return [r.getMessage() for r in caplog.records if r.name == "nemo_rl_ext.serving.server_metrics"]


def scrape(server: PolicyServer, headers: dict[str, str] | None = None) -> dict[tuple[str, frozenset], float]:
    """`/metrics`, parsed: (sample name, labels) -> value."""
    answer = httpx.get(server.url + "/metrics", headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.headers["content-type"].startswith("text/plain"), answer.headers
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def value(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float | None:
    """The sample `name` with exactly `labels`, or None when the server does not export it."""
    return samples.get((P + name, frozenset(labels.items())))


def post(server: PolicyServer, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kwargs)


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def raw_request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


def test_requests_tokens_and_latencies_are_counted(backend, tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    with PolicyServer(backend, tokenizer) as server:
        before = scrape(server)
        assert value(before, "weight_version") == 0
        assert value(before, "num_requests_running") == 0 and value(before, "num_requests_waiting") == 0
        answers, walls = [], []
        for i, (max_tokens, n) in enumerate([(3, 1), (5, 2), (7, 1), (2, 1)]):
            start = time.monotonic()
            answer = post(server, CHAT, {"messages": QUESTION, "max_tokens": max_tokens, "n": n, "seed": i})
            walls.append(time.monotonic() - start)
            assert answer.status_code == 200, answer.text
            answers.append(answer.json())
        assert post(server, CHAT, {"messages": QUESTION, "temperature": -1}).status_code == 400
        assert post(server, "/tokenize", {"messages": QUESTION}).status_code == 200
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200
        backend.update_weights(model.state_dict())
        after = scrape(server)

    served = sum(len(c["message"]["generation_token_ids"]) for a in answers for c in a["choices"])
    assert served == sum(a["usage"]["completion_tokens"] for a in answers) == 3 + 5 * 2 + 7 + 2
    assert value(after, "generation_tokens_total") == served
    assert value(after, "prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers) > 0
    assert value(after, "requests_total", route=CHAT, status="200") == 4
    assert value(after, "requests_total", route=CHAT, status="400") == 1
    assert value(after, "request_errors_total", route=CHAT, type="BadRequestError") == 1
    assert value(after, "requests_total", route="/tokenize", status="200") == 1
    assert value(after, "requests_total", route="/v1/models", status="200") == 1
    # one observation per answered completion; the refused one has neither
    assert value(after, "time_to_first_token_seconds_count") == 4
    assert value(after, "e2e_request_latency_seconds_count") == 4
    assert value(after, "e2e_request_latency_seconds_bucket", le="+Inf") == 4
    ttft, latency = value(after, "time_to_first_token_seconds_sum"), value(after, "e2e_request_latency_seconds_sum")
    assert 0 < ttft < latency <= sum(walls), (ttft, latency, walls)
    assert value(after, "weight_version") == 1
    assert value(after, "requests_in_progress") == 0
    assert value(after, "requests_cancelled_total", route=CHAT, reason="client_disconnect") is None


def test_thirty_abandoned_requests_are_counted_and_logged(tiny_model_and_tokenizer, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="nemo_rl_ext.serving.server_metrics")
    _, tokenizer = tiny_model_and_tokenizer
    n, rows = 30, 8
    gen = long_running(tiny_model_and_tokenizer, max_batch_size=rows)
    try:
        with PolicyServer(gen, tokenizer) as server:
            cancel_log = server.app.state.metrics.cancel_log
            cancel_log.window_s = 1.0  # 10 lines one by one, then the other 20 in one line a second later
            body = {"messages": QUESTION, "max_tokens": 2000, "temperature": 1.0}
            clients = []
            for i in range(n):
                clients.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
                clients[-1].sendall(raw_request(CHAT, {**body, "seed": i}))

            def loaded() -> bool:
                samples = scrape(server)
                return (value(samples, "num_requests_running"), value(samples, "num_requests_waiting")) == (
                    rows, n - rows)

            wait_until(loaded, 60, f"{rows} rows running and {n - rows} waiting")
            assert value(scrape(server), "requests_in_progress") == n
            for sock in clients:  # the clients give up
                sock.close()
            cancelled = lambda: value(scrape(server), "requests_cancelled_total", route=CHAT,  # noqa: E731
                                      reason="client_disconnect")
            wait_until(lambda: cancelled() == n, 60, "every abandoned request to be counted")
            wait_until(lambda: gen.engine_load() == EngineLoad(0, 0), 30, "the engine to drop every row")
            wait_until(lambda: cancel_lines(caplog)[-1].startswith("20 more"), 10, "the summary line")
            samples = scrape(server)
    finally:
        gen.shutdown()
    assert value(samples, "requests_total", route=CHAT, status="499") == n
    assert value(samples, "requests_total", route=CHAT, status="200") is None
    assert value(samples, "generation_tokens_total") == 0  # nothing was served
    assert value(samples, "e2e_request_latency_seconds_count") == 0
    assert (value(samples, "num_requests_running"), value(samples, "num_requests_waiting")) == (0, 0)
    assert value(samples, "requests_in_progress") == 0
    assert gen.num_cancelled == n
    lines = cancel_lines(caplog)
    print("\n".join(lines[-3:]))
    singles = [line for line in lines if line.startswith(f"{CHAT} cancelled after")]
    assert len(singles) == 10 and all("the client went away" in line for line in singles), lines
    assert singles[-1].endswith("; 10 cancelled since the server started"), singles[-1]
    assert lines[-1] == (
        "20 more requests cancelled in the last 1 s (client_disconnect: 20); 30 cancelled since the "
        "server started"
    ), lines[-1]
    assert len(lines) == 11, lines


def test_a_request_past_its_deadline_is_counted_as_cancelled(tiny_model_and_tokenizer, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="nemo_rl_ext.serving.server_metrics")
    _, tokenizer = tiny_model_and_tokenizer
    slow = long_running(tiny_model_and_tokenizer)
    try:
        with PolicyServer(slow, tokenizer, request_timeout_s=0.5) as server:
            answer = post(server, CHAT, {"messages": QUESTION, "max_tokens": 3000})
            assert answer.status_code == 504, answer.text
            samples = scrape(server)
    finally:
        slow.shutdown()
    assert value(samples, "requests_cancelled_total", route=CHAT, reason="timeout") == 1
    assert value(samples, "requests_total", route=CHAT, status="504") == 1
    assert value(samples, "request_errors_total", route=CHAT, type="TimeoutError") == 1
    assert value(samples, "e2e_request_latency_seconds_count") == 0
    lines = cancel_lines(caplog)
    assert len(lines) == 1 and "(request_timeout_s passed); 1 cancelled since" in lines[0], lines


def test_metrics_needs_no_api_key_like_health(backend, tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    with PolicyServer(backend, tokenizer, api_key="s3cret") as server:
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
        assert post(server, CHAT, {"messages": QUESTION, "max_tokens": 2}).status_code == 401
        ok = post(server, CHAT, {"messages": QUESTION, "max_tokens": 2}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        samples = scrape(server)  # no Authorization header
    assert value(samples, "requests_total", route="/v1/models", status="401") == 1
    assert value(samples, "requests_total", route=CHAT, status="401") == 1
    assert value(samples, "requests_total", route=CHAT, status="200") == 1
    assert value(samples, "request_errors_total", route=CHAT, type="AuthenticationError") == 1


def test_each_server_keeps_its_own_counts(backend, tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    with PolicyServer(backend, tokenizer) as first, PolicyServer(backend, tokenizer) as second:
        for _ in range(3):
            assert post(first, CHAT, {"messages": QUESTION, "max_tokens": 2}).status_code == 200
        one, two = scrape(first), scrape(second)
    assert value(one, "requests_total", route=CHAT, status="200") == 3
    assert value(two, "requests_total", route=CHAT, status="200") is None
    assert value(two, "generation_tokens_total") == 0 and value(two, "e2e_request_latency_seconds_count") == 0
    assert P not in prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()


async def test_the_hf_engine_reports_its_rows_and_its_first_token(tiny_model_and_tokenizer) -> None:
    gen = long_running(tiny_model_and_tokenizer, max_batch_size=2)
    try:
        assert gen.engine_load() == EngineLoad(running=0, waiting=0)
        tasks = [asyncio.ensure_future(gen.generate_async([5, 6, 7], GenerationConfig(max_new_tokens=3000, seed=i)))
                 for i in range(3)]
        await asyncio.to_thread(wait_until, lambda: gen.engine_load() == EngineLoad(2, 1), 30, "2 running, 1 waiting")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(wait_until, lambda: gen.engine_load() == EngineLoad(0, 0), 30, "an idle engine")
        start = time.monotonic()
        out = await gen.generate_async([5, 6, 7], GenerationConfig(max_new_tokens=4, temperature=0))
        elapsed = time.monotonic() - start
    finally:
        gen.shutdown()
    assert out.time_to_first_token_s is not None and 0 < out.time_to_first_token_s <= elapsed
    # a timing, not part of what an output is: equal outputs stay equal
    assert out == GenerationOutput(out.output_ids, out.logprobs, out.finish_reason, out.matched_stop,
                                   out.weight_version, time_to_first_token_s=None)


async def test_backends_that_do_not_measure_leave_those_metrics_out(tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    scripted = ScriptedGeneration(tokenizer, ["4"], eos=True)
    assert scripted.engine_load() is None
    with PolicyServer(scripted, tokenizer) as server:
        assert (await asyncio.to_thread(post, server, CHAT, {"messages": QUESTION})).status_code == 200
        samples = await asyncio.to_thread(scrape, server)
    assert value(samples, "num_requests_running") is None and value(samples, "num_requests_waiting") is None
    assert value(samples, "time_to_first_token_seconds_count") == 0
    assert value(samples, "e2e_request_latency_seconds_count") == 1
    assert value(samples, "weight_version") == 0
    assert value(samples, "generation_tokens_total") == len(tokenizer.encode("4")) + 1  # the reply and EOS
