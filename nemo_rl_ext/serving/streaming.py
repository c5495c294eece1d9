"""Server-Sent Events for the policy server's streamed answers (`stream: true`), for any streaming route.

- `StreamOptions`: a request's `stream_options` (unknown keys and non-bool values are refused by validation).
- `choice_events`: the `n` generations of one request, each through the backend's `generate_stream`,
  merged into one sequence of `(choice index, event)` under the request's deadline. Closing it (the client
  went away, the route failed) cancels every generation: the engine drops their rows at its next decode step.
- `TextStream`: one choice's text as its tokens arrive, released only where it cannot differ from the text
  of the finished generation (see its docstring); the route sends the rest with the final chunk.
- `sse`, `SSE_DONE`, `SseResponse`: the wire format (`data: <json>\\n\\n` events, then `data: [DONE]`).

The chat route's chunks are built in `chat_stream`; a text-completions route reuses everything here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.interfaces import (
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    StreamEvent,
)

SSE_DONE = "data: [DONE]\n\n"
"""The event that ends every stream (after the usage chunk, or after an error event)."""
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Headers that keep proxies from buffering the events."""


class StreamOptions(BaseModel):
    """`stream_options` of a streamed request (OpenAI's); any other key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    """Send a last chunk with no choices and the request's `usage` (every chunk before it has `usage: null`)."""


def sse(payload: dict[str, Any]) -> str:
    """One Server-Sent Event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice_events(
    generation: GenerationInterface,
    prompt_ids: Sequence[int],
    configs: Sequence[GenerationConfig],
    timeout_s: float | None,
) -> AsyncIterator[tuple[int, StreamEvent]]:
    """Every choice's events as they come, tagged with the choice's index; ends after the last output.

    A generation that fails raises its error here (the others are cancelled), as `TimeoutError` once
    `timeout_s` has passed since the call. Each choice's events keep their order.
    """
    return job_events(generation, [(prompt_ids, config) for config in configs], timeout_s)


async def job_events(
    generation: GenerationInterface,
    jobs: Sequence[tuple[Sequence[int], GenerationConfig]],
    timeout_s: float | None,
) -> AsyncIterator[tuple[int, StreamEvent]]:
    """`choice_events` for (prompt ids, config) jobs of several prompts: each event tagged with its job's index."""
    queue: asyncio.Queue[tuple[int, StreamEvent | Exception]] = asyncio.Queue()

    async def run(index: int, prompt_ids: Sequence[int], config: GenerationConfig) -> None:
        try:
            async with contextlib.aclosing(generation.generate_stream(list(prompt_ids), config)) as events:
                async for event in events:
                    queue.put_nowait((index, event))
        except Exception as exc:  # the reader raises it; a cancellation is not an Exception and ends the task
            queue.put_nowait((index, exc))

    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    tasks = [asyncio.ensure_future(run(i, ids, c)) for i, (ids, c) in enumerate(jobs)]
    try:
        left = len(tasks)
        while left:
            wait = None if deadline is None else max(deadline - loop.time(), 0.0)
            index, event = await asyncio.wait_for(queue.get(), wait)
            if isinstance(event, Exception):
                raise event
            left -= isinstance(event, GenerationOutput)
            yield index, event
    finally:
        for task in tasks:
            task.cancel()  # no-op for finished ones; a running one closes its stream (the engine drops the row)
        await asyncio.gather(*tasks, return_exceptions=True)


class TextStream:
    """One choice's decoded text as its ids arrive, never ahead of the text of the finished generation.

    That text (see `PolicyService._choice`) leaves out the token that ended the generation and anything
    from a stop string on; so this holds back a last id that might be that token (`hold_ids`: the request's
    stop ids and the special ids), the last `len(longest stop string) - 1` characters (the start of a stop
    string), everything from a stop string found, and an incomplete UTF-8 character. Ids are decoded in a
    short window (the previous step's ids and the new ones), so the cost per step does not grow with the length.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool,
        stop_strings: Sequence[str] = (),
        hold_ids: Iterable[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(stop_strings)
        self._hold_chars = max((len(s) for s in self._stops), default=1) - 1
        self._hold_ids = frozenset(hold_ids)
        self._ids: list[int] = []
        self._prefix = 0  # the decode window starts here
        self._read = 0  # ids decoded into `text` so far
        self.text = ""
        """The text of the ids decoded so far."""
        self.released = 0
        """How many characters of `text` were released."""

    def add(self, ids: Sequence[int]) -> str:
        """Take new ids; return the text that can be sent now (possibly "")."""
        self._ids.extend(ids)
        end = len(self._ids)
        if end and self._ids[-1] in self._hold_ids:
            end -= 1
        if end > self._read:
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix : end])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before) :]
                self._prefix, self._read = self._read, end
        return self._release()

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _release(self) -> str:
        safe = len(self.text) - self._hold_chars
        if self._stops:
            start = max(self.released - self._hold_chars, 0)
            found = [i for i in (self.text.find(s, start) for s in self._stops) if i != -1]
            safe = min([safe, *found])
        if safe <= self.released:
            return ""
        out, self.released = self.text[self.released : safe], safe
        return out


class SseResponse(StreamingResponse):
    """A `text/event-stream` response whose event generator is always closed when the response ends, so a
    client that goes away cancels the generations behind it (whichever way the server notices)."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
