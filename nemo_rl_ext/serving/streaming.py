"""Server-Sent Events for the policy server's streamed answers (`stream: true`), for any streaming route.

- `StreamOptions`: a request's `stream_options` (unknown keys and non-bool values are refused by validation).
- `choice_events`: the `n` generations of one request, each through the backend's `generate_stream`,
  merged into one sequence of `(choice index, event)` under the request's deadline. Closing it (the client
  went away, the route failed) cancels every generation: the engine drops their rows at its next decode step.
- `TextStream`: one choice's text as its tokens arrive, released only where it cannot differ from the text
  of the finished generation (see its docstring); the route sends the rest with the final chunk.
- `sse`, `SSE_DONE`, `SseResponse`: the wire format (`data: <json>\\n\\n` events, then `data: [DONE]`).
- `StreamedCompletion`: the frame every streamed route shares (opening chunks, the choices' chunks as their
  events come, an error event, usage, `[DONE]`, metrics and cancellation); `chat_stream` and
  `completion_stream` say what their chunks hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.grammar import GrammarError
from nemo_rl_ext.models.generation.interfaces import (
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    StreamEvent,
    TokenDelta,
)
from nemo_rl_ext.serving.api_errors import ApiError
from nemo_rl_ext.serving.response_format import schema_error

logger = logging.getLogger(__name__)

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
    client that goes away cancels the generations behind it (whichever way the server notices); then
    `on_close()`, if given, runs (the stream's count in the metrics: it is known only now)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                self._on_close()


class StreamedCompletion:
    """The frame of one streamed completion, whatever its route: the opening chunks, each choice's chunks as its
    generation's events come (`_delta` for a `TokenDelta`, `_last` for the output's non-streamed answer), then
    with `stream_options.include_usage` a usage chunk, and `[DONE]`. A generation that fails ends the stream with
    one error event and `[DONE]`; a stream closed early (the client went away) cancels the generations and is
    counted as a cancellation. Subclasses set the chunk's `OBJECT`, the id's `ID_PREFIX`, the `ROUTE` (metrics),
    `KIND` (logs) and `REFUSED_PARAM` (the field a backend's refusal names)."""

    OBJECT = ""
    ID_PREFIX = ""
    ROUTE = ""
    KIND = ""
    REFUSED_PARAM: str | None = None

    def __init__(self, service, request, jobs: list[tuple[Sequence[int], GenerationConfig]], received_at: float,
                 answer: Callable[[int, GenerationOutput], dict[str, Any]]) -> None:
        """`service`: the `PolicyService`; `jobs`: each choice's (prompt ids, config); `answer(index, output)`:
        the non-streamed choice of an output."""
        self._service, self._request, self._jobs, self._received_at = service, request, jobs, received_at
        self._answer = answer
        self._id, self._created = f"{self.ID_PREFIX}-{uuid.uuid4().hex}", int(time.time())
        self._include_usage = bool(request.stream_options and request.stream_options.include_usage)
        self._ended = False
        """The stream ran to its end ([DONE], after the answer or an error event)."""

    def response(self) -> SseResponse:
        """The response that streams this completion."""
        return SseResponse(self.events(), on_close=self._count)

    def _count(self) -> None:
        """Count the stream once it is over: 200 when it ran to its end, else 499 and a cancellation (the client
        went away: mid-stream, or before the first event, when the event generator never even started)."""
        metrics = self._service.metrics
        if self._ended:
            metrics.answered(self.ROUTE, 200)
        else:
            metrics.cancel(self.ROUTE, "client_disconnect", time.monotonic() - self._received_at)
            metrics.answered(self.ROUTE, 499)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {"id": self._id, "object": self.OBJECT, "created": self._created,
                 "model": self._service.options.served_model_name, "choices": choices}
        if self._include_usage:
            chunk["usage"] = None
        return sse({**chunk, **extra})

    def _opening(self) -> Iterable[str]:
        """The chunks sent before any token."""
        return ()

    def _delta(self, index: int, delta: TokenDelta) -> dict[str, Any] | None:
        """The choice of one delta's chunk; None when it has nothing to say yet."""
        raise NotImplementedError

    def _last(self, index: int, answer: dict[str, Any]) -> dict[str, Any] | None:
        """The choice of the last chunk of choice `index`, from its non-streamed `answer`."""
        raise NotImplementedError

    def _prompt_tokens(self) -> int:
        """The request's prompt tokens (usage and metrics)."""
        raise NotImplementedError

    async def events(self) -> AsyncIterator[str]:
        """Every event of the stream; closing it early cancels the generations."""
        outputs: list[GenerationOutput | None] = [None] * len(self._jobs)
        started = time.monotonic()
        self._service.metrics.in_progress.inc()  # the route counted it until it returned this response
        try:
            for chunk in self._opening():
                yield chunk
            async with contextlib.aclosing(self._chunks(outputs)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except ApiError as err:
            self._ended = True  # the HTTP answer (200) is complete once the error event is out
            yield sse(err.body())
            yield SSE_DONE
            return
        finally:
            self._service.metrics.in_progress.dec()
        prompt_tokens = self._prompt_tokens()
        done = [o for o in outputs if o is not None]
        if self._include_usage:
            yield self._chunk([], usage=usage(prompt_tokens, sum(len(o.output_ids) for o in done)))
        self._ended = True  # every generation has finished: a client gone before [DONE] missed nothing
        self._service.metrics.completion(self._received_at, started, done, prompt_tokens)
        yield SSE_DONE

    async def _chunks(self, outputs: list[GenerationOutput | None]) -> AsyncIterator[str]:
        """The chunks of every choice's deltas and ends; a failed generation is an `ApiError`."""
        timeout_s = self._service.options.request_timeout_s
        try:
            async with contextlib.aclosing(job_events(self._service.generation, self._jobs, timeout_s)) as events:
                async for index, event in events:
                    if isinstance(event, TokenDelta):
                        choice = self._delta(index, event)
                    else:
                        outputs[index] = event
                        choice = self._last(index, await asyncio.to_thread(self._answer, index, event))
                    if choice is not None:
                        yield self._chunk([choice])
        except TimeoutError:
            self._service.metrics.cancel(self.ROUTE, "timeout", time.monotonic() - self._received_at)
            raise ApiError(f"generation did not finish within request_timeout_s={timeout_s}", status_code=504) from None
        except GrammarError as exc:  # a schema the grammar failed on mid-generation: this stream alone ends
            raise schema_error(exc) from exc
        except ValueError as exc:  # the backend's "bad input" (e.g. ids outside the vocabulary)
            raise ApiError(f"the backend refused the request: {exc}", param=self.REFUSED_PARAM) from exc
        except Exception as exc:
            logger.exception("a streamed %s failed", self.KIND)
            raise ApiError(f"{type(exc).__name__}: {exc}", status_code=500) from exc

