"""Cancelling a vLLM `generate_async` aborts the engine's request; checked on a stand-in engine (no vLLM)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration


class StuckEngine:
    """Stands in for vLLM's AsyncLLM: `generate` never yields; `abort` records the request ids."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.request_ids: list[str] = []
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id):
        self.request_ids.append(request_id)
        self.started.set()
        await asyncio.Event().wait()
        yield None  # never reached: makes this an async generator, as AsyncLLM.generate is

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.fixture
def engine_and_backend():
    """A VllmGeneration wired to a StuckEngine on its own engine loop thread (what __init__ would start)."""
    engine = StuckEngine()
    gen = VllmGeneration.__new__(VllmGeneration)
    gen._closed, gen._engine = False, engine
    gen._max_model_len, gen._vocab_size, gen._eos_ids = 64, 100, frozenset({2})
    gen._SamplingParams, gen._TokensPrompt, gen._final_only = dict, dict, None
    gen._weight_version, gen._in_flight, gen._aborting = 0, {}, False
    gen._loop = asyncio.new_event_loop()
    gen._thread = threading.Thread(target=gen._loop.run_forever, name="fake-engine-loop", daemon=True)
    gen._thread.start()
    yield engine, gen
    gen._closed = True
    gen._stop_loop()


async def test_a_cancelled_generation_aborts_its_engine_request(engine_and_backend) -> None:
    engine, gen = engine_and_backend
    task = asyncio.ensure_future(gen.generate_async([5, 6, 7], GenerationConfig(max_new_tokens=8)))
    assert await asyncio.to_thread(engine.started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 10
    while not engine.aborted and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.aborted == engine.request_ids and len(engine.aborted) == 1
