"""The transformers backend under faults: a row that fails alone, and a caller that cancels mid-batch.

A failed or cancelled row leaves the batch; the rows batched with it finish with exactly the tokens they
produce in a batch without it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from backend_checks import chat_prompts, gate_forward
from tolerances import SAME_MODEL_LOGPROBS

from nemo_rl_ext.models.generation import GenerationConfig, GenerationOutput
from nemo_rl_ext.models.generation.hf_backend import HfGeneration

SAMPLED = GenerationConfig(max_new_tokens=12, temperature=1.0)


@pytest.fixture
def make_backend(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    started: list[HfGeneration] = []

    def make() -> HfGeneration:
        started.append(HfGeneration(model, tokenizer, max_model_len=256, batch_wait_s=0.05))
        return started[-1]

    yield make
    for gen in started:
        gen.shutdown()


def assert_same_outputs(got: list[GenerationOutput], expected: list[GenerationOutput]) -> None:
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), **SAME_MODEL_LOGPROBS)


async def test_rows_that_fail_alone_get_the_error_and_the_others_finish(
    make_backend, tiny_model_and_tokenizer
) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    prompts = chat_prompts(tokenizer, 8)
    good = [SAMPLED.model_copy(update={"seed": i}) for i in range(5)]

    # Three ways for one row to fail alone, at three different moments of the batch:
    bad_seed = GenerationConfig.model_construct(**{**SAMPLED.model_dump(), "seed": 2**70})  # its sampler
    overflow = SAMPLED.model_copy(update={"temperature": 1e-40, "seed": 7})  # logits / T overflow: step 1
    broken_stop = SAMPLED.model_copy(update={"seed": 99})  # its stop check raises at its 4th token
    configs = [good[0], bad_seed, good[1], overflow, good[2], broken_stop, good[3], good[4]]
    good_rows = [0, 2, 4, 6, 7]
    alone = make_backend()
    clean = await asyncio.gather(*(alone.generate_async(prompts[i], configs[i]) for i in good_rows))
    backend = make_backend()
    check = backend._check_finished

    def failing_check(row, token):
        if row.request.config.seed == 99 and len(row.output_ids) == 4:
            raise KeyError("injected stop-check failure")
        check(row, token)

    backend._check_finished = failing_check
    results = await asyncio.gather(
        *(backend.generate_async(p, c) for p, c in zip(prompts, configs, strict=True)), return_exceptions=True
    )
    assert backend.num_batches == 1  # all eight were batched together
    failed = {i: results[i] for i in (1, 3, 5)}
    assert all(isinstance(e, RuntimeError) for e in failed.values()), failed
    assert "creating its sampler" in str(failed[1]) and "Overflow" in str(failed[1])
    assert "sampling its next token" in str(failed[3]) and "temperature=1e-40" in str(failed[3])
    assert "stop conditions" in str(failed[5]) and "injected" in str(failed[5])
    assert backend.num_row_failures == 3
    assert_same_outputs([results[i] for i in good_rows], clean)


async def test_a_cancelled_request_leaves_the_batch_at_the_next_decode_step(
    make_backend, tiny_model_and_tokenizer
) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    prompts = chat_prompts(tokenizer, 5)
    short = SAMPLED.model_copy(update={"max_new_tokens": 8, "seed": 1})
    reference = await make_backend().generate_async(prompts[0], short)

    backend = make_backend()
    cancel_at = 4  # the 4th forward pass (3rd decode step) waits until the long rows are cancelled
    reached, proceed = gate_forward(backend, cancel_at)
    long = SAMPLED.model_copy(update={"max_new_tokens": 200, "seed": 2})
    abandoned = [asyncio.ensure_future(backend.generate_async(p, long)) for p in prompts[1:]]
    kept = asyncio.ensure_future(backend.generate_async(prompts[0], short))
    assert await asyncio.to_thread(reached.wait, 30)
    for task in abandoned:
        task.cancel()
    await asyncio.gather(*abandoned, return_exceptions=True)  # the cancellations are delivered
    proceed.set()
    out = await asyncio.wait_for(kept, 30)

    assert all(t.cancelled() for t in abandoned)
    assert backend.num_cancelled == 4 and backend.num_batches == 1
    # the cancelled rows made the token of the pass that was running when they were cancelled, then left
    assert backend.num_generated_tokens == 4 * cancel_at + len(out.output_ids)
    assert backend.num_forward_passes == max(cancel_at, len(out.output_ids))
    assert_same_outputs([out], [reference])


async def test_a_request_cancelled_while_queued_never_runs(make_backend, tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]
    backend = make_backend()
    task = asyncio.ensure_future(backend.generate_async(prompt, SAMPLED))
    await asyncio.sleep(0)  # queued; the worker waits batch_wait_s before it takes the batch
    task.cancel()
    out = await backend.generate_async(prompt, SAMPLED.model_copy(update={"max_new_tokens": 2}))
    assert task.cancelled() and len(out.output_ids) == 2
    assert backend.num_cancelled == 1 and backend.num_generated_tokens == 2
