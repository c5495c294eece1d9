"""The policy server's Prometheus metrics (`GET /metrics`) and its log of cancelled requests.

Each server has its own `CollectorRegistry` (never prometheus_client's global one), so several servers in one
process keep separate counts. Names start with `nemo_rl_ext_` (vLLM says `vllm:`; Prometheus reserves colons
for recording rules, so exporters use underscores):

| metric | type | what |
| --- | --- | --- |
| `nemo_rl_ext_requests_total{route, status}` | counter | answered HTTP requests (499: the client went away) |
| `nemo_rl_ext_request_errors_total{route, type}` | counter | 4xx / 5xx answers, by OpenAI error type |
| `nemo_rl_ext_requests_cancelled_total{route, reason}` | counter | `client_disconnect` or `timeout` (504) |
| `nemo_rl_ext_prompt_tokens_total` | counter | prompt tokens of answered completions (`usage.prompt_tokens`) |
| `nemo_rl_ext_generation_tokens_total` | counter | generated tokens served (`usage.completion_tokens`) |
| `nemo_rl_ext_time_to_first_token_seconds` | histogram | request received → the engine's first token |
| `nemo_rl_ext_e2e_request_latency_seconds` | histogram | request received → answer ready, per answered completion |
| `nemo_rl_ext_requests_in_progress` | gauge | HTTP requests being handled now |
| `nemo_rl_ext_num_requests_running` / `_waiting` | gauge | the engine's rows decoding / queued (`engine_load`) |
| `nemo_rl_ext_weight_version` | gauge | the weight version the backend serves |

Responses are not streamed, so the first token is measured inside the engine: it is the time until the
`generate_async` call started, plus the backend's `time_to_first_token_s` (the earliest of the request's
choices). Backends that do not measure it (vLLM here, test doubles) leave the histogram unobserved; the
running / waiting gauges are left out for backends whose `engine_load` is None.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from nemo_rl_ext.models.generation.interfaces import GenerationInterface, GenerationOutput

logger = logging.getLogger(__name__)

PREFIX = "nemo_rl_ext_"
"""Prefix of every metric name."""
CONTENT_TYPE = CONTENT_TYPE_LATEST
"""The `/metrics` answer's content type (Prometheus text format)."""
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""Time-to-first-token buckets in seconds (vLLM's)."""
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
"""End-to-end latency buckets in seconds (vLLM's)."""


class ServerMetrics:
    """The metrics of one policy server over `generation`; `render()` is the `/metrics` body."""

    def __init__(self, generation: GenerationInterface) -> None:
        self.registry = CollectorRegistry()
        """This server's registry (the process-wide default one is never touched)."""
        reg = self.registry
        self.requests = Counter(
            PREFIX + "requests", "HTTP requests answered, by route and status code (499: the client went away).",
            ["route", "status"], registry=reg,
        )
        self.errors = Counter(
            PREFIX + "request_errors", "Requests answered with an error (4xx / 5xx), by OpenAI error type.",
            ["route", "type"], registry=reg,
        )
        self.cancelled = Counter(
            PREFIX + "requests_cancelled",
            "Requests whose work was cancelled: the client went away (client_disconnect) or request_timeout_s "
            "passed (timeout).",
            ["route", "reason"], registry=reg,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of answered chat completions.", registry=reg
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens served in answered chat completions (every choice).",
            registry=reg,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Seconds from receiving a chat completion request to the engine's first token (backends that "
            "measure it).",
            buckets=TTFT_BUCKETS, registry=reg,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Seconds from receiving a chat completion request to its answer being ready (answered requests).",
            buckets=LATENCY_BUCKETS, registry=reg,
        )
        self.in_progress = Gauge(
            PREFIX + "requests_in_progress", "HTTP requests being handled now.", registry=reg
        )
        reg.register(_EngineCollector(generation))
        self.cancel_log = CancelLog()
        """Logs cancelled requests (rate-limited)."""

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def answered(self, route: str, status: int, error_type: str | None = None) -> None:
        """Count one answered request (and its error type, for 4xx / 5xx)."""
        self.requests.labels(route, str(status)).inc()
        if error_type is not None:
            self.errors.labels(route, error_type).inc()

    def cancel(self, route: str, reason: str, elapsed_s: float) -> None:
        """Count and log one cancelled request (`reason`: client_disconnect or timeout)."""
        self.cancelled.labels(route, reason).inc()
        self.cancel_log.record(route, reason, elapsed_s)

    def completion(
        self, received_at: float, generate_started_at: float, outputs: list[GenerationOutput], prompt_tokens: int
    ) -> None:
        """Record one answered chat completion: its tokens, latency and (when measured) time to first token."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(sum(len(o.output_ids) for o in outputs))
        firsts = [o.time_to_first_token_s for o in outputs if o.time_to_first_token_s is not None]
        if firsts:
            self.time_to_first_token.observe(generate_started_at - received_at + min(firsts))
        self.e2e_latency.observe(time.monotonic() - received_at)


class _EngineCollector:
    """Gauges read from the backend at scrape time: its load and weight version."""

    def __init__(self, generation: GenerationInterface) -> None:
        self.generation = generation

    def collect(self) -> Iterator[Metric]:
        try:
            load = self.generation.engine_load()
            version = self.generation.weight_version
        except Exception as exc:  # a backend shut down or failing: the HTTP metrics still answer
            logger.warning("reading the backend's load for /metrics failed: %s: %s", type(exc).__name__, exc)
            return
        if load is not None:
            yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests (rows) the engine is decoding now.",
                                    value=load.running)
            yield GaugeMetricFamily(PREFIX + "num_requests_waiting",
                                    "Requests waiting in the engine to join the running batch.", value=load.waiting)
        yield GaugeMetricFamily(PREFIX + "weight_version", "The weight version the backend serves (+1 per update).",
                                value=version)


class CancelLog:
    """One WARNING line per cancelled request, at most `burst` per `window_s`; the rest are summed into one line
    at the end of the window, so a thousand abandoned requests cost a few lines, never silence."""

    def __init__(self, window_s: float = 10.0, burst: int = 10) -> None:
        self.window_s = window_s
        """Length of a rate-limiting window in seconds."""
        self.burst = burst
        """Lines logged one per request in a window; further cancellations wait for the window's summary."""
        self.total = 0
        """Requests cancelled since the server started."""
        self._window_start = -float("inf")
        self._lines = 0
        self._held: Tally[str] = Tally()
        self._flush: asyncio.TimerHandle | None = None

    def record(self, route: str, reason: str, elapsed_s: float) -> None:
        """Log (or hold for the window's summary) one cancellation; call it on the server's event loop."""
        self.total += 1
        now = time.monotonic()
        if now - self._window_start >= self.window_s:
            self._window_start, self._lines = now, 0
        if self._lines < self.burst:
            self._lines += 1
            why = "the client went away" if reason == "client_disconnect" else "request_timeout_s passed"
            logger.warning("%s cancelled after %.2f s (%s); %d cancelled since the server started",
                           route, elapsed_s, why, self.total)
            return
        self._held[reason] += 1
        if self._flush is None:
            delay = max(0.0, self._window_start + self.window_s - now)
            self._flush = asyncio.get_running_loop().call_later(delay, self.flush)

    def flush(self) -> None:
        """Log the held cancellations in one line (called at the end of their window)."""
        self._flush = None
        held, self._held = self._held, Tally()
        if held:
            parts = ", ".join(f"{reason}: {n}" for reason, n in sorted(held.items()))
            logger.warning("%d more requests cancelled in the last %.0f s (%s); %d cancelled since the "
                           "server started", sum(held.values()), self.window_s, parts, self.total)
