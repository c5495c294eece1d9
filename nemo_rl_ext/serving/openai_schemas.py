"""The OpenAI chat API as the policy server accepts it: request models, checks, and sampling parameters.

Requests are validated here into typed models; every value the server cannot honour is refused with an
`ApiError` (HTTP 400) that names the field and the value, never silently ignored. vLLM's extensions that
NeMo Gym sends (`return_tokens_as_token_ids`, `top_k`, `prompt_token_ids` / `generation_token_ids` on
assistant messages, ...) are part of the models. Every sampling field is bounded here (a seed torch cannot
take, a stop list of a million strings, ...), so that no value reaches a batch that would fail it; a
request's own chat template is refused unless the server trusts request templates (as vLLM's
`--trust-request-chat-template`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from nemo_rl_ext.models.generation.interfaces import MAX_TOP_K, MAX_TOP_LOGPROBS, SEED_LIMIT, GenerationConfig
from nemo_rl_ext.serving.api_errors import ApiError
from nemo_rl_ext.serving.request_sampling import generation_configs
from nemo_rl_ext.serving.response_format import ResponseFormat
from nemo_rl_ext.serving.streaming import StreamOptions

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
"""Content part types whose `text` the server reads; any other part type is refused."""
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
"""Token fields of an assistant message (NeMo-RL's vLLM extension); never shown to the chat template."""
MAX_JSON_DEPTH = 100
"""Most nested JSON arrays/objects a body, or a tool call's `arguments` string, may hold."""
MAX_STOP_STRINGS = 64
"""Most stop strings a request may give (each is looked for after every generated token)."""
MAX_STOP_STRING_CHARS = 512
"""Longest stop string accepted."""
MAX_STOP_TOKEN_IDS = 1024
"""Most stop token ids a request may give."""
MAX_TOKEN_ID = 2**31 - 1
"""Largest token id accepted in `stop_token_ids` (ids are int32 in vLLM)."""
MIN_POSITIVE_TEMPERATURE = 1e-6
"""Smallest temperature above 0 accepted; below it logits / T overflows float32 (0 means greedy)."""


UNHONOURED_EXTRAS: dict[str, tuple[tuple[Any, ...], str]] = {
    "max_new_tokens": ((None,), "not an OpenAI field (Hugging Face's name); send max_tokens (lm-eval: max_gen_toks "
                       "in the task's generation_kwargs)"),
    "min_new_tokens": ((None, 0), "not supported; send 0 or leave it out"),
    "min_tokens": ((None, 0), "not supported; send 0 or leave it out"),
    "ignore_eos": ((None, False), "not supported; send false or leave it out"),
    "num_beams": ((None, 1), "beam search is not supported; send 1 or leave it out"),
    "use_beam_search": ((None, False), "beam search is not supported; send false or leave it out"),
    "include_stop_str_in_output": ((None, False), "not supported (the text ends before the stop string); send false"),
    "typical_p": ((None, 1.0), "not supported; send 1.0 or leave it out"),
    "no_repeat_ngram_size": ((None, 0), "not supported; send 0 or leave it out"),
}
"""Fields outside OpenAI's API that other servers (vLLM, Hugging Face `generate`) honour and that would change
what is generated: each with the values that change nothing and why any other is refused. Unknown keys are kept
and ignored (`_Lenient`), so without this a request with `num_beams: 4` or `max_new_tokens: 5` (lm-eval passes a
task's generation_kwargs on as they are) would be answered as if they were not there."""


def unhonoured_extras(extra: dict[str, Any] | None) -> list[tuple[str, Any, str]]:
    """(field, value, why) for each `UNHONOURED_EXTRAS` key of a request's extra fields set to a value that would
    change the generation."""
    refused = []
    for key, value in (extra or {}).items():
        if key not in UNHONOURED_EXTRAS:
            continue
        neutral, why = UNHONOURED_EXTRAS[key]
        # 1 == True in Python: a neutral number is matched by numbers only, a neutral boolean by booleans only
        if not any(value is n or (value == n and isinstance(value, bool) == isinstance(n, bool)) for n in neutral):
            refused.append((key, value, why))
    return refused


def exceeds_depth(value: Any, limit: int) -> bool:
    """True when `value` (parsed JSON) nests more than `limit` arrays/objects deep; iterative, stops early."""
    level, depth = [value], 0
    while True:
        level = [v for v in level if isinstance(v, dict | list)]
        if not level:
            return False
        depth += 1
        if depth > limit:
            return True
        level = [child for v in level for child in (v.values() if isinstance(v, dict) else v)]


def too_deep_message(what: str) -> str:
    """The error for JSON nested deeper than `MAX_JSON_DEPTH`."""
    return f"{what} nests JSON arrays/objects more than {MAX_JSON_DEPTH} levels deep (the most accepted)"


def loads_bounded(text: str, what: str) -> Any:
    """`json.loads(text)`, with a ValueError naming `what` if it nests deeper than `MAX_JSON_DEPTH`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(too_deep_message(what)) from None
    if exceeds_depth(value, MAX_JSON_DEPTH):
        raise ValueError(too_deep_message(what))
    return value


class _Lenient(BaseModel):
    """Unknown keys are kept (OpenAI clients send many optional fields the server does not need)."""

    model_config = ConfigDict(extra="allow")


class ContentPart(_Lenient):
    """One part of a list-valued message content; only text parts are served."""

    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    """The function of an assistant tool call; `arguments` is a JSON string (OpenAI) or an object."""

    name: str
    arguments: str | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _not_too_deep(cls, value: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(value, str):
            try:
                loads_bounded(value, "the arguments string")
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the string as it is
        return value


class ToolCallIn(_Lenient):
    """A tool call inside a request's assistant message."""

    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    """One request message: content as a string or a list of text parts; assistant token ids optional."""

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None

    @model_validator(mode="after")
    def _token_ids_come_in_pairs(self) -> ChatMessage:
        has_prompt, has_generation = self.prompt_token_ids is not None, self.generation_token_ids is not None
        if has_prompt != has_generation:
            missing = "generation_token_ids" if has_prompt else "prompt_token_ids"
            raise ValueError(
                f"a message with token ids needs both prompt_token_ids and generation_token_ids; {missing} is missing"
            )
        if has_prompt and self.role != "assistant":
            raise ValueError(
                f"only assistant messages may carry prompt/generation token ids (role is {self.role!r})"
            )
        for key in ("prompt_token_ids", "generation_token_ids"):
            bad = [t for t in getattr(self, key) or () if t < 0]
            if bad:
                raise ValueError(f"{key} holds negative ids: {bad[:10]}")
        return self

    @property
    def carries_token_ids(self) -> bool:
        """True for an assistant message that holds the ids it was generated from and as."""
        return self.prompt_token_ids is not None and self.generation_token_ids is not None

    def text(self) -> str | None:
        """The content as one string (text parts joined with newlines, as vLLM does); None stays None."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for i, part in enumerate(self.content):
            if part.type not in TEXT_PART_TYPES:
                raise ApiError(
                    f"content part type {part.type!r} is not supported (text only: {sorted(TEXT_PART_TYPES)})",
                    param=f"content.{i}.type",
                )
            texts.append(part.text or "")
        return "\n".join(texts)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: string content, tool-call arguments as objects.

        `developer` becomes `system` (OpenAI's meaning; most templates know only `system`). `content: null`
        (a tool-call-only assistant turn, or the empty turn Gym puts after a call refused for context
        length) becomes "", as vLLM's OpenAI server renders it: templates that read `message['content']`
        (SmolLM2's) fail on None. Token fields are dropped; other extra keys (e.g. `reasoning_content`)
        pass through, as vLLM passes them.
        """
        extras = {k: v for k, v in (self.model_extra or {}).items() if k not in TOKEN_FIELDS}
        out: dict[str, Any] = {**extras, "role": "system" if self.role == "developer" else self.role}
        out["content"] = self.text() or ""
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [_call_for_template(c) for c in self.tool_calls]
        return out


def _call_for_template(call: ToolCallIn) -> dict[str, Any]:
    """A tool call with its JSON-string arguments decoded (templates render them with `tojson`)."""
    arguments: Any = call.function.arguments
    if isinstance(arguments, str):
        try:
            decoded = loads_bounded(arguments, "the arguments string") if arguments.strip() else {}
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            arguments = decoded
    out: dict[str, Any] = {
        "type": call.type,
        "function": {"name": call.function.name, "arguments": arguments},
    }
    if call.id is not None:
        out["id"] = call.id
    return out


class FunctionDef(_Lenient):
    """A tool's function definition."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(_Lenient):
    """A tool the model may call; only function tools exist in the chat API."""

    type: Literal["function"] = "function"
    function: FunctionDef

    def for_template(self) -> dict[str, Any]:
        """The tool as a JSON schema dict, without OpenAI-hosted-only keys (`strict`)."""
        function = self.function.model_dump(exclude_none=True)
        function.pop("strict", None)
        return {"type": "function", "function": function}


class PromptParams(_Lenient):
    """What decides the prompt ids; shared by `/v1/chat/completions` and `/tokenize`."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None

    @model_validator(mode="after")
    def _generation_prompt_or_continuation(self) -> PromptParams:
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self

    def check_chat_template(self, trusted: bool) -> None:
        """Refuse (400) a chat template sent with the request unless the server trusts request templates."""
        if trusted:
            return
        for field, value in (
            ("chat_template", self.chat_template),
            ("chat_template_kwargs.chat_template", (self.chat_template_kwargs or {}).get("chat_template")),
        ):
            if value is not None:
                raise ApiError(
                    f"{field}: a chat template sent with the request is refused (templates run loops on "
                    "the server); start the server with --trust-request-chat-template to allow it",
                    param=field,
                )

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tools as the chat template receives them; None when there are none."""
        return [t.for_template() for t in self.tools] if self.tools else None


class TokenizeRequest(PromptParams):
    """`POST /tokenize` with messages (vLLM's chat form); the prompt form is `TokenizePromptRequest`."""

    return_token_strs: bool = False


class TokenizePromptRequest(_Lenient):
    """`POST /tokenize` with a plain `prompt` string (vLLM's completion form)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class ChatCompletionRequest(PromptParams):
    """`POST /v1/chat/completions`: the OpenAI fields plus the vLLM extensions NeMo Gym and NeMo-RL use."""

    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(
        default=None, le=MAX_TOP_K, description="vLLM extension; -1 or 0 mean no top-k filter."
    )
    min_p: float = 0.0
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=128)
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    tool_choice: str | dict[str, Any] | None = None
    required_prefix_token_ids: list[int] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("top_k must be -1 or 0 (no filter) or a positive integer")
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < MIN_POSITIVE_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_POSITIVE_TEMPERATURE}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        strings = [value] if isinstance(value, str) else value or []
        if "" in strings:
            raise ValueError("stop strings must not be empty")
        long = [i for i, s in enumerate(strings) if len(s) > MAX_STOP_STRING_CHARS]
        if long:
            raise ValueError(
                f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters (positions {long})"
            )
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        bad = [t for t in value or () if not 0 <= t <= MAX_TOKEN_ID]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {MAX_TOKEN_ID}]: {bad[:10]}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed_of_every_choice_fits(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)  # n is validated first (declared before seed)
        if value is not None and value + n - 1 >= SEED_LIMIT:
            raise ValueError(f"choice i uses seed + i, so seed + n - 1 = {value + n - 1} must be below 2**63")
        return value

    def check_supported(self) -> None:
        """Refuse (400) every valid OpenAI value this server cannot honour, naming field and value."""
        unsupported: list[tuple[str, Any, str]] = []
        if self.stream_options is not None and not self.stream:
            unsupported.append(("stream_options", self.stream_options, "only allowed with stream=true"))
        if self.top_logprobs and not self.logprobs:
            unsupported.append(("top_logprobs", self.top_logprobs, "top_logprobs needs logprobs=true (as OpenAI)"))
        for key, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("min_p", 0.0)):
            value = getattr(self, key)
            if value not in (None, neutral):
                unsupported.append((key, value, f"{key} is not supported; send {neutral} or leave it out"))
        if self.repetition_penalty not in (None, 1.0):
            unsupported.append(
                (
                    "repetition_penalty",
                    self.repetition_penalty,
                    "repetition_penalty is not supported; send 1.0",
                )
            )
        if self.logit_bias:
            unsupported.append(("logit_bias", self.logit_bias, "logit_bias is not supported"))
        unsupported.extend(unhonoured_extras(self.model_extra))
        if self.tool_choice not in (None, "auto", "none"):
            unsupported.append(
                (
                    "tool_choice",
                    self.tool_choice,
                    "only tool_choice 'auto' or 'none' is supported (no forced calls)",
                )
            )
        if unsupported:
            field, value, why = unsupported[0]
            message = "; ".join(f"{f}={v!r}: {w}" for f, v, w in unsupported)
            raise ApiError(message, param=field)

    @property
    def parses_tool_calls(self) -> bool:
        """True when generated `<tool_call>` blocks become OpenAI `tool_calls` (tools given, not 'none')."""
        return bool(self.tools) and self.tool_choice != "none"

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple of strings."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def generation_configs(
        self, prompt_len: int, max_model_len: int, defaults: GenerationConfig | None
    ) -> list[GenerationConfig]:
        """One `GenerationConfig` per choice (`request_sampling.generation_configs`), with the top logprobs asked."""
        top = (self.top_logprobs or 0) if self.logprobs else 0
        return generation_configs(self, prompt_len, max_model_len, defaults, top_logprobs=top)
