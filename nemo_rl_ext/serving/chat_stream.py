"""Streamed chat completions (`stream: true`): OpenAI's `chat.completion.chunk` events over SSE.

Per choice: a first chunk with the role, then content deltas as tokens are decoded (with their logprobs when
asked), tool calls as tool-call deltas once their `<tool_call>` block has closed and parsed (text before it
as content), and a last chunk that carries whatever is left, `finish_reason`, and our token fields
(`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`) in its delta. That last chunk is cut
from the non-streamed answer of the same output (`PolicyService._choice`): a client that joins the deltas
gets exactly the message, tool calls, logprobs and ids a non-streamed request would have got. With `n > 1`
the choices' chunks interleave, each tagged with its index. `stream_options.include_usage` adds a chunk with
no choices and the usage; `data: [DONE]` ends every stream, after an error event if generation failed.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from nemo_rl_ext.data.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, parse_tool_calls
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationOutput, TokenDelta
from nemo_rl_ext.serving.openai_schemas import TOKEN_FIELDS, ChatCompletionRequest
from nemo_rl_ext.serving.streaming import StreamedCompletion, TextStream

logger = logging.getLogger(__name__)

ROUTE = "/v1/chat/completions"
"""The route whose streams this module answers (the label of its metrics)."""


def tool_call_dict(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI tool call with a fresh id (`arguments` as a JSON string)."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


class ToolCallStream:
    """Splits a choice's text, as it arrives, into content and Hermes tool calls, as `parse_tool_calls` would
    split the whole text: a closed `<tool_call>` block that parses becomes a call, any other text is content.

    Content is sent only where it cannot differ from the final content: the final content is the whole text
    when no call parses, and the text without the calls, stripped, when one does. So whitespace at the end
    waits for more text, a possible `<tool_call>` tag waits until it is or is not one, and leading whitespace
    waits until a call parses (or the end). What is held here is sent with the last chunk.
    """

    def __init__(self) -> None:
        self._pending = ""  # text not yet split
        self._held = ""  # content not yet sent (whitespace that may be stripped, or all of it while undecided)
        self._started = False  # some content was sent
        self._calls = 0  # calls parsed so far

    def add(self, text: str) -> tuple[str, list[ToolCall]]:
        """Take more text; return the content that can be sent now and the calls that parsed."""
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            start = self._pending.find(TOOL_CALL_OPEN)
            if start == -1:
                cut = len(self._pending) - _partial_tag(self._pending)
                content.append(self._content(self._pending[:cut]))
                self._pending = self._pending[cut:]
                return "".join(content), calls
            content.append(self._content(self._pending[:start]))
            self._pending = self._pending[start:]
            close = self._pending.find(TOOL_CALL_CLOSE)
            if close == -1:
                return "".join(content), calls  # the block is still open
            end = close + len(TOOL_CALL_CLOSE)
            block, self._pending = self._pending[:end], self._pending[end:]
            parsed = parse_tool_calls(block)
            if parsed.calls:
                calls.extend(parsed.calls)
                self._calls += len(parsed.calls)
            else:  # malformed: it stays in the content, as in the non-streamed answer
                content.append(self._content(block))

    def _content(self, piece: str) -> str:
        self._held += piece
        if not self._started:
            if self._calls:
                self._held = self._held.lstrip()  # a call parsed: the content is stripped
            elif self._held[:1].isspace():
                return ""  # stripped only if a call parses: wait
        body = self._held.rstrip()
        if not body:
            return ""
        self._held = self._held[len(body) :]
        self._started = True
        return body


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that begins `<tool_call>` (0 if none)."""
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return k
    return 0


