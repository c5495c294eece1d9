"""The OpenAI text completions API (`POST /v1/completions`) as the policy server accepts it.

The sampling fields are checked exactly as in chat completions (the same validators), every value the server
cannot honour is a 400 naming the field, and `prompt` is one of OpenAI's four forms: a string, a list of
strings, a list of token ids, or a list of lists of token ids (anything else, e.g. a list mixing strings and
ids, is one 400 naming `prompt`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator

from nemo_rl_ext.models.generation.interfaces import MAX_TOP_K, MAX_TOP_LOGPROBS, SEED_LIMIT
from nemo_rl_ext.serving.api_errors import ApiError
from nemo_rl_ext.serving.openai_schemas import (
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    ChatCompletionRequest,
    _Lenient,
    unhonoured_extras,
)
from nemo_rl_ext.serving.response_format import ResponseFormat
from nemo_rl_ext.serving.streaming import StreamOptions

MAX_PROMPTS = 256
"""Most prompts one request may hold."""
MAX_CHOICES = 1024
"""Most choices (prompts x n) one request may ask for."""
PROMPT_FORMS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _prompt_form(value: Any) -> str:
    """Which of OpenAI's prompt forms `value` is ("text", "texts", "ids", "id_lists"); ValueError otherwise."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list) or not value:
        raise ValueError(f"prompt must be {PROMPT_FORMS}, non-empty")
    kinds = [_kind(v) for v in value]
    if len(set(kinds)) == 1 and kinds[0] != "other":
        if kinds[0] != "token id" and len(value) > MAX_PROMPTS:
            raise ValueError(f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS} are accepted")
        return {"string": "texts", "token id": "ids", "list of token ids": "id_lists"}[kinds[0]]
    bad = [i for i, kind in enumerate(kinds) if kind == "other"]
    plural = {"string": "strings", "token id": "token ids", "list of token ids": "lists of token ids"}
    if bad:
        detail = f"a list whose items at positions {bad[:10]} are none of those (token ids are integers >= 0)"
    else:
        detail = "a list mixing " + " and ".join(plural[k] for k in sorted(set(kinds)))
    raise ValueError(f"prompt must be {PROMPT_FORMS}; got {detail}")


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if _is_id(value):
        return "token id"
    if isinstance(value, list) and value and all(_is_id(t) for t in value):
        return "list of token ids"
    return "other"


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class CompletionRequest(_Lenient):
    """`POST /v1/completions`: OpenAI's fields plus vLLM's extensions that token-in RL clients use."""

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(
        default=None, ge=0, description="0 (with echo): score the prompt only, as OpenAI's legacy API allowed."
    )
    max_completion_tokens: ClassVar[None] = None
    """Chat's alias of max_tokens; text completions have only max_tokens."""
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, le=MAX_TOP_K, description="vLLM extension; -1 or 0: no filter.")
    min_p: float = 0.0
    n: int = Field(default=1, ge=1, le=128)
    best_of: int | None = None
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        _prompt_form(value)
        return value

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int | None) -> int | None:
        return ChatCompletionRequest._top_k(value)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float | None) -> float | None:
        return ChatCompletionRequest._temperature(value)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        return ChatCompletionRequest._stop(value)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        return ChatCompletionRequest._stop_token_ids(value)

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None, info: ValidationInfo) -> int | None:
        return ChatCompletionRequest._seed_of_every_choice_fits(value, info)

    @property
    def scores_only(self) -> bool:
        """`max_tokens: 0` with `echo`: the answer is the prompt and its logprobs, nothing generated."""
        return self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        form = _prompt_form(self.prompt)
        return [self.prompt] if form in ("text", "ids") else list(self.prompt)

    def stop_strings(self) -> tuple[str, ...]:
        """`stop` as a tuple of strings."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def check_supported(self) -> None:
        """Refuse (400) every valid OpenAI value this server cannot honour, naming field and value."""
        unsupported: list[tuple[str, Any, str]] = []
        if self.stream_options is not None and not self.stream:
            unsupported.append(("stream_options", self.stream_options, "only allowed with stream=true"))
        if self.stream and self.echo and self.logprobs is not None:
            unsupported.append(("echo", self.echo, "echo with logprobs is not supported with stream=true (the "
                                "prompt is scored with the finished output); send stream=false"))
        if self.max_tokens == 0 and not self.echo:
            unsupported.append(("max_tokens", 0, "max_tokens 0 only scores the prompt: send echo=true with it"))
        if self.max_tokens == 0 and self.stream:
            unsupported.append(("max_tokens", 0, "max_tokens 0 (scoring the prompt) is not supported with "
                                "stream=true; send stream=false"))
        unsupported.extend(unhonoured_extras(self.model_extra))
        if self.suffix:
            unsupported.append(("suffix", self.suffix, "suffix (insertion) is not supported"))
        if self.best_of not in (None, self.n):
            unsupported.append(("best_of", self.best_of, f"best_of must equal n ({self.n}) or be left out"))
        for key, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("min_p", 0.0)):
            if getattr(self, key) not in (None, neutral):
                unsupported.append((key, getattr(self, key), f"{key} is not supported; send {neutral} or leave it out"))
        if self.repetition_penalty not in (None, 1.0):
            unsupported.append(("repetition_penalty", self.repetition_penalty, "not supported; send 1.0"))
        if self.logit_bias:
            unsupported.append(("logit_bias", self.logit_bias, "logit_bias is not supported"))
        choices = len(self.prompts()) * self.n
        if choices > MAX_CHOICES:
            unsupported.append(("n", self.n, f"{choices} choices (prompts x n); at most {MAX_CHOICES}"))
        if unsupported:
            message = "; ".join(f"{f}={v!r}: {w}" for f, v, w in unsupported)
            raise ApiError(message, param=unsupported[0][0])
