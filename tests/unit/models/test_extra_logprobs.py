"""Top logprobs and prompt logprobs from the transformers backend, against separate fp32 forward passes."""

from __future__ import annotations

import asyncio

import torch
from backend_checks import chat_prompts
from tolerances import ENGINE_LOGPROBS, SAME_MODEL_LOGPROBS, approx

from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.models.generation.hf_backend import HfGeneration


def _reference_tops(model, context: list[int], output: tuple[int, ...], temperature: float, k: int):
    """Per generated position: (its log_softmax(logits / T) row, the top-k ids) from one fp32 forward pass."""
    ids = torch.tensor([[*context, *output]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs, logprobs.topk(k, dim=-1).indices


async def test_top_logprobs_are_the_top_of_a_forward_pass_and_change_no_sampled_token(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    prompts = chat_prompts(tokenizer, 3)
    asks = [
        GenerationConfig(max_new_tokens=8, temperature=0.0, top_logprobs=5),
        GenerationConfig(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=3, top_logprobs=5),
    ]
    plain = GenerationConfig(max_new_tokens=8, temperature=1.0, seed=4)
    gen = HfGeneration(model, tokenizer, max_model_len=256)
    try:
        # all three in one batch: the rows that ask and one that does not
        outs = await asyncio.gather(*(gen.generate_async(p, c) for p, c in zip(prompts, [*asks, plain], strict=True)))
        # the same batch again, nobody asking: the same shapes, so the same kernels
        no_tops = [*(c.model_copy(update={"top_logprobs": 0}) for c in asks), plain]
        alone = await asyncio.gather(*(gen.generate_async(p, c) for p, c in zip(prompts, no_tops, strict=True)))
    finally:
        gen.shutdown()
    assert outs[2].top_logprobs is None
    for prompt, config, out, without in zip(prompts[:2], asks, outs[:2], alone[:2], strict=True):
        # asking for alternatives changes neither the tokens nor their logprobs (same kernels: bit-exact)
        assert (out.output_ids, out.logprobs) == (without.output_ids, without.logprobs)
        assert without.top_logprobs is None
        assert len(out.top_logprobs) == len(out.output_ids)
        reference, top_ids = _reference_tops(model, prompt, out.output_ids, config.temperature, 5)
        for pos, (tops, token, logprob) in enumerate(zip(out.top_logprobs, out.output_ids, out.logprobs,
                                                         strict=True)):
            ids = [i for i, _ in tops]
            values = [v for _, v in tops]
            assert len(tops) == 5 and values == sorted(values, reverse=True)
            assert set(ids) == set(top_ids[pos].tolist())  # the tiny model's top-5 have distinct values
            assert values == approx(reference[pos, ids].tolist(), ENGINE_LOGPROBS)
            if token in ids:  # the chosen token's entry is its logprob (the same row's log_softmax, in a sub-batch)
                assert dict(tops)[token] == approx(logprob, SAME_MODEL_LOGPROBS)
        if config.temperature == 0.0:
            assert [tops[0][0] for tops in out.top_logprobs] == list(out.output_ids)


async def test_prompt_logprobs_are_a_forward_pass_at_temperature_one(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    short, long = chat_prompts(tokenizer, 2)
    long = long + short  # prompts of other lengths share a left-padded prefill
    configs = [
        GenerationConfig(max_new_tokens=2, temperature=0.5, seed=1, prompt_logprobs=3),
        GenerationConfig(max_new_tokens=2, temperature=0.0, prompt_logprobs=0),
    ]
    gen = HfGeneration(model, tokenizer, max_model_len=256)
    try:
        outs = await asyncio.gather(*(gen.generate_async(p, c) for p, c in zip([short, long], configs, strict=True)))
        plain = await gen.generate_async(short, configs[0].model_copy(update={"prompt_logprobs": None}))
    finally:
        gen.shutdown()
    assert plain.prompt_logprobs is None and plain.prompt_top_logprobs is None
    assert plain.output_ids == outs[0].output_ids  # scoring the prompt does not change the sampling
    assert list(plain.logprobs) == approx(list(outs[0].logprobs), ENGINE_LOGPROBS)  # alone: other shapes
    for prompt, out, k in zip([short, long], outs, (3, 0), strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
        reference = torch.log_softmax(logits, dim=-1)  # temperature 1, whatever the request's
        expected = reference.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
        assert len(out.prompt_logprobs) == len(prompt) - 1
        assert list(out.prompt_logprobs) == approx(expected, ENGINE_LOGPROBS)
        if k == 0:
            assert out.prompt_top_logprobs is None
            continue
        assert len(out.prompt_top_logprobs) == len(prompt) - 1
        for pos, tops in enumerate(out.prompt_top_logprobs):
            assert [i for i, _ in tops] == reference[pos].topk(k).indices.tolist()
            assert [v for _, v in tops] == approx(reference[pos].topk(k).values.tolist(), ENGINE_LOGPROBS)