class _ChoiceStream:
    """The chunks of one choice: its deltas as tokens arrive, then the rest of its non-streamed answer."""

    def __init__(self, index: int, request: ChatCompletionRequest, config: GenerationConfig, tokenizer) -> None:
        self.index = index
        self._request = request
        self._text = TextStream(
            tokenizer,
            skip_special_tokens=request.skip_special_tokens,
            stop_strings=config.stop_strings,
            hold_ids={*config.stop_token_ids, *tokenizer.all_special_ids},
        )
        self._tools = ToolCallStream() if request.parses_tool_calls else None
        self._ids: list[int] = []
        self._content = ""
        self._calls: list[dict[str, Any]] = []

    def role(self) -> dict[str, Any]:
        """The first chunk's choice. Its delta has no `content`: the joined content then stays null for an answer
        of tool calls alone, as in the non-streamed message (an empty content is sent as "" by `last`)."""
        return {"index": self.index, "delta": {"role": "assistant"}, "logprobs": None, "finish_reason": None}

    def delta(self, event: TokenDelta, logprobs: Callable[[TokenDelta], dict]) -> dict[str, Any] | None:
        """The choice of one delta's chunk; None when it has nothing to say yet."""
        self._ids.extend(event.output_ids)
        text = self._text.add(event.output_ids)
        content, calls = (text, []) if self._tools is None else self._tools.add(text)
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
            self._content += content
        if calls:
            new = [tool_call_dict(c.name, c.arguments) for c in calls]
            delta["tool_calls"] = [{"index": len(self._calls) + k, **c} for k, c in enumerate(new)]
            self._calls.extend(new)
        request = self._request
        if not (delta or request.logprobs or request.return_token_ids):
            return None
        choice = {"index": self.index, "delta": delta, "finish_reason": None,
                  "logprobs": logprobs(event) if request.logprobs else None}
        if request.return_token_ids:
            choice["token_ids"] = list(event.output_ids)
        return choice

    def last(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The last chunk's choice: `answer` (the non-streamed choice of the output) minus what was sent."""
        message, sent = answer["message"], len(self._ids)
        delta: dict[str, Any] = {}
        content = message["content"]  # None: tool calls alone
        if not (content or "").startswith(self._content):
            logger.warning("choice %d: streamed content %r is not a prefix of the final content %r",
                           self.index, self._content[-80:], (content or "")[-80:])
        elif content is not None and (len(content) > len(self._content) or not self._content):
            delta["content"] = content[len(self._content) :]  # "" when the answer is empty text
        calls = message["tool_calls"]
        if [c["function"] for c in calls[: len(self._calls)]] != [c["function"] for c in self._calls]:
            logger.warning("choice %d: streamed tool calls differ from the final ones", self.index)
        if len(calls) > len(self._calls):
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls) if k >= len(self._calls)]
        delta.update({key: message[key] for key in TOKEN_FIELDS})
        logprobs = answer["logprobs"]
        choice = {
            "index": self.index,
            "delta": delta,
            "logprobs": None if logprobs is None else {**logprobs, "content": logprobs["content"][sent:]},
            "finish_reason": answer["finish_reason"],
            "stop_reason": answer["stop_reason"],
        }
        if "token_ids" in answer:
            choice["token_ids"] = answer["token_ids"][sent:]
        return choice


class ChatStream(StreamedCompletion):
    """One streamed chat completion: `response()` is its SSE response (the request was validated)."""

    OBJECT = "chat.completion.chunk"
    ID_PREFIX = "chatcmpl"
    ROUTE = ROUTE
    KIND = "chat completion"

    def __init__(
        self,
        service,
        request: ChatCompletionRequest,
        prompt_ids: list[int],
        configs: list[GenerationConfig],
        received_at: float,
        *,
        answer: Callable[[int, GenerationOutput], dict[str, Any]],
        logprobs: Callable[[TokenDelta], dict[str, Any]],
    ) -> None:
        """`service`: the `PolicyService` (its generation, tokenizer, options, metrics); `answer(index, output)`:
        the non-streamed choice of an output; `logprobs(delta)`: the choice `logprobs` of a delta's tokens."""
        super().__init__(service, request, [(prompt_ids, c) for c in configs], received_at, answer)
        self._prompt_ids, self._logprobs = prompt_ids, logprobs
        self._choices = [_ChoiceStream(i, request, c, service.tokenizer) for i, c in enumerate(configs)]

    def _opening(self) -> Iterable[str]:
        first = {"prompt_token_ids": list(self._prompt_ids)} if self._request.return_token_ids else {}
        for choice in self._choices:
            yield self._chunk([choice.role()], **(first if choice.index == 0 else {}))

    def _delta(self, index: int, delta: TokenDelta) -> dict[str, Any] | None:
        return self._choices[index].delta(delta, self._logprobs)

    def _last(self, index: int, answer: dict[str, Any]) -> dict[str, Any] | None:
        return self._choices[index].last(answer)

    def _prompt_tokens(self) -> int:
        return len(self._prompt_ids)
