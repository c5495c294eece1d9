"""The policy server's request handling, without HTTP: `PolicyService` (chat completions, text completions,
`/tokenize`, `/v1/models`) and the `ServerOptions` it answers with. `policy_server` puts it behind its routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.data.tool_calls import parse_tool_calls
from nemo_rl_ext.models.generation.interfaces import (
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
)
from nemo_rl_ext.serving.api_errors import ApiError, validation_api_error
from nemo_rl_ext.serving.chat_prompt import ChatPrompt, build_chat_prompt
from nemo_rl_ext.serving.chat_stream import ChatStream, tool_call_dict
from nemo_rl_ext.serving.choice_format import chat_logprobs, finite, generated_text, stop_reason
from nemo_rl_ext.serving.completions import text_completion
from nemo_rl_ext.serving.generate_all import generate_all
from nemo_rl_ext.serving.openai_schemas import ChatCompletionRequest, TokenizePromptRequest, TokenizeRequest
from nemo_rl_ext.serving.request_guards import DEFAULT_MAX_REQUEST_BYTES
from nemo_rl_ext.serving.server_metrics import ServerMetrics


@dataclass(frozen=True)
class ServerOptions:
    """How the policy server answers: one set of options for `PolicyService`, `create_app`, `PolicyServer` and
    the CLI (each also takes them as keyword arguments, see `server_options`)."""

    served_model_name: str = "policy"
    """The model's name in `/v1/models` and in every response."""
    default_config: GenerationConfig | None = None
    """Fills in the sampling fields a request leaves out; None: an absent max_tokens means "up to
    max_model_len", as in vLLM."""
    request_timeout_s: float | None = None
    """Bounds one request's generation (a 504 after it); None: no bound."""
    api_key: str | None = None
    """When set, every route but `/health` and `/metrics` wants `Authorization: Bearer <api_key>` (a 401
    otherwise)."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Larger request bodies get a 413."""
    trust_request_chat_template: bool = False
    """Accept a `chat_template` sent with a request (top level or in `chat_template_kwargs`); a 400 otherwise
    (templates run loops)."""


