"""The shared test doubles of `nemo_rl_ext.testing` keep the contracts they stand in for.

The scripted policy is token-exact over any tokenizer (the tiny model's and SmolLM2's), says why each
reply ended as a backend would, and follows `update_weights` / `shutdown` as the interface defines them;
the sleep engine's time scales with the tokens asked for, its weight updates finish or abort rows in
flight; the scripted and failing environments answer, end and fail as configured.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments.interfaces import EnvironmentInterface, Observation
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig, GenerationInterface
from nemo_rl_ext.models.smollm2 import smollm2_path
from nemo_rl_ext.testing import (
    FailingEnvironment,
    Fault,
    LongTail,
    ScriptedEnvironment,
    ScriptedGeneration,
    SleepGeneration,
)

CONFIG = GenerationConfig(max_new_tokens=64, seed=0)


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def tok(request, tiny_model_and_tokenizer):
    """The tiny model's tokenizer, or SmolLM2-135M-Instruct's (converted offline once; only the tokenizer loads)."""
    if request.param == "tiny":
        return tiny_model_and_tokenizer[1]
    return AutoTokenizer.from_pretrained(smollm2_path())


def chat(tok, *turns: str) -> list[int]:
    """The prompt ids of a conversation whose assistant said `turns` so far, ready for the next turn."""
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    for t in turns:
        messages += [{"role": "assistant", "content": t}, {"role": "user", "content": "go on"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def run(coro):
    return asyncio.run(coro)


# ---- the scripted policy ----------------------------------------------------------------------------


def test_the_scripted_policy_implements_every_declared_member(tok):
    gen = ScriptedGeneration(tok, ["hi"], max_model_len=321)
    assert isinstance(gen, GenerationInterface)  # an abstract member left out would make this raise instead
    assert gen.tokenizer is tok and gen.max_model_len == 321 and gen.weight_version == 0


def test_replies_are_the_tokenizers_exact_ids_by_turn(tok):
    script = ["I will call <tool>add(2, 3)</tool>", "It is 5.<|im_end|>"]
    gen = ScriptedGeneration(tok, script)
    first = run(gen.generate_async(chat(tok), CONFIG))
    second = run(gen.generate_async(chat(tok, script[0]), CONFIG))
    later = run(gen.generate_async(chat(tok, script[0], script[1]), CONFIG))
    assert list(first.output_ids) == tok(script[0], add_special_tokens=False)["input_ids"]
    assert tok.decode(first.output_ids) == script[0]
    assert first.finish_reason is FinishReason.STOP_STRING and first.matched_stop is None
    assert list(second.output_ids) == tok(script[1], add_special_tokens=False)["input_ids"]
    assert second.output_ids[-1] == tok.eos_token_id  # "<|im_end|>" is EOS for both tokenizers
    assert second.finish_reason is FinishReason.EOS and second.matched_stop == tok.eos_token_id
    assert later.output_ids == second.output_ids  # turns past the script repeat its last reply
    assert first.logprobs == (-0.5,) * len(first.output_ids)
    assert [c.prompt_token_ids for c in gen.calls] == [chat(tok), chat(tok, script[0]), chat(tok, *script)]
    assert [c.output for c in gen.calls] == [first, second, later] and gen.num_calls == 3


def test_replies_by_call_with_eos_and_a_cut_at_max_new_tokens(tok):
    gen = ScriptedGeneration(tok, ["one two three four", "five"], pick="call", eos=True)
    ids = tok("one two three four", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    cut = run(gen.generate_async(chat(tok), CONFIG.model_copy(update={"max_new_tokens": 2})))
    assert list(cut.output_ids) == ids[:2] and cut.finish_reason is FinishReason.MAX_NEW_TOKENS and cut.truncated
    full = run(gen.generate_async(chat(tok), CONFIG))
    assert full.output_ids == (*tok("five", add_special_tokens=False)["input_ids"], tok.eos_token_id)
    with pytest.raises(AssertionError, match="call 2 but only 2 replies"):
        run(gen.generate_async(chat(tok), CONFIG))
    whole = ScriptedGeneration(tok, ["one two three four"], cut_at_max_new_tokens=False)
    out = run(whole.generate_async(chat(tok), CONFIG.model_copy(update={"max_new_tokens": 2})))
    assert tok.decode(out.output_ids) == "one two three four" and not out.truncated


def test_a_reply_function_sees_the_request_and_can_hand_it_to_a_backend(tok):
    backend = ScriptedGeneration(tok, ["from the backend"])
    seen = []

    def reply(request):
        seen.append((request.index, request.turn, request.config.seed, "2 + 3" in request.prompt_text))
        return None if request.config.seed == 1 else [7, 8, 9]

    gen = ScriptedGeneration(tok, reply, backend=backend, logprobs=lambda p, ids, c: [-float(i) for i in ids])
    mine = run(gen.generate_async(chat(tok), CONFIG))
    theirs = run(gen.generate_async(chat(tok, "x"), CONFIG.model_copy(update={"seed": 1})))
    assert mine.output_ids == (7, 8, 9) and mine.logprobs == (-7.0, -8.0, -9.0)
    assert tok.decode(theirs.output_ids) == "from the backend" and backend.num_calls == 1
    assert seen == [(0, 0, 0, True), (1, 1, 1, True)]


def test_scripted_faults_raise_or_hang_and_are_recorded(tok):
    gen = ScriptedGeneration(tok, [RuntimeError("engine exploded")])
    with pytest.raises(RuntimeError, match="engine exploded"):
        run(gen.generate_async(chat(tok), CONFIG))
    hanging = ScriptedGeneration(None, [Fault.HANG])
    with pytest.raises(TimeoutError):
        run(asyncio.wait_for(hanging.generate_async([1, 2], CONFIG), 0.2))
    assert [c.output for c in gen.calls + hanging.calls] == [None, None]
    with pytest.raises(AssertionError, match="must not be called"):
        run(ScriptedGeneration(tok).generate_async(chat(tok), CONFIG))


def test_bad_prompts_are_refused_as_a_backend_refuses_them(tok):
    gen = ScriptedGeneration(tok, ["x"], max_model_len=16)
    for prompt, message in (([], "empty"), ([1] * 16, "max_model_len=16"), ([5, -1], "outside")):
        with pytest.raises(ValueError, match=message):
            run(gen.generate_async(prompt, CONFIG))
    assert gen.calls == []


def test_update_weights_and_shutdown_follow_the_interface(tok):
    gen = ScriptedGeneration(tok, ["a"], expected_weights=["w1", "w2"])
    with pytest.raises(ValueError, match=r"lacks 1: \['w2'\]"):
        gen.update_weights({"w1": 0})
    with pytest.raises(ValueError, match="in_flight"):
        gen.update_weights({"w1": 0, "w2": 0}, in_flight="later")
    assert gen.weight_version == 0 and gen.updates == []
    weights = {"w1": 1, "w2": 2}
    gen.update_weights(weights)
    gen.update_weights(weights, in_flight="abort")
    assert gen.weight_version == 2 and gen.updates == [(weights, "finish"), (weights, "abort")]
    assert run(gen.generate_async(chat(tok), CONFIG)).weight_version == 2
    gen.shutdown()
    gen.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        run(gen.generate_async(chat(tok), CONFIG))
    with pytest.raises(RuntimeError, match="shut down"):
        gen.update_weights(weights)


def test_a_wrapper_forwards_updates_and_shutdown_to_its_backend(tok):
    backend = ScriptedGeneration(tok, ["b"])
    gen = ScriptedGeneration(tok, None, backend=backend)
    gen.update_weights({"w": 0}, in_flight="abort")
    assert backend.updates == [({"w": 0}, "abort")] and gen.weight_version == backend.weight_version == 1
    gen.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        run(backend.generate_async(chat(tok), CONFIG))


# ---- the sleep engine ---------------------------------------------------------------------------------


def test_the_sleep_engines_time_scales_with_the_tokens():
    gen = SleepGeneration(token_s=0.01, max_batch_size=4, tag=77)
    assert isinstance(gen, GenerationInterface) and gen.tokenizer is None

    def timed(n: int) -> tuple[float, object]:
        start = time.perf_counter()
        out = run(gen.generate_async([1, 2, 3], GenerationConfig(max_new_tokens=n, seed=5)))
        return time.perf_counter() - start, out

    short, out5 = timed(5)
    long, out40 = timed(40)
    assert out5.output_ids[0] == out40.output_ids[0] == 77 and len(out40.output_ids) == 40
    assert out5.output_ids == out40.output_ids[:5] and out40.finish_reason is FinishReason.MAX_NEW_TOKENS
    assert short >= 5 * 0.01 and long >= 40 * 0.01 and long > 3 * short


def test_the_sleep_engine_runs_max_batch_size_requests_at_a_time():
    gen = SleepGeneration(token_s=0.01, max_batch_size=2)

    async def four() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(gen.generate_async([i + 1], GenerationConfig(max_new_tokens=10)) for i in range(4)))
        return time.perf_counter() - start

    assert run(four()) >= 2 * 10 * 0.01  # two batches of two, one after the other


@pytest.mark.parametrize("in_flight", ["finish", "abort"])
def test_the_sleep_engines_updates_wait_for_what_is_in_flight_as_a_real_engines_do(in_flight):
    gen = SleepGeneration(token_s=0.01, max_batch_size=2)

    async def go():
        running = asyncio.ensure_future(gen.generate_async([1], GenerationConfig(max_new_tokens=30)))
        waiting = [asyncio.ensure_future(gen.generate_async([i], GenerationConfig(max_new_tokens=n)))
                   for i, n in ((2, 10), (3, 3))]  # the second has no slot yet
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        update = asyncio.ensure_future(asyncio.to_thread(gen.update_weights, {}, in_flight=in_flight))
        await asyncio.sleep(0.02)
        arriving = asyncio.ensure_future(gen.generate_async([4], GenerationConfig(max_new_tokens=3)))
        await update
        took = time.perf_counter() - start
        running_done = running.done()
        return took, running_done, await running, [await w for w in waiting], await arriving

    took, running_done, running, waiting, arriving = run(go())
    assert running_done  # the update returned only once the request in flight was done
    assert gen.weight_version == 1 and running.weight_version == 0
    # [2] held a slot (old version); [3] got [2]'s slot during the update and waited for it; [4] came during it
    assert [w.weight_version for w in waiting] == [0, 1] and arriving.weight_version == 1
    if in_flight == "finish":  # waited for the 30-token request: about 25 more tokens
        assert len(running.output_ids) == 30 and running.finish_reason is FinishReason.MAX_NEW_TOKENS
        assert took >= 0.2, took
    else:  # stopped it at its next token
        assert 0 < len(running.output_ids) < 30 and running.finish_reason is FinishReason.ABORTED
        assert len(running.logprobs) == len(running.output_ids)
        assert took < 0.2, took
    gen.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        run(gen.generate_async([1], GenerationConfig(max_new_tokens=1)))


def test_the_sleep_engine_refuses_an_update_that_would_deadlock_its_own_loop():
    gen = SleepGeneration(token_s=0.01)

    async def go():
        gen.update_weights({})  # nothing in flight: applies at once, on the loop's thread too
        running = asyncio.ensure_future(gen.generate_async([1], GenerationConfig(max_new_tokens=5)))
        await asyncio.sleep(0.02)
        with pytest.raises(RuntimeError, match="1 of its requests are running.*another thread"):
            gen.update_weights({})
        return await running

    assert run(go()).weight_version == 1 and gen.weight_version == 1


def test_the_sleep_engines_lengths_come_from_its_length_option_and_survive_an_abort():
    tail = LongTail(short=2, long=20, fraction=0.25)
    configs = [GenerationConfig(max_new_tokens=32, seed=s) for s in range(200)]
    lengths = [tail([1, 2], c) for c in configs]
    assert set(lengths) == {2, 20} and 0.15 < lengths.count(20) / 200 < 0.35
    assert lengths == [tail([1, 2], c) for c in configs]  # a hash, not a random draw

    gen = SleepGeneration(token_s=0.005, length=lambda ids, config: 40 if ids[0] == 9 else 3,
                          tokenizer=type("Tok", (), {"eos_token_id": 5})())
    short = run(gen.generate_async([1], GenerationConfig(max_new_tokens=10)))
    assert len(short.output_ids) == 3 and short.finish_reason is FinishReason.EOS and short.output_ids[-1] == 5
    capped = run(gen.generate_async([9], GenerationConfig(max_new_tokens=10)))
    assert len(capped.output_ids) == 10 and capped.finish_reason is FinishReason.MAX_NEW_TOKENS

    async def aborted_then_continued():
        first = asyncio.ensure_future(gen.generate_async([9], GenerationConfig(max_new_tokens=64)))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(gen.update_weights, {}, in_flight="abort")
        out = await first
        assert out.finish_reason is FinishReason.ABORTED
        # the continuation's prompt no longer starts with 9, yet it makes the rest of the 40 tokens
        rest = await gen.generate_async([9, *out.output_ids], GenerationConfig(max_new_tokens=64 - len(out.output_ids)))
        return out, rest

    out, rest = run(aborted_then_continued())
    assert len(out.output_ids) + len(rest.output_ids) == 40 and rest.finish_reason is FinishReason.EOS
    assert rest.weight_version == 1 and out.weight_version == 0


# ---- environments -------------------------------------------------------------------------------------


def log(*replies: str) -> list[Message]:
    messages = [Message("user", "What is 2 + 3?", (1,))]
    for r in replies:
        messages += [Message("assistant", r, (2,)), Message("tool", "ok", (3,))]
    return messages[:-1]


def test_a_scripted_environment_answers_and_ends_as_configured():
    env = ScriptedEnvironment(turns=2, reward=lambda s: float(s.turn), answer=lambda s: s.reply.upper(),
                              observation=Observation("tool", "again"), next_stop_strings=("STOP",),
                              metadata=lambda s: {**s.metadata, "seen": s.question})
    assert isinstance(env, EnvironmentInterface)
    out = run(env.step([log("a"), log("a", "b")], [None, {"k": 1}]))
    assert out.terminateds == [False, True] and out.rewards == [1.0, 2.0] and out.answers == ["A", "B"]
    assert out.observations == [Observation("tool", "again")] * 2 and out.next_stop_strings == [("STOP",)] * 2
    assert out.metadata == [{"seen": "What is 2 + 3?"}, {"k": 1, "seen": "What is 2 + 3?"}]
    assert env.num_steps == 2
    never = run(ScriptedEnvironment(turns=None).step([log("a", "b", "c")], [{"m": 2}]))
    assert never.terminateds == [False] and never.metadata == [{"m": 2}]  # metadata passed back unchanged


def test_a_failing_environment_fails_only_where_told():
    env = FailingEnvironment(RuntimeError("env exploded"), when=lambda s: "boom" in s.reply, reward=1.0)
    assert run(env.step([log("fine")], [None])).rewards == [1.0]
    with pytest.raises(RuntimeError, match="env exploded"):
        run(env.step([log("fine"), log("boom")], [None, None]))  # one bad rollout fails the whole step
    hanging = FailingEnvironment(Fault.HANG)
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        run(asyncio.wait_for(hanging.step([log("x")], [None]), 0.2))
    assert time.perf_counter() - start < 5
