"""Weight updates while generations are in flight: finish / abort, weight versions, and the native loop's
continuation of an aborted turn (its ids and logprobs equal a forward pass under each span's weights)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from backend_checks import chat_prompts, forward_logprobs, gate_forward
from tolerances import ENGINE_LOGPROBS

from nemo_rl_ext.data.datasets import datum_from_messages
from nemo_rl_ext.experience.native_rollouts import AsyncRolloutImpl
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.models.generation.hf_backend import HfGeneration
from nemo_rl_ext.models.loading import load_model_and_tokenizer
from nemo_rl_ext.testing import ScriptedEnvironment

LONG = GenerationConfig(max_new_tokens=40, temperature=1.0, seed=5)


@pytest.fixture
def models(tiny_model_dir):
    """(served model, a copy of its original weights, a perturbed copy): private, so updates are safe."""
    served, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    old, _ = load_model_and_tokenizer(tiny_model_dir)
    new, _ = load_model_and_tokenizer(tiny_model_dir)
    noise = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.5 * p.std())
    return served, tokenizer, old, new


@pytest.fixture
def backend(models):
    served, tokenizer, _, _ = models
    gen = HfGeneration(served, tokenizer, max_model_len=512)
    gen._eos_ids = frozenset({-1})  # rows run to their budget
    yield gen
    gen.shutdown()


async def update_during_pass(backend: HfGeneration, state_dict, in_flight: str, at_pass: int,
                             before_release=None) -> None:
    """Hold forward pass `at_pass`, queue `update_weights(state_dict, in_flight=...)` (from another thread,
    as a trainer does), run `before_release`, then let the engine go on; returns once the update applied."""
    reached, proceed = gate_forward(backend, at_pass)
    assert await asyncio.to_thread(reached.wait, 60)
    updater = asyncio.ensure_future(asyncio.to_thread(backend.update_weights, state_dict, in_flight=in_flight))
    while not backend._updates:
        await asyncio.sleep(0.005)
    if before_release is not None:
        await before_release()
    proceed.set()
    await asyncio.wait_for(updater, 60)


async def test_weight_version_counts_successful_updates(backend, models):
    _, tokenizer, old, new = models
    prompt = chat_prompts(tokenizer, 1)[0]
    assert backend.weight_version == 0
    assert (await backend.generate_async(prompt, LONG)).weight_version == 0
    backend.update_weights(new.state_dict())
    assert backend.weight_version == 1
    with pytest.raises(ValueError, match="state_dict lacks"):
        backend.update_weights({})
    assert backend.weight_version == 1  # a refused update changes nothing
    backend.update_weights(old.state_dict(), in_flight="abort")
    assert backend.weight_version == 2
    out = await backend.generate_async(prompt, LONG)
    assert out.weight_version == 2
    torch.testing.assert_close(torch.tensor(out.logprobs), forward_logprobs(old, prompt, out.output_ids, 1.0),
                               **ENGINE_LOGPROBS)
    with pytest.raises(ValueError, match=r'in_flight must be "finish" or "abort", got \'later\''):
        backend.update_weights(new.state_dict(), in_flight="later")


async def test_finish_lets_rows_in_flight_end_on_the_old_weights(backend, models):
    _, tokenizer, old, new = models
    first, late = chat_prompts(tokenizer, 2)
    running = asyncio.ensure_future(backend.generate_async(first, LONG))
    waiting: list[asyncio.Future] = []

    async def a_request_arrives_during_the_update():
        waiting.append(asyncio.ensure_future(backend.generate_async(late, LONG)))
        await asyncio.sleep(0.05)

    await update_during_pass(backend, new.state_dict(), "finish", 8, a_request_arrives_during_the_update)
    out, late_out = await running, await waiting[0]
    assert out.finish_reason is FinishReason.MAX_NEW_TOKENS and len(out.output_ids) == LONG.max_new_tokens
    assert out.weight_version == 0 and late_out.weight_version == 1
    torch.testing.assert_close(torch.tensor(out.logprobs), forward_logprobs(old, first, out.output_ids, 1.0),
                               **ENGINE_LOGPROBS)
    torch.testing.assert_close(torch.tensor(late_out.logprobs),
                               forward_logprobs(new, late, late_out.output_ids, 1.0), **ENGINE_LOGPROBS)


async def test_abort_stops_rows_in_flight_keeping_their_tokens(backend, models):
    _, tokenizer, old, new = models
    prompts = chat_prompts(tokenizer, 3)
    running = [asyncio.ensure_future(backend.generate_async(p, LONG.model_copy(update={"seed": i})))
               for i, p in enumerate(prompts)]
    await update_during_pass(backend, new.state_dict(), "abort", 8)  # decode step 7 is the last
    outs = await asyncio.gather(*running)
    assert backend.weight_version == 1 and backend.num_aborted == 3
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason is FinishReason.ABORTED and out.finish_reason.openai == "abort"
        assert len(out.output_ids) == 8 and out.weight_version == 0  # prefill + 7 decode steps
        torch.testing.assert_close(torch.tensor(out.logprobs), forward_logprobs(old, prompt, out.output_ids, 1.0),
                                   **ENGINE_LOGPROBS)


def OneTurnEnv() -> ScriptedEnvironment:  # noqa: N802 - named for what it builds
    """Ends every rollout after its first turn."""
    return ScriptedEnvironment(turns=1, reward=1.0)


async def test_an_aborted_turn_continues_on_the_new_weights_into_one_message(backend, models):
    _, tokenizer, old, new = models
    config = GenerationConfig(max_new_tokens=30, temperature=1.0, seed=3)
    impl = AsyncRolloutImpl(tokenizer, {"t": OneTurnEnv()}, 2, 512, backend, 1, generation_config=config)
    datum = datum_from_messages(tokenizer, 0, [{"role": "user", "content": "What is 2 + 2?"}], "t")
    rollout = asyncio.ensure_future(impl.run_rollout(datum))
    await update_during_pass(backend, new.state_dict(), "abort", 10)  # aborted after 10 tokens
    record = await asyncio.wait_for(rollout, 120)
    prompt = [t for m in datum.message_log for t in m.token_ids]
    for completion in record.completions:
        assert completion.error is None and completion.num_turns == 1
        message = completion.message_log[-1]
        assert message.role == "assistant" and len(message.token_ids) == config.max_new_tokens
        assert message.generation_weight_versions == (0,) * 10 + (1,) * 20
        ids, logprobs = list(message.token_ids), torch.tensor(message.generation_logprobs)
        # span 0 under the old weights, span 1 (continued from prompt + span 0) under the new ones
        torch.testing.assert_close(logprobs[:10], forward_logprobs(old, prompt, ids[:10], 1.0), **ENGINE_LOGPROBS)
        torch.testing.assert_close(logprobs[10:], forward_logprobs(new, prompt + ids[:10], ids[10:], 1.0),
                                   **ENGINE_LOGPROBS)
    assert backend.num_aborted == 2
