"""Top logprobs (chat and text) and `POST /v1/completions`, over a real socket with the official `openai` client,
on the tiny model; logprobs are checked against separate fp32 forward passes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from tolerances import ENGINE_LOGPROBS, SAME_MODEL_LOGPROBS, approx

from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.serving.policy_server import PolicyServer

MAX_MODEL_LEN = 512
QUESTION = [{"role": "user", "content": "What is 7 + 5?"}]
PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def server(backend, tiny_model_and_tokenizer) -> Iterator[PolicyServer]:
    _, tokenizer = tiny_model_and_tokenizer
    defaults = GenerationConfig(max_new_tokens=8)
    with PolicyServer(backend, tokenizer, served_model_name="tiny", default_config=defaults) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def forward_log_softmax(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at every position of `ids` (row i predicts ids[i + 1]), one fp32 forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def test_chat_top_logprobs_are_the_top_five_of_a_forward_pass(client, tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    response = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=6, temperature=0.8, top_p=0.9, seed=5, logprobs=True,
        top_logprobs=5, extra_body={"return_tokens_as_token_ids": True},
    )
    message = response.choices[0].message.model_extra
    prompt, generated = message["prompt_token_ids"], message["generation_token_ids"]
    reference = forward_log_softmax(model, prompt + generated, 0.8)[len(prompt) - 1 : -1]
    content = response.choices[0].logprobs.content
    assert len(content) == len(generated) > 0
    for pos, (entry, token) in enumerate(zip(content, generated, strict=True)):
        assert entry.token == f"token_id:{token}"
        tops = {int(t.token.removeprefix("token_id:")): t.logprob for t in entry.top_logprobs}
        assert len(entry.top_logprobs) == 5
        assert [t.logprob for t in entry.top_logprobs] == sorted(tops.values(), reverse=True)
        assert set(tops) == set(reference[pos].topk(5).indices.tolist())  # the top five of the forward pass
        assert list(tops.values()) == approx(reference[pos, list(tops)].tolist(), ENGINE_LOGPROBS)
        if token in tops:  # the chosen token's alternative entry is its logprob
            assert tops[token] == approx(entry.logprob, SAME_MODEL_LOGPROBS)
    assert [e.logprob for e in content] == message["generation_log_probs"]


def test_text_completions_of_four_prompts_times_n_come_in_openais_order(client, tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    batch = client.completions.create(model="tiny", prompt=PROMPTS, n=2, max_tokens=5, temperature=1.0, seed=11)
    assert [c.index for c in batch.choices] == list(range(8))
    for p, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt)["input_ids"]
        single = client.completions.create(model="tiny", prompt=prompt, n=2, max_tokens=5, temperature=1.0, seed=11)
        for j in range(2):
            choice, alone = batch.choices[p * 2 + j].model_extra, single.choices[j].model_extra
            assert choice["prompt_token_ids"] == ids
            assert choice["generation_token_ids"] == alone["generation_token_ids"]  # seeded: seed + j
            assert batch.choices[p * 2 + j].text == single.choices[j].text
            assert len(choice["generation_log_probs"]) == len(choice["generation_token_ids"]) > 0
    assert batch.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert batch.usage.completion_tokens == sum(len(c.model_extra["generation_token_ids"]) for c in batch.choices)
    assert batch.object == "text_completion"


def test_token_id_prompts_give_what_the_same_text_gives(client, tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    as_text = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    as_lists = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    as_ids = client.completions.create(model="tiny", prompt=ids[1], max_tokens=6, temperature=0)
    for form in (as_lists.choices, as_ids.choices):
        for mine, theirs in zip(form, as_text.choices[-len(form):], strict=True):
            assert mine.text == theirs.text
            assert mine.model_extra["generation_token_ids"] == theirs.model_extra["generation_token_ids"]
            assert mine.model_extra["prompt_token_ids"] == theirs.model_extra["prompt_token_ids"]


def test_logprobs_in_openais_completions_format(client, tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0.7, seed=2,
                                         logprobs=3)
    choice = response.choices[0]
    prompt, generated = choice.model_extra["prompt_token_ids"], choice.model_extra["generation_token_ids"]
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in generated]
    assert lp.token_logprobs == choice.model_extra["generation_log_probs"]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    reference = forward_log_softmax(model, prompt + generated, 0.7)[len(prompt) - 1 : -1]
    for pos, (token, logprob, tops) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)):
        top3 = reference[pos].topk(3)
        expected = {tokenizer.decode([i]): v for i, v in zip(top3.indices.tolist(), top3.values.tolist(), strict=True)}
        assert tops[token] == approx(logprob, SAME_MODEL_LOGPROBS)  # the chosen token is always there
        assert set(expected) <= set(tops) and len(tops) <= 4  # the top 3, plus the chosen one when not among them
        assert [tops[k] for k in expected] == approx(list(expected.values()), ENGINE_LOGPROBS)


def test_echo_with_logprobs_scores_the_prompt_as_a_forward_pass(client, tiny_model_and_tokenizer) -> None:
    model, tokenizer = tiny_model_and_tokenizer
    response = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=1, temperature=0, echo=True,
                                         logprobs=1)
    for prompt, choice in zip(PROMPTS[:2], response.choices, strict=True):
        ids, generated = choice.model_extra["prompt_token_ids"], choice.model_extra["generation_token_ids"]
        assert choice.text == prompt + tokenizer.decode(generated, skip_special_tokens=True)
        lp = choice.logprobs
        assert lp.tokens == [tokenizer.decode([t]) for t in ids + generated]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        reference = forward_log_softmax(model, ids)  # temperature 1: the model's own distribution
        expected = reference[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        assert lp.token_logprobs[1 : len(ids)] == approx(expected, ENGINE_LOGPROBS)
        assert lp.token_logprobs[len(ids):] == choice.model_extra["generation_log_probs"]
        best = [tokenizer.decode([i]) for i in reference[:-1].argmax(-1).tolist()]
        assert all(best[i] in lp.top_logprobs[i + 1] for i in range(len(ids) - 1))
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPTS[0]) and plain.choices[0].logprobs is None


def test_max_tokens_0_with_echo_scores_the_prompt_and_generates_nothing(client, tiny_model_and_tokenizer) -> None:
    """OpenAI's legacy way of scoring a prompt (older lm-eval and other harnesses send it): the prompt's text and
    logprobs as `max_tokens: 1` gives them, without the token sampled after it."""
    model, tokenizer = tiny_model_and_tokenizer
    scored = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=0, temperature=0, echo=True,
                                       logprobs=2)
    one = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=1, temperature=0, echo=True,
                                    logprobs=2)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == one.usage.prompt_tokens
    for prompt, choice, other in zip(PROMPTS[:2], scored.choices, one.choices, strict=True):
        ids = choice.model_extra["prompt_token_ids"]
        assert choice.text == prompt and choice.finish_reason == "length" and choice.model_extra["stop_reason"] is None
        assert choice.model_extra["generation_token_ids"] == choice.model_extra["generation_log_probs"] == []
        lp, full = choice.logprobs, other.logprobs
        assert lp.tokens == full.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert lp.text_offset == full.text_offset[: len(ids)] and lp.top_logprobs[0] is None
        reference = forward_log_softmax(model, ids)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        assert lp.token_logprobs[0] is None and lp.token_logprobs[1:] == approx(reference, ENGINE_LOGPROBS)
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPTS[0] and plain.choices[0].logprobs is None


def test_the_neutral_values_of_other_servers_sampling_fields_are_accepted(client) -> None:
    body = {"num_beams": 1, "ignore_eos": False, "min_tokens": 0, "use_beam_search": False, "typical_p": 1}
    reply = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, extra_body=body)
    plain = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert reply.choices[0].text == plain.choices[0].text
    assert len(reply.choices[0].model_extra["generation_token_ids"]) == 3


BAD = [
    ("/v1/completions", {"prompt": ["a question", [1, 2]]}, "prompt", "mixing"),
    ("/v1/completions", {"prompt": ["a question", 7]}, "prompt", "mixing"),
    ("/v1/completions", {"prompt": []}, "prompt", "non-empty"),
    ("/v1/completions", {"prompt": [[1, -2]]}, "prompt", "positions [0]"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "21"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "echo": True, "logprobs": 1}, "echo", "stream=true"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"x": 1}}, "stream_options.x", "Extra inputs"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", "-1"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", "0"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    ("/v1/completions", {"prompt": ["hi", "x " * 600]}, "prompt.1", "maximum context length is 512"),
    ("/v1/completions", {"prompt": [10**6]}, "prompt", "outside [0,"),
    ("/v1/completions", {"prompt": ["a", [1]]}, "prompt", "mixing lists of token ids and strings"),
    ("/v1/chat/completions", {"messages": QUESTION, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "21"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "echo=true"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True, "stream": True}, "max_tokens", "stream=false"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", "-1"),
    # fields other servers honour that would change the output (lm-eval passes a task's generation_kwargs on)
    ("/v1/completions", {"prompt": "hi", "num_beams": 4}, "num_beams", "beam search"),
    ("/v1/completions", {"prompt": "hi", "max_new_tokens": 5}, "max_new_tokens", "send max_tokens"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": 1}, "ignore_eos", "send false"),
    ("/v1/chat/completions", {"messages": QUESTION, "min_tokens": 3}, "min_tokens", "send 0"),
    ("/v1/chat/completions", {"messages": QUESTION, "use_beam_search": True}, "use_beam_search", "beam search"),
]


async def test_bad_inputs_are_a_400_naming_the_field_and_leave_other_requests_alone(server, client) -> None:
    good = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "seed": 3}
    alone = client.completions.create(**good).model_dump()
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        answers = await asyncio.gather(
            http.post("/v1/completions", json=good),
            *(http.post(path, json={"model": "tiny", "max_tokens": 2, **body}) for path, body, _, _ in BAD),
            http.post("/v1/completions", json=good),
        )
    for answer in (answers[0], answers[-1]):  # batched with the bad ones, the same tokens as alone
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["generation_token_ids"] == alone["choices"][0]["generation_token_ids"]
    for (_path, body, param, words), answer in zip(BAD, answers[1:-1], strict=True):
        assert answer.status_code == 400, (body, answer.text)
        error = answer.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
        assert param.split(".")[0] in error["message"] or "prompt_token_ids" in error["message"]


def test_completions_guards_key_body_limit_and_metrics(backend, tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    with PolicyServer(backend, tokenizer, api_key="s3cret", max_request_bytes=2_000) as srv:
        url = srv.url + "/v1/completions"
        assert httpx.post(url, json={"prompt": "hi"}).status_code == 401
        headers = {"Authorization": "Bearer s3cret"}
        assert httpx.post(url, json={"prompt": "x" * 3_000}, headers=headers).status_code == 413
        keyed = openai.OpenAI(base_url=srv.base_url, api_key="s3cret", max_retries=0, timeout=60)
        assert keyed.completions.create(model="policy", prompt="hi", max_tokens=2).choices[0].finish_reason
        metrics = httpx.get(srv.url + "/metrics").text
    for status in ("200", "401", "413"):
        assert f'nemo_rl_ext_requests_total{{route="/v1/completions",status="{status}"}} 1.0' in metrics


def test_a_backend_without_top_or_prompt_logprobs_is_a_400_not_a_silent_answer(tiny_model_and_tokenizer) -> None:
    from nemo_rl_ext.testing import ScriptedGeneration

    _, tokenizer = tiny_model_and_tokenizer
    scripted = ScriptedGeneration(tokenizer, lambda request: "4<|im_end|>")  # reports the sampled logprob only
    with PolicyServer(scripted, tokenizer) as srv:
        chat = httpx.post(srv.url + "/v1/chat/completions", json={"messages": QUESTION, "logprobs": True,
                                                                 "top_logprobs": 2}, timeout=60)
        echo = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "echo": True, "logprobs": 0}, timeout=60)
        plain = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "logprobs": 0}, timeout=60)
    assert chat.status_code == 400 and "not supported by the ScriptedGeneration backend" in chat.text
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo"
    assert plain.status_code == 200 and plain.json()["choices"][0]["text"] == "4"


def test_streamed_chat_chunks_carry_the_top_logprobs_of_the_answer(client) -> None:
    kwargs = dict(model="tiny", messages=QUESTION, max_tokens=6, temperature=0.9, seed=4, logprobs=True,
                  top_logprobs=3)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True) for c in chunk.choices
                if c.logprobs is not None for e in c.logprobs.content or ()]
    assert len(whole) == len(streamed) > 0
    for a, b in zip(whole, streamed, strict=True):  # seeded: the same tokens; logprobs up to batch rounding
        assert (a.token, [t.token for t in a.top_logprobs]) == (b.token, [t.token for t in b.top_logprobs])
        assert [t.logprob for t in b.top_logprobs] == approx([t.logprob for t in a.top_logprobs], SAME_MODEL_LOGPROBS)


def test_streamed_text_completions_join_to_the_non_streamed_answer(client) -> None:
    kwargs = dict(model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=1.0, seed=9, logprobs=2,
                  stop=[" the"])
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    for index, answer in enumerate(whole.choices):
        mine = [c for chunk in chunks[:-1] for c in chunk.choices if c.index == index]
        assert "".join(c.text for c in mine) == answer.text
        assert [c.finish_reason for c in mine][-1] == answer.finish_reason
        assert all(c.finish_reason is None for c in mine[:-1])
        last = mine[-1].model_extra
        for key in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
            assert last[key] == answer.model_extra[key], key
        logprobs = [c.logprobs for c in mine if c.logprobs is not None]
        assert sum((lp.tokens for lp in logprobs), []) == answer.logprobs.tokens
        assert sum((lp.text_offset for lp in logprobs), []) == answer.logprobs.text_offset
        assert sum((lp.token_logprobs for lp in logprobs), []) == approx(answer.logprobs.token_logprobs,
                                                                         SAME_MODEL_LOGPROBS)
        assert [sorted(t) for lp in logprobs for t in lp.top_logprobs] == [sorted(t) for t in
                                                                           answer.logprobs.top_logprobs]
    echoed = list(client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, echo=True, stream=True))
    assert echoed[0].choices[0].text == PROMPTS[0]
    assert "".join(c.text for chunk in echoed for c in chunk.choices).startswith(PROMPTS[0])
