"""`POST /v1/completions`: OpenAI text completions over any `GenerationInterface`.

- `prompt`: a string, a list of strings, a list of token ids or a list of lists (`completion_schemas`); strings
  are tokenized with `add_special_tokens` (default true, as vLLM). With `n` choices per prompt, choice
  `prompt_index * n + j` is prompt `prompt_index`'s j-th (OpenAI's order); all run concurrently.
- `logprobs: k` gives OpenAI's completions format per choice (`tokens`, `token_logprobs`, `top_logprobs`: the k
  likeliest tokens plus the chosen one, `text_offset`), from the distribution of chat's logprobs (after
  temperature, before top-k/top-p).
- `echo: true` puts the prompt before the generated text; with `logprobs` the prompt's tokens come first in
  the logprobs, the first with a null logprob and the others scored by the prefill's forward pass at
  temperature 1 (as vLLM's prompt logprobs; what a harness sums to score a choice). `max_tokens: 0` with
  echo (OpenAI's legacy way of scoring a prompt) answers the prompt alone: the engine still samples one token
  after the prefill, which is dropped from the text, logprobs, token fields and usage.
- Each choice also carries our token fields, as chat's message does: `prompt_token_ids`,
  `generation_token_ids`, `generation_log_probs` (and vLLM's `token_ids` with `return_token_ids`), so that a
  token-in RL client (NeMo Gym's `vllm_model` with `use_completions_api: true`) gets exact ids and logprobs.
- `stream: true` streams the choices as Server-Sent Events (`completion_stream`), `stream_options.include_usage`
  as in chat; echo with logprobs is refused when streaming (the prompt is scored with the finished output).
- Parsing, tokenizing and shaping run in worker threads; generations are cancelled together (`generate_all`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from nemo_rl_ext.models.generation.interfaces import (
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
)
from nemo_rl_ext.serving.api_errors import ApiError, validation_api_error
from nemo_rl_ext.serving.choice_format import finite, generated_text, stop_reason, token_text
from nemo_rl_ext.serving.completion_schemas import CompletionRequest
from nemo_rl_ext.serving.completion_stream import CompletionStream
from nemo_rl_ext.serving.generate_all import generate_all
from nemo_rl_ext.serving.request_sampling import generation_configs
from nemo_rl_ext.serving.server_metrics import ServerMetrics
from nemo_rl_ext.serving.streaming import SseResponse


class PolicyService(Protocol):
    """What a text completion needs of the service answering it (`policy_server.PolicyService` is the one there is;
    declared here so that this module does not import the server that imports it)."""

    generation: GenerationInterface
    tokenizer: Any
    """The policy's Hugging Face tokenizer."""
    options: Any
    """The server's `ServerOptions` (default sampling config, request timeout, served model name)."""
    metrics: ServerMetrics
    refused_prompts: Any
    """Counts the prompts refused for context length (`policy_server.RefusedPrompts`)."""

    @property
    def max_model_len(self) -> int: ...


@dataclass(frozen=True)
class TextPrompt:
    """One prompt of a text completion request."""

    token_ids: list[int]
    """Its ids: the request's own, or its string tokenized."""
    text: str
    """Its text: the request's string, or its ids decoded (what `echo` puts before the completion)."""
    configs: list[GenerationConfig]
    """One generation config per choice (`n`)."""


