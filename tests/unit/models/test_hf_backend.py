"""What only the transformers backend has, on the tiny model: batching counters, its own max_model_len and EOS ids,
sampling-parameter validation. The checks every backend passes (logprobs, top-k/top-p, stops, limits, seeds, bad
prompts) are in test_generation_contract.py."""

from __future__ import annotations

import asyncio

import pytest
from backend_checks import chat_prompts
from pydantic import ValidationError

from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.models.generation.hf_backend import HfGeneration

GREEDY = GenerationConfig(max_new_tokens=12, temperature=0.0)


@pytest.fixture
def backend(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    gen = HfGeneration(model, tokenizer, max_model_len=256)
    yield gen
    gen.shutdown()


async def test_concurrent_equals_sequential_with_fewer_forward_passes(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    batch = chat_prompts(tokenizer, 16)
    sequential = HfGeneration(model, tokenizer, max_model_len=256)
    one_by_one = [await sequential.generate_async(p, GREEDY) for p in batch]
    concurrent = HfGeneration(model, tokenizer, max_model_len=256)
    together = await asyncio.gather(*(concurrent.generate_async(p, GREEDY) for p in batch))
    try:
        assert [o.output_ids for o in together] == [o.output_ids for o in one_by_one]
        assert sequential.num_batches == 16
        assert concurrent.num_batches < 16
        assert concurrent.num_forward_passes < sequential.num_forward_passes
        # one prefill plus at most max_new_tokens - 1 decode steps per batch
        assert concurrent.num_forward_passes <= concurrent.num_batches * GREEDY.max_new_tokens
    finally:
        sequential.shutdown()
        concurrent.shutdown()


async def test_max_model_len_cuts_the_request_short(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]
    gen = HfGeneration(model, tokenizer, max_model_len=len(prompt) + 4)
    try:
        out = await gen.generate_async(prompt, GenerationConfig(max_new_tokens=10, temperature=0))
    finally:
        gen.shutdown()
    assert len(prompt) + len(out.output_ids) == len(prompt) + 4
    assert out.finish_reason is FinishReason.MAX_MODEL_LEN
    assert out.truncated


async def test_eos_ends_generation_naturally(backend, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]
    free = await backend.generate_async(prompt, GREEDY)
    backend._eos_ids = frozenset({free.output_ids[2]})  # pretend the model's EOS is what it says 3rd
    out = await backend.generate_async(prompt, GREEDY)
    assert out.output_ids == free.output_ids[: free.output_ids.index(free.output_ids[2]) + 1]
    assert out.finish_reason is FinishReason.EOS and not out.truncated


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("max_new_tokens", 0), ("top_k", 0)],
)
def test_bad_sampling_parameters_name_the_value(field, value):
    with pytest.raises(ValidationError) as err:
        GenerationConfig(**{field: value})
    assert field in str(err.value) and f"input_value={value}" in str(err.value)


def test_every_bad_sampling_parameter_in_one_error():
    with pytest.raises(ValidationError) as err:
        GenerationConfig(temperature=-1, top_p=2, stop_strings=("",))
    assert err.value.error_count() == 3


async def test_shutdown_backend_refuses_requests(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    gen = HfGeneration(model, tokenizer, max_model_len=64)
    gen.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        await gen.generate_async([1, 2, 3], GREEDY)
