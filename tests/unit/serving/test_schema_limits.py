"""Schemas the grammar cannot serve: refused with a 400 naming `response_format.json_schema.schema` before they
reach the engine (too large, unsatisfiable, over the parser's limits), and a grammar that still fails
mid-generation ends its own request alone with that 400, never a 500. Before: the 2,500-property schema passed
the up-front check and failed while decoding (a 500 with a traceback), and a `$ref` that only refers to itself
was answered with empty content."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from nemo_rl_ext.models.generation import StructuredOutput
from nemo_rl_ext.models.generation.grammar import PROBE_BYTES, SCHEMA_MAX_BYTES, GrammarError, grammar_of
from nemo_rl_ext.serving.policy_server import PolicyServer

PARAM = "response_format.json_schema.schema"
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
MAX_MODEL_LEN = 512


def optional_strings(n: int) -> dict:
    return {"type": "object", "properties": {f"f{i}": {"type": "string"} for i in range(n)}}


SELF_REF = {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}}
LATE_FAILURE = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "minLength": PROBE_BYTES + 6, "maxLength": PROBE_BYTES + 6},
        "b": optional_strings(600),
    },
    "required": ["a", "b"],
}
"""Passes the probe (its first bytes are inside the long string "a") and fails once the model reaches "b": 600
optional keys make one Earley row of about 2,400 items, over llguidance's 2,000."""


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


@pytest.mark.parametrize(
    ("schema", "reason"),
    [
        (optional_strings(2500), "at most 65,536 are served"),  # the 72 KB schema of the report
        (optional_strings(600), "Current row has"),  # 15 KB, under the size bound: the parser's limit
        ({"type": "object", "properties": {f"k{i}": {"type": "string", "description": "x" * 1000}
                                           for i in range(1000)}}, "at most 65,536"),  # 1 MB
        (SELF_REF, "no JSON value satisfies this schema"),
    ],
    ids=["2500-properties", "600-properties", "1MB", "self-ref"],
)
def test_schemas_the_grammar_cannot_serve_are_refused_up_front(schema: dict, reason: str) -> None:
    with pytest.raises(GrammarError, match=reason):
        grammar_of(StructuredOutput(json_schema=json.dumps(schema)))


def test_a_schema_within_the_limits_compiles() -> None:
    spec = StructuredOutput(json_schema=json.dumps(optional_strings(400)))
    assert len(spec.json_schema) < SCHEMA_MAX_BYTES
    assert grammar_of(spec)
    assert grammar_of(StructuredOutput(json_schema=json.dumps(LATE_FAILURE)))  # the probe does not reach "b"


@pytest.fixture(scope="module")
def server(backend, tiny_model_and_tokenizer) -> Iterator[PolicyServer]:
    with PolicyServer(backend, tiny_model_and_tokenizer[1], served_model_name="tiny") as srv:
        yield srv


async def test_the_server_refuses_them_with_a_400_and_the_batch_goes_on(server, backend) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)

    async def ask(schema: dict):
        return await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, seed=3,
                                                    response_format=fmt(schema))

    before = backend.num_requests
    good = {"type": "string", "enum": ["red", "green"]}
    results = await asyncio.gather(ask(good), ask(optional_strings(2500)), ask(SELF_REF), ask(optional_strings(600)),
                                   return_exceptions=True)
    for error in results[1:]:
        assert isinstance(error, openai.BadRequestError), error
        assert error.body["param"] == PARAM and error.body["message"].startswith(PARAM), error.body
    assert json.loads(results[0].choices[0].message.content) in good["enum"]
    assert backend.num_requests == before + 1  # the refused ones never reached the engine
    await client.close()


async def test_a_grammar_failing_mid_generation_ends_its_request_alone(server, backend) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    good = {"type": "integer", "minimum": 0, "maximum": 9}

    async def ask(schema: dict, **extra):
        return await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, seed=5,
                                                    response_format=fmt(schema), **extra)

    before = backend.num_requests
    failed, answered = await asyncio.gather(ask(LATE_FAILURE), ask(good), return_exceptions=True)
    assert backend.num_requests == before + 2  # the failing one reached the engine: found mid-generation
    assert isinstance(failed, openai.BadRequestError), failed
    assert failed.body["param"] == PARAM and "the grammar failed at generated token" in failed.body["message"]
    assert 0 <= json.loads(answered.choices[0].message.content) <= 9

    chunks = []  # streamed: the error event, then [DONE]
    async with httpx.AsyncClient(timeout=120) as http:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 200, "seed": 5, "stream": True,
                "response_format": fmt(LATE_FAILURE)}
        async with http.stream("POST", server.base_url + "/chat/completions", json=body) as answer:
            assert answer.status_code == 200
            chunks = [line async for line in answer.aiter_lines() if line.startswith("data: ")]
    error = json.loads(chunks[-2].removeprefix("data: "))["error"]
    assert error["param"] == PARAM and "the grammar failed at generated token" in error["message"]
    assert chunks[-1] == "data: [DONE]"
    await client.close()
