"""OpenAI's `response_format` (chat and text completions): `text`, `json_object`, `json_schema` → a `StructuredOutput`.

`{"type": "json_object"}` constrains the output to a JSON object; `{"type": "json_schema", "json_schema": {"name",
"schema", "strict", "description"}}` to JSON that matches `schema`. Both `strict` values are enforced exactly (a
grammar either admits a token or not; OpenAI's non-strict mode is best effort, vLLM enforces it too). The schema is
compiled once here, so an invalid one, or one using a JSON Schema keyword the grammar library does not implement,
is a 400 naming `response_format.json_schema.schema` before the request reaches a batch.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nemo_rl_ext.models.generation.grammar import grammar_of
from nemo_rl_ext.models.generation.interfaces import StructuredOutput
from nemo_rl_ext.serving.api_errors import ApiError

SCHEMA_PARAM = "response_format.json_schema.schema"
"""The request field an invalid schema is reported under."""


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: a named JSON Schema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, description="The schema's name (OpenAI requires one).")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema", description="The JSON Schema.")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: what the generated text must be."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured_output(self, param: str = "response_format") -> StructuredOutput | None:
        """The engine's constraint (None for text); an `ApiError` naming the field for a missing or invalid schema.

        `param` is where the request holds this format (its name in the errors)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput()
        schema_param = f"{param}.json_schema.schema"
        if self.json_schema is None or self.json_schema.json_schema is None:
            raise ApiError(f"{schema_param} is required when {param}.type is 'json_schema'", param=schema_param)
        spec = StructuredOutput(json_schema=json.dumps(self.json_schema.json_schema))
        try:
            grammar_of(spec)
        except ValueError as exc:
            raise schema_error(exc, schema_param) from None
        return spec


def schema_error(exc: Exception, param: str = SCHEMA_PARAM) -> ApiError:
    """The 400 for a schema the grammar cannot serve (found up front, or mid-generation), naming its field."""
    return ApiError(f"{param}: {exc}", param=param)
