"""Cancelling a vLLM `generate_async` (or closing a `generate_stream`) aborts the engine's request; checked on a stand-in engine (no vLLM): the
`stand_in_vllm` fixture of tests/conftest.py, whose requests never end unless a test steps them."""

from __future__ import annotations

import asyncio
import time

import pytest

from nemo_rl_ext.models.generation import FinishReason, GenerationConfig, TokenDelta
from nemo_rl_ext.testing.vllm_engine import EOS


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


async def test_a_streamed_generation_sends_each_steps_tokens_and_closing_it_aborts(stand_in_vllm) -> None:
    engine, gen = stand_in_vllm
    config = GenerationConfig(max_new_tokens=8, temperature=0.0)
    stream = gen.generate_stream([5, 6, 7], config)
    first = asyncio.ensure_future(stream.__anext__())
    deadline = time.monotonic() + 10
    while not engine.requests and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.requests[0].stream  # asked for an output per step (RequestOutputKind.CUMULATIVE)
    gen._call(engine.step())
    assert await asyncio.wait_for(first, 10) == TokenDelta((10,), (-0.25,))  # before the request ended
    gen._call(engine.step())
    gen._call(engine.finish_running())
    rest = [event async for event in stream]
    *deltas, output = rest
    assert [t for d in deltas for t in d.output_ids] == [11, EOS]
    assert output.output_ids == (10, 11, EOS) and output.finish_reason is FinishReason.EOS
    assert output.logprobs == (-0.25, -0.5, -0.75) == (-0.25, *(lp for d in deltas for lp in d.logprobs))

    stream = gen.generate_stream([5, 6, 7], config)
    first = asyncio.ensure_future(stream.__anext__())
    while len(engine.requests) < 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    gen._call(engine.step())
    assert (await asyncio.wait_for(first, 10)).output_ids == (10,)
    await stream.aclose()  # the reader leaves mid-generation
    while not engine.calls and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert engine.calls == [("abort", engine.requests[1].request_id)]
