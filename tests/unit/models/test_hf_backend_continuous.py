"""The transformers backend's continuous batching, bounds and thread count, measured in counted decode steps.

Every timing here is a count of the engine's decode steps (`num_decode_steps`) taken on the engine thread at
the moment a row finished, so nothing depends on the machine's speed.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from backend_checks import chat_prompts, forward_logprobs, gate_forward
from tolerances import ENGINE_LOGPROBS

from nemo_rl_ext.models.generation import GenerationConfig, GenerationOutput
from nemo_rl_ext.models.generation.hf_backend import HfGeneration

LONG = GenerationConfig(max_new_tokens=120, temperature=1.0, seed=11)
SHORT = GenerationConfig(max_new_tokens=6, temperature=1.0, seed=12)


@pytest.fixture
def make_backend(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    started: list[HfGeneration] = []

    def make(**kwargs) -> HfGeneration:
        gen = HfGeneration(model, tokenizer, max_model_len=512, **kwargs)
        gen._eos_ids = frozenset({-1})  # rows run to their budget: lengths are known in advance
        started.append(gen)
        return gen

    yield make
    for gen in started:
        gen.shutdown()


def record_finish_steps(backend: HfGeneration) -> dict[int, int]:
    """request seed -> the decode step count at which its caller was handed its result (on the engine thread)."""
    steps: dict[int, int] = {}
    hand_over = backend._hand_over

    def recording(request, result):
        steps[request.config.seed] = backend.num_decode_steps
        hand_over(request, result)

    backend._hand_over = recording
    return steps


async def alone(make_backend, prompt, config) -> GenerationOutput:
    return await make_backend().generate_async(prompt, config)


def assert_matches(out: GenerationOutput, reference: GenerationOutput, model, prompt, temperature=1.0) -> None:
    assert out.output_ids == reference.output_ids
    expected = forward_logprobs(model, prompt, out.output_ids, temperature)
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, **ENGINE_LOGPROBS)


async def test_a_short_request_sent_with_a_long_one_resolves_first(make_backend, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    long_prompt, short_prompt = chat_prompts(tokenizer, 2)
    ref_long, ref_short = await alone(make_backend, long_prompt, LONG), await alone(make_backend, short_prompt, SHORT)
    results = {}
    for scheduler in ("continuous", "static"):
        backend = make_backend(scheduler=scheduler)
        steps = record_finish_steps(backend)
        long_out, short_out = await asyncio.gather(
            backend.generate_async(long_prompt, LONG), backend.generate_async(short_prompt, SHORT)
        )
        assert backend.num_prefills == 1  # they were prefilled together
        results[scheduler] = steps
        assert_matches(long_out, ref_long, model, long_prompt)
        assert_matches(short_out, ref_short, model, short_prompt)
    # one prefill token, then one per decode step: the short row's caller has it at step 5 of the long row's 119
    assert results["continuous"] == {SHORT.seed: SHORT.max_new_tokens - 1, LONG.seed: LONG.max_new_tokens - 1}
    # the static scheduler (today's padded batch) hands every result over when the whole batch has ended
    assert results["static"] == {SHORT.seed: LONG.max_new_tokens - 1, LONG.seed: LONG.max_new_tokens - 1}


async def test_a_request_arriving_mid_batch_joins_without_waiting(make_backend, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    long_prompt, *late_prompts = chat_prompts(tokenizer, 4)
    late_configs = [SHORT.model_copy(update={"seed": 20 + i, "max_new_tokens": 5 + 3 * i}) for i in range(3)]
    ref_long = await alone(make_backend, long_prompt, LONG)
    refs = [await alone(make_backend, p, c) for p, c in zip(late_prompts, late_configs, strict=True)]
    for scheduler in ("continuous", "static"):
        backend = make_backend(scheduler=scheduler)
        steps = record_finish_steps(backend)
        join_pass = 10  # the long row is 9 decode steps in when the others arrive
        reached, proceed = gate_forward(backend, join_pass)
        long_task = asyncio.ensure_future(backend.generate_async(long_prompt, LONG))
        assert await asyncio.to_thread(reached.wait, 60)
        late_tasks = [asyncio.ensure_future(backend.generate_async(p, c))
                      for p, c in zip(late_prompts, late_configs, strict=True)]
        await asyncio.sleep(0.05)  # the late requests reach the engine's queue
        assert len(backend._pending) == 3
        proceed.set()
        late_outs = await asyncio.gather(*late_tasks)
        long_out = await long_task
        assert_matches(long_out, ref_long, model, long_prompt)
        for prompt, out, ref in zip(late_prompts, late_outs, refs, strict=True):
            assert_matches(out, ref, model, prompt)
        joined_at = join_pass - 1  # decode steps run when the gated pass ends
        if scheduler == "continuous":
            assert backend.num_prefills == 2 and backend.num_batches == 1
            for config in late_configs:  # prefilled (1st token) right after the gated step, then 1 per step
                assert steps[config.seed] == joined_at + config.max_new_tokens - 1
            assert steps[LONG.seed] == LONG.max_new_tokens - 1
        else:  # static: they wait for the long row's batch to end, then run as a batch of their own
            assert backend.num_batches == 2
            for config in late_configs:
                assert steps[config.seed] >= LONG.max_new_tokens - 1


async def test_a_cancelled_row_frees_its_place_for_a_waiting_request(make_backend, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    long_prompt, short_prompt = chat_prompts(tokenizer, 2)
    backend = make_backend(max_batch_size=1)
    steps = record_finish_steps(backend)
    reached, proceed = gate_forward(backend, 5)
    long_task = asyncio.ensure_future(backend.generate_async(long_prompt, LONG))
    assert await asyncio.to_thread(reached.wait, 60)
    short_task = asyncio.ensure_future(backend.generate_async(short_prompt, SHORT))
    await asyncio.sleep(0.05)
    assert len(backend._pending) == 1  # the only row is taken: it waits
    long_task.cancel()
    await asyncio.gather(long_task, return_exceptions=True)
    proceed.set()
    out = await asyncio.wait_for(short_task, 60)
    assert long_task.cancelled() and len(out.output_ids) == SHORT.max_new_tokens
    assert backend.num_cancelled == 1
    # the cancelled row made the token of the gated step (4th decode step), left, and the waiting request
    # took its place at the next step: 5 tokens of the long row, 6 of the short one
    assert backend.num_generated_tokens == 5 + SHORT.max_new_tokens
    assert steps[SHORT.seed] == 4 + SHORT.max_new_tokens - 1  # its prefill rides with decode step 5


async def test_rows_and_prefill_tokens_per_step_are_bounded(make_backend, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    prompts = chat_prompts(tokenizer, 6)
    widest = max(len(p) for p in prompts)
    backend = make_backend(max_batch_size=4, max_prefill_tokens=2 * widest)
    shapes: list[tuple[int, int]] = []
    forward = backend._forward

    def recording(input_ids, *args):
        shapes.append(tuple(input_ids.shape))
        return forward(input_ids, *args)

    backend._forward = recording
    outs = await asyncio.gather(*(backend.generate_async(p, SHORT.model_copy(update={"seed": i}))
                                  for i, p in enumerate(prompts)))
    assert all(len(o.output_ids) == SHORT.max_new_tokens for o in outs)
    prefills = [s for s in shapes if s[1] > 1]
    assert max(rows for rows, _ in shapes) <= 4
    assert all(rows * width <= 2 * widest for rows, width in prefills), prefills
    assert sum(rows for rows, _ in prefills) == 6 and len(prefills) >= 3


@pytest.mark.parametrize(("num_threads", "expected"), [(None, None), (1, 1), (2, 2)])
async def test_the_engine_thread_runs_num_threads_torch_threads(make_backend, tiny_model_and_tokenizer,
                                                                num_threads, expected):
    _, tokenizer = tiny_model_and_tokenizer
    kwargs = {} if num_threads is None else {"num_threads": num_threads}
    backend = make_backend(**kwargs)
    seen: list[int] = []
    forward = backend._forward

    def recording(*args):
        seen.append(torch.get_num_threads())
        return forward(*args)

    backend._forward = recording
    await backend.generate_async(chat_prompts(tokenizer, 1)[0], SHORT)
    assert set(seen) == {expected or 1}  # the default is one thread


def test_bad_engine_settings_are_reported_together(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    with pytest.raises(ValueError) as err:
        HfGeneration(model, tokenizer, scheduler="fifo", max_batch_size=0, max_prefill_tokens=-1, num_threads=0)
    message = str(err.value)
    for part in ("scheduler", "'fifo'", "max_batch_size", "max_prefill_tokens", "num_threads"):
        assert part in message, message


def test_policy_config_sets_the_engine(tiny_model_dir) -> None:
    """`policy.hf.*` reaches the engine that `build_generation` makes (and a typo is an error)."""
    from nemo_rl_ext.config import ConfigError, load_config
    from nemo_rl_ext.models.backends import build_generation
    from nemo_rl_ext.models.config import PolicyConfig

    cfg = load_config(
        None,
        [f"model_name={tiny_model_dir}", "hf.scheduler=static", "hf.num_threads=2", "hf.max_prefill_tokens=64"],
        PolicyConfig,
    )
    gen = build_generation(cfg)
    try:
        assert (gen.scheduler, gen.num_threads, gen.max_prefill_tokens) == ("static", 2, 64)
    finally:
        gen.shutdown()
    default = build_generation(load_config(None, [f"model_name={tiny_model_dir}"], PolicyConfig))
    try:
        assert (default.scheduler, default.num_threads) == ("continuous", 1)
    finally:
        default.shutdown()
    with pytest.raises(ConfigError, match="hf.scheduler"):
        load_config(None, ["hf.scheduler=dynamic"], PolicyConfig)