async def text_completion(
    service: PolicyService, body: dict[str, Any], received_at: float | None = None
) -> dict | SseResponse:
    """Answer one `/v1/completions` body for `service` (its backend, tokenizer, options and metrics); with
    `stream: true`, the SSE response of `completion_stream`."""
    received_at = time.monotonic() if received_at is None else received_at
    request, prompts = await asyncio.to_thread(_prepare, service, body)
    if request.stream:
        return CompletionStream(
            service, request, prompts, received_at,
            answer=lambda index, out: _choice(service, request, index, prompts[index // request.n], out),
            logprobs=lambda rows, offset: completion_logprobs(
                service.tokenizer, list(rows), request.return_tokens_as_token_ids, offset),
        ).response()
    started = time.monotonic()
    jobs = [(p.token_ids, c) for p in prompts for c in p.configs]
    outputs = await generate_all(service.generation, jobs, service.options.request_timeout_s, "prompt")
    if request.scores_only:
        outputs = [_prompt_only(out) for out in outputs]
    answer = await asyncio.to_thread(_answer, service, request, prompts, outputs)
    service.metrics.completion(received_at, started, outputs, sum(len(p.token_ids) for p in prompts))
    return answer


def _prepare(service: PolicyService, body: dict[str, Any]) -> tuple[CompletionRequest, list[TextPrompt]]:
    """Validate the request and build each prompt's ids and its choices' generation configs."""
    try:
        request = CompletionRequest.model_validate(body)
    except ValidationError as err:  # one 400 naming every bad field
        raise validation_api_error(err) from None
    request.check_supported()
    tokenizer = service.tokenizer
    # max_tokens 0: the engine generates one token (its prefill scores the prompt), which `_prompt_only` drops
    sampling = request.model_copy(update={"max_tokens": 1}) if request.scores_only else request
    top = request.logprobs or 0
    scored = top if request.echo and request.logprobs is not None else None
    prompts = []
    for i, prompt in enumerate(request.prompts()):
        if isinstance(prompt, str):
            ids = list(tokenizer(prompt, add_special_tokens=request.add_special_tokens)["input_ids"])
            text = prompt
        else:
            ids, text = list(prompt), tokenizer.decode(prompt, skip_special_tokens=False) if request.echo else ""
        where = "prompt" if isinstance(request.prompt, str) or _is_flat_ids(request.prompt) else f"prompt.{i}"
        if not ids:
            raise ApiError(f"{where}: the prompt is empty (no tokens)", param=where)
        if len(ids) >= service.max_model_len:  # refused below: recorded for the rollouts to report
            service.refused_prompts.add(len(ids))
        configs = generation_configs(
            sampling, len(ids), service.max_model_len, service.options.default_config,
            prompt_field=where, top_logprobs=top, prompt_logprobs=scored,
        )
        prompts.append(TextPrompt(ids, text, configs))
    return request, prompts


def _prompt_only(out: GenerationOutput) -> GenerationOutput:
    """`out` without its generated tokens (`max_tokens: 0`): the prompt's logprobs only, finished for length."""
    return dataclasses.replace(
        out, output_ids=(), logprobs=(), top_logprobs=None if out.top_logprobs is None else (),
        finish_reason=FinishReason.MAX_NEW_TOKENS, matched_stop=None,
    )


def _is_flat_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def _answer(
    service: PolicyService, request: CompletionRequest, prompts: list[TextPrompt], outputs: list[GenerationOutput]
) -> dict[str, Any]:
    """The text_completion object: choice prompt_index * n + j for prompt prompt_index's j-th output."""
    choices = [
        _choice(service, request, index, prompts[index // request.n], out) for index, out in enumerate(outputs)
    ]
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(o.output_ids) for o in outputs)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": service.options.served_model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "system_fingerprint": None,
    }


def _choice(
    service: PolicyService, request: CompletionRequest, index: int, prompt: TextPrompt, out: GenerationOutput
) -> dict[str, Any]:
    ids, logprobs = list(out.output_ids), [finite(lp) for lp in out.logprobs]
    text = generated_text(service.tokenizer, out, request.skip_special_tokens)
    choice: dict[str, Any] = {
        "index": index,
        "text": prompt.text + text if request.echo else text,
        "logprobs": None if request.logprobs is None else _logprobs(service, request, prompt, out),
        "finish_reason": out.finish_reason.openai,
        "stop_reason": stop_reason(out),
        "prompt_token_ids": list(prompt.token_ids),
        "generation_token_ids": ids,
        "generation_log_probs": logprobs,
    }
    if request.return_token_ids:
        choice["token_ids"] = ids
    return choice


def _logprobs(service: PolicyService, request: CompletionRequest, prompt: TextPrompt, out: GenerationOutput) -> dict:
    """OpenAI's completions logprobs of a choice; with echo the prompt's tokens first (the first unscored)."""
    rows: list[tuple[int, float | None, Any]] = []
    if request.echo:
        scores = out.prompt_logprobs or ()
        tops = out.prompt_top_logprobs or ((),) * len(scores)
        rows.append((prompt.token_ids[0], None, None))
        rows.extend(zip(prompt.token_ids[1:], scores, tops, strict=True))
    rows.extend(zip(out.output_ids, out.logprobs, out.top_logprobs or ((),) * len(out.output_ids), strict=True))
    return completion_logprobs(service.tokenizer, rows, request.return_tokens_as_token_ids)[0]


def completion_logprobs(
    tokenizer: Any, rows: Sequence[tuple[int, float | None, Any]], as_token_ids: bool, offset: int = 0
) -> tuple[dict, int]:
    """OpenAI's completions `logprobs` of (token id, logprob or None, top alternatives) rows: tokens,
    token_logprobs, top_logprobs (the alternatives plus the chosen token, as OpenAI and vLLM give; None where
    the logprob is None) and text_offset (from `offset`); and the offset after the last token."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, logprob, top in rows:
        token = token_text(tokenizer, token_id, as_token_ids)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        token_logprobs.append(None if logprob is None else finite(logprob))
        if logprob is None:
            top_logprobs.append(None)
            continue
        alternatives = {token_text(tokenizer, t, as_token_ids): finite(lp) for t, lp in top or ()}
        alternatives.setdefault(token, finite(logprob))
        top_logprobs.append(alternatives)
    logprobs = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return logprobs, offset