def server_options(options: ServerOptions | None = None, **fields: Any) -> ServerOptions:
    """`options` (default: `ServerOptions()`) with `fields` replaced; unknown names are one TypeError naming them."""
    known = {f.name for f in dataclasses.fields(ServerOptions)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unknown policy-server option(s) {unknown}; known: {sorted(known)}")
    return dataclasses.replace(options or ServerOptions(), **fields)


class RefusedPrompts:
    """The chat prompts a `PolicyService` refused because they alone filled the context (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        """How many were refused."""
        self.longest: int | None = None
        """The longest of them, in tokens (None: none yet)."""

    def add(self, prompt_tokens: int) -> None:
        """Record one refused prompt of `prompt_tokens` tokens."""
        with self._lock:
            self.count += 1
            self.longest = max(self.longest or 0, prompt_tokens)


class PolicyService:
    """The request handling behind the HTTP routes; usable without a server (tests, other frontends)."""

    def __init__(
        self,
        generation: GenerationInterface,
        tokenizer: PreTrainedTokenizerBase,
        options: ServerOptions | None = None,
        **option_fields: Any,
    ) -> None:
        """`options` and `option_fields` as in `server_options` (api_key and max_request_bytes are the app's)."""
        self.generation = generation
        self.tokenizer = tokenizer
        self.options = server_options(options, **option_fields)
        self.created = int(time.time())
        self.metrics = ServerMetrics(generation)
        """This service's Prometheus metrics (what `/metrics` serves)."""
        self.refused_prompts = RefusedPrompts()
        """The prompts refused for context length (their count and the longest)."""

    @property
    def max_model_len(self) -> int:
        """The backend's context length."""
        return self.generation.max_model_len

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """`/tokenize`: chat form (`messages`) → the completion's prompt ids; prompt form → plain ids.

        Blocking (template rendering, tokenization): the HTTP route runs it in a worker thread.
        """
        if "messages" in body:
            request = _parse(TokenizeRequest, body)
            ids = self._prompt(request).token_ids
        elif "prompt" in body:
            request = _parse(TokenizePromptRequest, body)
            ids = list(
                self.tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)["input_ids"]
            )
        else:
            raise ApiError("a tokenize request needs 'messages' (chat form) or 'prompt'", param="messages")
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def chat_completion(self, body: dict[str, Any], received_at: float | None = None) -> dict[str, Any] | Response:
        """`/v1/chat/completions`: build the prompt, generate `n` choices concurrently, shape the answer.

        The prompt is built and the answer shaped in worker threads, so a huge or slow request never
        holds up the event loop (and the other requests and `/health` behind it). `received_at`
        (`time.monotonic()`, default now) starts the request's latency and time to first token in `metrics`.
        """
        received_at = time.monotonic() if received_at is None else received_at
        request, prompt, configs = await asyncio.to_thread(self._prepare, body)
        if request.stream:
            as_ids = request.return_tokens_as_token_ids
            return ChatStream(
                self, request, prompt.token_ids, configs, received_at,
                answer=lambda index, out: self._choice(index, out, prompt, request),
                logprobs=lambda delta: chat_logprobs(self.tokenizer, delta, as_ids),
            ).response()
        generate_started_at = time.monotonic()
        outputs = await self._generate(prompt.token_ids, configs)
        answer = await asyncio.to_thread(self._answer, request, prompt, outputs)
        self.metrics.completion(received_at, generate_started_at, outputs, len(prompt.token_ids))
        return answer

    async def text_completion(
        self, body: dict[str, Any], received_at: float | None = None
    ) -> dict[str, Any] | Response:
        """`/v1/completions` (OpenAI text completions): see `completions.text_completion`."""
        return await text_completion(self, body, received_at)

    def _prompt(self, request: TokenizeRequest | ChatCompletionRequest) -> ChatPrompt:
        return build_chat_prompt(
            self.tokenizer, request, trust_request_chat_template=self.options.trust_request_chat_template
        )

    def _prepare(
        self, body: dict[str, Any]
    ) -> tuple[ChatCompletionRequest, ChatPrompt, list[GenerationConfig]]:
        """Validate a completion request, build its prompt and one generation config per choice."""
        request = _parse(ChatCompletionRequest, body)
        request.check_supported()
        prompt = self._prompt(request)
        required = request.required_prefix_token_ids
        if required is not None and prompt.token_ids[: len(required)] != required:
            raise ApiError(
                f"the prompt built from the messages ({len(prompt.token_ids)} ids) does not start with the "
                f"{len(required)} required_prefix_token_ids (first difference at position "
                f"{_first_difference(prompt.token_ids, required)})",
                param="required_prefix_token_ids",
            )
        if len(prompt.token_ids) >= self.max_model_len:  # refused below: recorded for the rollouts to report
            self.refused_prompts.add(len(prompt.token_ids))
        configs = request.generation_configs(len(prompt.token_ids), self.max_model_len, self.options.default_config)
        return request, prompt, configs

    def _answer(
        self, request: ChatCompletionRequest, prompt: ChatPrompt, outputs: list[GenerationOutput]
    ) -> dict[str, Any]:
        """The chat.completion object of finished generations."""
        choices = [self._choice(i, out, prompt, request) for i, out in enumerate(outputs)]
        completion_tokens = sum(len(o.output_ids) for o in outputs)
        response: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.options.served_model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt.token_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt.token_ids) + completion_tokens,
            },
            "system_fingerprint": None,
        }
        if request.return_token_ids:
            response["prompt_token_ids"] = list(prompt.token_ids)
        return response

    def models(self) -> dict[str, Any]:
        """`/v1/models`: the one served model."""
        card = {
            "id": self.options.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "nemo_rl_ext",
            "root": self.options.served_model_name,
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def _generate(
        self, prompt_ids: list[int], configs: list[GenerationConfig]
    ) -> list[GenerationOutput]:
        """Every choice's generation; when one fails, or time runs out, the others are cancelled."""
        jobs = [(prompt_ids, c) for c in configs]
        return await generate_all(self.generation, jobs, self.options.request_timeout_s)

    def _choice(
        self, index: int, out: GenerationOutput, prompt: ChatPrompt, request: ChatCompletionRequest
    ) -> dict[str, Any]:
        ids, logprobs = list(out.output_ids), [finite(lp) for lp in out.logprobs]
        text = generated_text(self.tokenizer, out, request.skip_special_tokens)
        finish_reason = out.finish_reason.openai
        content: str | None = text
        tool_calls: list[dict[str, Any]] = []
        if request.parses_tool_calls:
            parsed = parse_tool_calls(text)
            if parsed.calls:
                content = parsed.content or None
                tool_calls = [tool_call_dict(c.name, c.arguments) for c in parsed.calls]
                finish_reason = "tool_calls"
        message = {
            "role": "assistant",
            "content": content,
            "tool_calls": tool_calls,
            "prompt_token_ids": list(prompt.token_ids),
            "generation_token_ids": ids,
            "generation_log_probs": logprobs,
        }
        choice: dict[str, Any] = {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(self.tokenizer, out, request.return_tokens_as_token_ids)
            if request.logprobs
            else None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason(out),
        }
        if request.return_token_ids:
            choice["token_ids"] = ids
        return choice


def _parse(model: type, body: dict[str, Any]):
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise validation_api_error(err) from None


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
