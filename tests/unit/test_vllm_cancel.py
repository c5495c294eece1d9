"""Cancelling a vLLM `generate_async` aborts the engine's request; checked on a stand-in engine (no vLLM): the
`stand_in_vllm` fixture of tests/conftest.py, whose requests never end unless a test steps them."""

from __future__ import annotations

import asyncio
import time

import pytest

from nemo_rl_ext.models.generation import GenerationConfig


async def test_a_cancelled_generation_aborts_its_engine_request(stand_in_vllm) -> None:
    engine, gen = stand_in_vllm
    task = asyncio.ensure_future(gen.generate_async([5, 6, 7], GenerationConfig(max_new_tokens=8)))
    deadline = time.monotonic() + 10
    while not engine.requests and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert len(engine.requests) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 10
    while not engine.calls and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.calls == [("abort", engine.requests[0].request_id)]
