"""Structured output (`response_format`): llguidance grammars as per-row logits masks in the hf engine, over a real
socket with the official `openai` client, and their translation into vLLM's structured outputs.

The tiny model is random, so whatever it generates under a schema is the grammar's doing: the schemas bound their
strings, numbers and arrays so that every generation can finish within max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState
from tolerances import ENGINE_LOGPROBS, approx

from nemo_rl_ext.models.generation import GenerationConfig, StructuredOutput
from nemo_rl_ext.models.generation.grammar import JSON_OPTIONS, Grammars, grammar_of, vllm_structured_outputs
from nemo_rl_ext.serving.choice_format import MIN_LOGPROB
from nemo_rl_ext.serving.policy_server import PolicyServer
from nemo_rl_ext.testing.vllm_engine import StandInEngine, vllm_on_stand_in

SCHEMAS = {
    "object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age", "admin"],
        "additionalProperties": False,
    },
    "enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "integers": {"type": "array", "items": {"type": "integer", "minimum": -99, "maximum": 99}, "maxItems": 6},
}
"""An object with required fields, an enum, an array of integers: bounded, so the random model can finish."""
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_MODEL_LEN = 512


def json_schema_format(name: str, schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


@pytest.fixture(scope="module")
def server(backend, tiny_model_and_tokenizer) -> Iterator[PolicyServer]:
    with PolicyServer(backend, tiny_model_and_tokenizer[1], served_model_name="tiny") as srv:
        yield srv


def allowed_tokens(tokenizer, vocab_size: int, eos_id: int, schema: dict, ids: list[int]) -> list[np.ndarray]:
    """For each of `ids`, the token ids the schema allows at its position: a fresh llguidance matcher replayed
    token by token (independent of the engine's mask code)."""
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=[eos_id])
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    allowed = []
    for token in ids:
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed.append(np.flatnonzero(np.unpackbits(bits, count=vocab_size, bitorder="little")))
        assert matcher.consume_token(token)
    return allowed


def test_thirty_generations_under_three_schemas_validate_streamed_and_not_with_masked_logprobs(
    server, tiny_model_and_tokenizer
) -> None:
    """10 sampled choices per schema all parse and validate, streamed and not (the same choices), end naturally
    (EOS once the grammar is complete), and their logprobs are log_softmax over the allowed tokens of a separate
    forward pass."""
    model, tokenizer = tiny_model_and_tokenizer
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    for name, schema in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        kwargs = dict(
            model="tiny", messages=MESSAGES, n=10, seed=7, temperature=1.0, max_tokens=96, logprobs=True,
            top_logprobs=3, response_format=json_schema_format(name, schema, strict=name != "enum"),
            extra_body={"return_tokens_as_token_ids": True},
        )
        response = client.chat.completions.create(**kwargs)
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            state.handle_chunk(chunk)
        streamed = state.current_completion_snapshot.choices
        assert len(response.choices) == len(streamed) == 10
        for choice, streamed_choice in zip(response.choices, streamed, strict=True):
            assert choice.finish_reason == streamed_choice.finish_reason == "stop", (name, choice.message.content)
            for content in (choice.message.content, streamed_choice.message.content):
                jsonschema.validate(json.loads(content), schema)
            assert streamed_choice.message.content == choice.message.content
            assert streamed_choice.message.model_extra["generation_token_ids"] == \
                choice.message.model_extra["generation_token_ids"]
        choice = response.choices[0]  # one per schema against the forward pass (fp32)
        prompt, ids = (choice.message.model_extra[k] for k in ("prompt_token_ids", "generation_token_ids"))
        assert ids[-1] == tokenizer.eos_token_id
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        allowed = allowed_tokens(tokenizer, logits.shape[-1], tokenizer.eos_token_id, schema, ids)
        expected = [
            float(torch.log_softmax(row[torch.from_numpy(ok)], -1)[int(np.searchsorted(ok, token))])
            for row, ok, token in zip(logits, allowed, ids, strict=True)
        ]
        assert all(token in ok for token, ok in zip(ids, allowed, strict=True))
        assert [c.logprob for c in choice.logprobs.content] == approx(expected, ENGINE_LOGPROBS)
        assert choice.message.model_extra["generation_log_probs"] == approx(expected, ENGINE_LOGPROBS)
        assert min(len(ok) for ok in allowed) < logits.shape[-1] // 2  # the mask did cut
        for entry, ok in zip(choice.logprobs.content, allowed, strict=True):  # top_logprobs: masked too
            for top in entry.top_logprobs:
                assert int(top.token.removeprefix("token_id:")) in ok or top.logprob == MIN_LOGPROB


