"""Streamed text completions (`POST /v1/completions` with `stream: true`) as Server-Sent Events.

OpenAI's `text_completion` chunks: each choice's text as its tokens arrive (held back where it could still differ
from the finished text: `streaming.TextStream`), with the delta's `logprobs` in the completions format when
asked, then a last chunk per choice with the rest of the non-streamed choice's text, its `finish_reason` and our
token fields (`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`), so that joining the chunks
gives what a non-streamed request gets; then, with `stream_options.include_usage`, a usage chunk, and
`data: [DONE]`. With `echo` each choice's first chunk holds its prompt's text (echo with `logprobs` scores the
prompt from the prefill, which only the finished output carries: refused when streaming). Choices of every
prompt stream concurrently, each tagged with its index (`prompt_index * n + j`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationOutput, TokenDelta
from nemo_rl_ext.serving.completion_schemas import CompletionRequest
from nemo_rl_ext.serving.streaming import StreamedCompletion, TextStream

logger = logging.getLogger(__name__)

ROUTE = "/v1/completions"
TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class _ChoiceStream:
    """The chunks of one choice: its text and logprobs as tokens arrive, then the rest of its answer."""

    def __init__(self, index: int, request: CompletionRequest, config: GenerationConfig, tokenizer,
                 logprobs: Callable) -> None:
        self.index, self._request, self._logprobs = index, request, logprobs
        self._text = TextStream(tokenizer, skip_special_tokens=request.skip_special_tokens,
                                stop_strings=config.stop_strings,
                                hold_ids={*config.stop_token_ids, *tokenizer.all_special_ids})
        self._sent_text, self._sent_ids, self._offset = "", 0, 0

    def first(self, prompt_text: str) -> dict[str, Any] | None:
        """The echoed prompt's chunk (None without echo)."""
        if not self._request.echo:
            return None
        self._sent_text, self._offset = prompt_text, len(prompt_text)
        return self._choice(prompt_text, None)

    def delta(self, event: TokenDelta) -> dict[str, Any] | None:
        """The choice of one delta's chunk; None when it has nothing to say yet."""
        text = self._text.add(event.output_ids)
        self._sent_text += text
        logprobs = None
        if self._request.logprobs is not None:
            tops = event.top_logprobs or ((),) * len(event.output_ids)
            logprobs, self._offset = self._logprobs(zip(event.output_ids, event.logprobs, tops, strict=True),
                                                    self._offset)
        self._sent_ids += len(event.output_ids)
        if not (text or logprobs or self._request.return_token_ids):
            return None
        choice = self._choice(text, logprobs)
        if self._request.return_token_ids:
            choice["token_ids"] = list(event.output_ids)
        return choice

    def last(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The last chunk's choice: `answer` (the non-streamed choice of the output) minus what was sent."""
        text = answer["text"]
        if not text.startswith(self._sent_text):
            logger.warning("choice %d: streamed text %r is not a prefix of the final text %r",
                           self.index, self._sent_text[-80:], text[-80:])
        choice = self._choice(text[len(self._sent_text):] if text.startswith(self._sent_text) else "", None)
        sent = self._sent_ids
        if answer["logprobs"] is not None:
            choice["logprobs"] = {key: values[sent:] for key, values in answer["logprobs"].items()}
        choice.update({"finish_reason": answer["finish_reason"], "stop_reason": answer["stop_reason"]})
        choice.update({key: answer[key] for key in TOKEN_FIELDS})
        if "token_ids" in answer:
            choice["token_ids"] = answer["token_ids"][sent:]
        return choice

    def _choice(self, text: str, logprobs: dict | None) -> dict[str, Any]:
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": None}


class CompletionStream(StreamedCompletion):
    """One streamed text completion: `response()` is its SSE response (the request was validated)."""

    OBJECT = "text_completion"
    ID_PREFIX = "cmpl"
    ROUTE = ROUTE
    KIND = "text completion"
    REFUSED_PARAM = "prompt"

    def __init__(self, service, request: CompletionRequest, prompts: list, received_at: float, *,
                 answer: Callable[[int, GenerationOutput], dict[str, Any]], logprobs: Callable) -> None:
        """`service`: the `PolicyService`; `prompts`: the request's `completions.TextPrompt`s; `answer(index,
        output)`: the non-streamed choice of an output; `logprobs(rows, offset)`: the completions logprobs of
        (id, logprob, top) rows from a text offset, and the offset after them."""
        jobs = [(p.token_ids, c) for p in prompts for c in p.configs]
        super().__init__(service, request, jobs, received_at, answer)
        self._prompts = prompts
        self._choices = [_ChoiceStream(i, request, c, service.tokenizer, logprobs) for i, (_, c) in enumerate(jobs)]

    def _opening(self) -> Iterable[str]:
        for choice in self._choices:
            first = choice.first(self._prompts[choice.index // self._request.n].text)
            if first is not None:
                yield self._chunk([first])

    def _delta(self, index: int, delta: TokenDelta) -> dict[str, Any] | None:
        return self._choices[index].delta(delta)

    def _last(self, index: int, answer: dict[str, Any]) -> dict[str, Any] | None:
        return self._choices[index].last(answer)

    def _prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self._prompts)
