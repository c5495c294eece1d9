"""A simulated accelerator: a generation backend that sleeps per decode step instead of computing.

Each engine decodes at most `max_batch_size` requests at once, one token per `token_s` seconds (a batch
step costs the same whatever the batch holds, as on a GPU); further requests wait for a slot. It uses
almost no CPU, so a 2-core machine can host several of them and show how a replica pool scales.

A request generates `max_new_tokens` ids (`FinishReason.MAX_NEW_TOKENS`), or, with `length=`, as many as
`length(prompt ids, config)` says when that is fewer (`FinishReason.EOS`, the last id the tokenizer's EOS
when it has one). `LongTail(short, long, fraction)` is such a length: a fixed share of requests, picked
by a hash of the prompt ids and seed, is long. A request aborted by a weight update keeps its length: its
continuation (prompt + the ids made so far) generates the rest of it.

Weight updates take effect as on the real engines (the hf backend's engine thread, vLLM's
`pause(mode="wait")`): `update_weights` returns only once every request holding a slot has finished
(`in_flight="finish"`) or stopped at its next token (`"abort"`); requests that get a slot meanwhile wait
and run on the new version. So a refit in `finish` mode waits for the longest request in flight.

Its first output id is the engine's `tag` (by default the process id), so a caller can tell which
replica served a request; the other ids and the logprobs are a function of the prompt and the seed.
To ship it to Ray workers that may not import this package, pickle it by value:
`ray.cloudpickle.register_pickle_by_value(nemo_rl_ext.testing.sleep_engine)`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_rl_ext.models.generation.interfaces import (
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    InFlightPolicy,
    check_in_flight,
)

LengthFn = Callable[[Sequence[int], GenerationConfig], int]
"""How many tokens a request generates, from its prompt ids and config (capped at `max_new_tokens`)."""


@dataclass(frozen=True)
class LongTail:
    """Long-tail lengths: `fraction` of requests generate `long` tokens, the rest `short` (a `LengthFn`)."""

    short: int
    """Tokens of an ordinary request."""
    long: int
    """Tokens of a long one."""
    fraction: float = 0.1
    """Share of long requests, picked by a hash of the prompt ids and the seed (the same for every run)."""

    def __call__(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> int:
        key = zlib.crc32(json.dumps([list(prompt_token_ids), config.seed]).encode())
        return self.long if key % 10_000 < self.fraction * 10_000 else self.short


class SleepGeneration(GenerationInterface):
    """Sleeps `token_s` per generated token, `max_batch_size` requests at a time; see the module docstring.

    `update_weights` blocks until the requests holding a slot finished or stopped, so call it from another
    thread than the event loop they run on (as the asynchronous trainer and a Ray replica do); called on
    that loop while it has requests running, it raises RuntimeError instead of deadlocking. It waits at most
    `update_timeout_s`.
    """

    def __init__(self, token_s: float = 0.005, max_batch_size: int = 8, tag: int | None = None,
                 max_model_len: int = 4096, tokenizer: Any = None, length: LengthFn | None = None,
                 update_timeout_s: float = 300.0) -> None:
        self.token_s = token_s
        self.max_batch_size = max_batch_size
        self.tag = os.getpid() if tag is None else tag
        self.length = length
        self.update_timeout_s = update_timeout_s
        self._max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self._lock = threading.Condition()
        self._running: dict[asyncio.AbstractEventLoop, int] = {}
        """Requests holding a slot and decoding, per event loop."""
        self._updating = False
        """An update waits for the running requests; requests that get a slot meanwhile wait for it."""
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._continuations: dict[tuple[int, ...], int] = {}
        """Prompt + ids of an aborted request with a planned length -> the tokens it still has to make."""
        self._aborts = 0
        self._shut_down = False
        self.updates = 0
        """update_weights calls served (its `weight_version`)."""

    @property
    def tokenizer(self) -> Any:
        """None by default: a simulated engine serves ids only."""
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        """Most tokens a request may hold (only reported; the simulation never runs out of room)."""
        return self._max_model_len

    def _planned(self, prompt: tuple[int, ...], config: GenerationConfig) -> int | None:
        with self._lock:
            rest = self._continuations.pop(prompt, None)
        if rest is None and self.length is not None:
            rest = int(self.length(prompt, config))
        return rest

    async def generate_async(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        """Up to `max_new_tokens` ids after as many sleeps of `token_s`, once a batch slot is free (and no
        weight update is under way)."""
        self._check_open()
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.max_batch_size))
        prompt = tuple(prompt_token_ids)
        planned = self._planned(prompt, config)
        n, reason = config.max_new_tokens, FinishReason.MAX_NEW_TOKENS
        if planned is not None and planned < n:
            n, reason = max(1, planned), FinishReason.EOS
        base = (sum(prompt) + (config.seed or 0)) % 1000
        ids = [self.tag, *((base + i) % 1000 for i in range(1, n))]
        eos = getattr(self._tokenizer, "eos_token_id", None)
        if reason is FinishReason.EOS and isinstance(eos, int) and n > 1:
            ids[-1] = eos
        async with slots:
            version, aborts = await self._start(loop)
            try:
                for done in range(1, n + 1):
                    await asyncio.sleep(self.token_s)
                    if self._aborts != aborts and done < n:
                        if planned is not None:
                            with self._lock:
                                self._continuations[prompt + tuple(ids[:done])] = n - done
                        return GenerationOutput(tuple(ids[:done]), (-0.5,) * done, FinishReason.ABORTED,
                                                weight_version=version)
            finally:
                self._stop(loop)
        return GenerationOutput(tuple(ids), (-0.5,) * n, reason, weight_version=version)

    async def _start(self, loop: asyncio.AbstractEventLoop) -> tuple[int, int]:
        """Count the request as running once no update is under way; its version and the abort count."""
        while True:
            with self._lock:
                if not self._updating:
                    self._running[loop] = self._running.get(loop, 0) + 1
                    return self.updates, self._aborts
                applied: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, applied))
            await applied

    def _stop(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._running[loop] -= 1
            if not self._running[loop]:
                del self._running[loop]
                self._lock.notify_all()

    def update_weights(self, state_dict: Mapping[str, Any], *, in_flight: InFlightPolicy = "finish") -> None:
        """Serve the next version once the requests holding a slot finished (`"finish"`) or stopped at their
        next token (`"abort"`); see the class docstring."""
        self._check_open()
        check_in_flight(in_flight)
        try:
            here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        deadline = time.monotonic() + self.update_timeout_s
        with self._lock:
            while self._updating:  # one update at a time
                self._wait(deadline, "the previous weight update")
            if here is not None and self._running.get(here):
                raise RuntimeError(
                    f"SleepGeneration.update_weights was called on the event loop where {self._running[here]} "
                    "of its requests are running: they could never finish. Call it from another thread "
                    "(asyncio.to_thread / loop.run_in_executor), as the asynchronous trainer does."
                )
            self._updating = True
            try:
                if in_flight == "abort":
                    self._aborts += 1
                while self._running:
                    self._wait(deadline, f"{sum(self._running.values())} running request(s)")
                self.updates += 1
            finally:
                self._updating = False
                waiters, self._waiters = self._waiters, []
                self._lock.notify_all()
        for loop, applied in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, applied)
            except RuntimeError:  # that loop is closed: nothing waits there any more
                pass

    def _wait(self, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"SleepGeneration.update_weights waited {self.update_timeout_s} s for {what}")
        self._lock.wait(left)

    @property
    def weight_version(self) -> int:
        """0 at start, +1 per update_weights."""
        return self.updates

    def shutdown(self) -> None:
        """Idempotent; later calls raise RuntimeError."""
        self._shut_down = True

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("this SleepGeneration was shut down")


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def make_sleep_engine(token_s: float = 0.005, max_batch_size: int = 8) -> SleepGeneration:
    """The factory a replica calls (pickles with this module)."""
    return SleepGeneration(token_s=token_s, max_batch_size=max_batch_size)