def test_json_object_and_a_schema_cut_by_max_tokens(server) -> None:
    """json_object gives a JSON object; max_tokens that ends the JSON early is finish_reason "length" with the
    partial text (as OpenAI and vLLM answer): a client checks finish_reason before parsing."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    whole = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, response_format={"type": "json_object"}
    )
    assert whole.choices[0].finish_reason == "stop" and isinstance(json.loads(whole.choices[0].message.content), dict)
    cut = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, seed=1, response_format=json_schema_format("o", SCHEMAS["object"])
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith('{"name":"')
    assert len(choice.message.model_extra["generation_token_ids"]) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


async def test_an_invalid_schema_is_a_400_naming_it_and_the_batch_goes_on(server, backend) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)

    async def ask(response_format: dict) -> openai.types.chat.ChatCompletion:
        return await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=32, seed=3, response_format=response_format
        )

    requests_before = backend.num_requests
    good = json_schema_format("colour", SCHEMAS["enum"])
    bad = json_schema_format("broken", {"type": "object", "properties": {"a": {"type": "integr"}}})
    missing = {"type": "json_schema", "json_schema": {"name": "nothing"}}
    results = await asyncio.gather(ask(good), ask(bad), ask(good), ask(missing), return_exceptions=True)
    for error in (results[1], results[3]):
        assert isinstance(error, openai.BadRequestError), error
        assert error.body["param"] == "response_format.json_schema.schema"
        assert "response_format.json_schema.schema" in error.body["message"]
    assert "integr" in results[1].body["message"]
    for ok in (results[0], results[2]):
        assert json.loads(ok.choices[0].message.content) in SCHEMAS["enum"]["enum"]
    assert backend.num_requests == requests_before + 2  # the refused ones never reached the engine
    await client.close()


def test_text_completions_take_response_format_too(server) -> None:
    """/v1/completions shares the chat route's response_format: 2 prompts x n=3 choices, all in the enum."""
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    response = client.completions.create(
        model="tiny", prompt=["Colour:", "Another colour:"], n=3, seed=2, max_tokens=16,
        extra_body={"response_format": json_schema_format("colour", SCHEMAS["enum"])},
    )
    assert len(response.choices) == 6
    for choice in response.choices:
        assert choice.finish_reason == "stop" and json.loads(choice.text) in SCHEMAS["enum"]["enum"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(
            model="tiny", prompt="x", max_tokens=4,
            extra_body={"response_format": json_schema_format("bad", {"type": "array", "minItems": 3, "maxItems": 1})},
        )
    assert refused.value.body["param"] == "response_format.json_schema.schema"


async def test_rows_without_a_grammar_are_untouched_by_rows_with_one(backend, tiny_model_and_tokenizer) -> None:
    tokenizer = tiny_model_and_tokenizer[1]
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    free = GenerationConfig(max_new_tokens=12, temperature=1.0, seed=5)
    alone = await backend.generate_async(ids, free)
    constrained = free.model_copy(update={"structured_output": StructuredOutput(json_schema=json.dumps(SCHEMAS["integers"]))})
    together = await asyncio.gather(backend.generate_async(ids, constrained), backend.generate_async(ids, free))
    assert together[1].output_ids == alone.output_ids
    assert together[1].logprobs == approx(alone.logprobs, ENGINE_LOGPROBS)
    assert together[0].output_ids != alone.output_ids and tokenizer.decode(together[0].output_ids).startswith("[")
    logits = torch.randn(3, 40)
    assert Grammars.mask(logits, [None, None, None]) is logits  # no grammar row: no copy, no work


async def test_the_engine_refuses_an_invalid_schema_before_queueing_it(backend, tiny_model_and_tokenizer) -> None:
    requests_before = backend.num_requests
    bad = StructuredOutput(json_schema='{"type": "integer", "minimum": 5, "maximum": 1}')
    with pytest.raises(ValueError, match="invalid JSON schema: .*minimum"):
        await backend.generate_async([1, 2, 3], GenerationConfig(structured_output=bad))
    with pytest.raises(ValueError, match="invalid JSON schema: .*objectt"):
        grammar_of(StructuredOutput(json_schema='{"type": "objectt"}'))
    with pytest.raises(ValueError, match="json_schema must be a JSON object, got list"):
        StructuredOutput(json_schema="[1, 2]")
    assert backend.num_requests == requests_before


@dataclass
class VllmStructuredOutputsParams:
    """vLLM 0.32's `vllm.sampling_params.StructuredOutputsParams` constructor fields and its one-constraint check
    (vLLM is not installed here)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [self.json, self.regex, self.choice, self.grammar, self.json_object, self.structural_tag]
        assert sum(v is not None for v in given) == 1


@pytest.fixture
def fake_vllm(monkeypatch) -> None:
    """vLLM is not installed here: a module holding vLLM 0.32's StructuredOutputsParams fields stands in for it."""
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", types.SimpleNamespace(
        StructuredOutputsParams=VllmStructuredOutputsParams))


def test_vllm_gets_the_schema_as_structured_outputs_json(fake_vllm) -> None:
    schema = SCHEMAS["object"]
    params = vllm_structured_outputs(StructuredOutput(json_schema=json.dumps(schema)))
    assert params == VllmStructuredOutputsParams(json=schema)
    assert vllm_structured_outputs(StructuredOutput()).json == {"type": "object"}
    assert vllm_structured_outputs(None) is None
    with vllm_on_stand_in(StandInEngine()) as gen:
        config = GenerationConfig(structured_output=StructuredOutput(json_schema=json.dumps(schema)))
        assert gen.sampling_params(config, 8)["structured_outputs"] == VllmStructuredOutputsParams(json=schema)
        assert gen.sampling_params(GenerationConfig(), 8)["structured_outputs"] is None
