"""A request's sampling fields as one `GenerationConfig` per choice: shared by chat and text completions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from nemo_rl_ext.models.generation.interfaces import GenerationConfig
from nemo_rl_ext.serving.openai_schemas import ApiError, validation_api_error

if TYPE_CHECKING:
    from nemo_rl_ext.serving.response_format import ResponseFormat


class SamplingRequest(Protocol):
    """The fields `generation_configs` reads (both request models have them, validated)."""

    max_tokens: int | None
    max_completion_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    n: int
    seed: int | None
    stop_token_ids: list[int] | None
    response_format: ResponseFormat | None

    def stop_strings(self) -> tuple[str, ...]: ...


def generation_configs(
    request: SamplingRequest,
    prompt_len: int,
    max_model_len: int,
    defaults: GenerationConfig | None,
    *,
    prompt_field: str = "messages",
    **extra: Any,
) -> list[GenerationConfig]:
    """One `GenerationConfig` per choice (`n`), max tokens clipped to the room left in the context.

    Fields the request leaves out come from `defaults`; without defaults an absent max_tokens means
    "up to max_model_len" (vLLM's default). With `n > 1` and a seed, choice i uses seed + i. `response_format`
    becomes `structured_output` (an invalid schema: a 400 naming `response_format.json_schema.schema`). `extra`
    are further `GenerationConfig` fields (top_logprobs, prompt_logprobs); `prompt_field` is what a prompt too
    long for the context is blamed on.
    """
    room = max_model_len - prompt_len
    if room <= 0:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len} tokens in the {prompt_field}, Please reduce the length of the {prompt_field}.",
            param=prompt_field,
        )
    base = defaults or GenerationConfig()
    requested = request.max_completion_tokens or request.max_tokens
    if requested is None:
        requested = base.max_new_tokens if defaults is not None else room
    fields: dict[str, Any] = {
        "max_new_tokens": min(requested, room),
        "temperature": base.temperature if request.temperature is None else request.temperature,
        "top_p": base.top_p if request.top_p is None else request.top_p,
        "top_k": base.top_k if request.top_k is None else (request.top_k if request.top_k > 0 else None),
        "stop_strings": base.stop_strings + request.stop_strings(),
        "stop_token_ids": base.stop_token_ids + tuple(request.stop_token_ids or ()),
        "seed": base.seed if request.seed is None else request.seed,
        "structured_output": (
            request.response_format.structured_output() if request.response_format else base.structured_output
        ),
        **extra,
    }
    try:
        config = GenerationConfig(**fields)
    except ValidationError as err:
        raise validation_api_error(err) from None
    if request.n == 1:
        return [config]
    return [
        config.model_copy(update={"seed": None if config.seed is None else config.seed + i}) for i in range(request.n)
    ]
