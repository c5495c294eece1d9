"""Tokens decoded on an engine's thread, read as `TokenDelta`s on the caller's event loop.

A backend's `generate_stream` makes one `TokenQueue` per streamed request: the engine calls `put` (from any
thread) as it samples, and the caller iterates `events(result)` until the request's result resolves. Tokens
that piled up while the caller was busy come out as one delta. Requests nobody streams never make one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from nemo_rl_ext.models.generation.interfaces import GenerationOutput, StreamEvent, TokenDelta, TopLogprobs

_END = object()
"""Queued once the result has resolved: every token put before it is already in the queue."""


class TokenQueue:
    """One streamed request's tokens, from the engine to the caller's loop (create it on that loop)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(
        self, token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[TopLogprobs] | None = None
    ) -> None:
        """Hand over newly sampled tokens (and their top alternatives, when asked); callable from any thread,
        never raises (a closed loop drops them)."""
        item = (tuple(token_ids), tuple(logprobs), None if tops is None else tuple(tops))
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is reading
            pass

    def put_token(self, token_id: int, logprob: float, top: TopLogprobs | None = None) -> None:
        """`put` for one token (the hf engine's per-row hook)."""
        self.put((token_id,), (logprob,), None if top is None else (top,))

    async def events(self, result: asyncio.Future[GenerationOutput]) -> AsyncIterator[StreamEvent]:
        """Deltas as they arrive, then `result`'s output (or its exception).

        `result` must resolve on this loop after the engine's last `put` was scheduled (a future the engine
        resolves with `call_soon_threadsafe` from the thread that puts, or a task awaiting one).
        """
        result.add_done_callback(lambda _: self._queue.put_nowait(_END))
        ended = False
        while not ended:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            if items[-1] is _END:
                ended = True
                items.pop()
            if items:
                tops = None if items[0][2] is None else tuple(t for _, _, ts in items for t in ts or ())
                yield TokenDelta(
                    tuple(t for ids, _, _ in items for t in ids), tuple(lp for _, lps, _ in items for lp in lps), tops
                )
        yield result.result()
