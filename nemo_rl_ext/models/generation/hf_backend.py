"""The transformers generation backend: continuous batching over one KV-cached decode loop.

transformers' own continuous batching (5.23's `generate_batch`) took 3.2 s on 2 CPU cores where one padded
`generate` took 0.03 s (16 prompts x 32 greedy tokens, tiny model), and returns no logprobs by default; so this
backend runs its own decode loop, on one engine thread:

- **Continuous batching** (`scheduler="continuous"`, the default): between two decode steps, waiting
  requests are prefilled together and join the running batch (`hf_batch.KvBatch.merge`), at most
  `max_batch_size` rows and `max_prefill_tokens` padded prompt tokens per step; a row leaves, and its
  caller's future resolves, at the step it finishes. `scheduler="static"` is the old behaviour (a batch
  admits no one until all its rows finished), kept for comparison (`bench/continuous_batching.py`).
- Each row keeps its own sampling parameters and seeded generator, so its tokens do not depend on what
  else is in the batch, and its logprobs are those of a separate forward pass.
- **Streaming**: `generate_stream` hands each sampled token to its caller's loop as it is decoded (a
  per-request hook on the row; requests nobody streams skip it).
- **Structured output**: a request's `config.structured_output` is compiled (llguidance, `grammar`) before it
  joins; each step masks that row's logits to what its grammar allows next (rows without one are untouched).
- **Faults**: a row that fails alone (its sampler cannot be built, its logits cannot be sampled, its
  stop check raises) gets its own error and leaves while the others go on; a cancelled `generate_async`
  call (a client that went away, a rollout past its deadline) leaves at the next decode step.
- **Weights**: `update_weights` runs between decode steps; rows in flight finish first (`in_flight="finish"`)
  or stop with `FinishReason.ABORTED` (`"abort"`); every output carries the `weight_version` it ran under.
- **Load and timing**: `engine_load()` says how many rows decode and how many requests wait (the policy
  server's `/metrics`); each output carries `time_to_first_token_s`, from its `generate_async` call to its
  first sampled token.
- torch runs `num_threads` intra-op threads on the engine thread (default 1: on a shared 2-core machine
  two threads ran 10-16x slower than one, measured); None leaves torch's setting alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.grammar import Grammars
from nemo_rl_ext.models.generation.hf_batch import KvBatch, Request
from nemo_rl_ext.models.generation.hf_decode import HfDecodeSteps, deliver
from nemo_rl_ext.models.generation.interfaces import (
    EngineLoad,
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    InFlightPolicy,
    StreamEvent,
    check_in_flight,
    check_prompt,
    check_state_dict,
)
from nemo_rl_ext.models.generation.token_stream import TokenQueue
from nemo_rl_ext.models.loading import cache_kwarg

logger = logging.getLogger(__name__)

_SHUTDOWN_JOIN_S = 60.0
"""How long `shutdown` waits for the engine thread to finish its current step."""

Scheduler = Literal["continuous", "static"]


@dataclass
class _Update:
    """One `update_weights` call waiting for the engine thread."""

    state_dict: Mapping[str, torch.Tensor]
    in_flight: InFlightPolicy
    partial: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class HfGeneration(HfDecodeSteps, GenerationInterface):
    """Serves `generate_async` from a transformers causal LM, CPU or GPU."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_model_len: int | None = None,
        max_batch_size: int = 64,
        max_prefill_tokens: int = 16384,
        batch_wait_s: float = 0.002,
        scheduler: Scheduler = "continuous",
        num_threads: int | None = 1,
    ) -> None:
        _check_options(scheduler, max_batch_size, max_prefill_tokens, num_threads)
        self.model = model.eval()
        self._cache_kwarg = cache_kwarg(self.model)  # the KV cache keyword of this transformers version
        self._tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        """Most padded prompt tokens prefilled between two decode steps (one request always fits)."""
        self.batch_wait_s = batch_wait_s
        """How long an idle engine waits after a first request for others made at the same time."""
        self.scheduler: Scheduler = scheduler
        self.num_threads = num_threads
        self._max_model_len = max_model_len or int(model.config.max_position_embeddings)
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else next(iter(self._eos_ids)))
        self._grammars = Grammars(tokenizer, self._vocab_size, self._eos_ids)  # built on first use
        self._cond = threading.Condition()
        self._pending: collections.deque[Request] = collections.deque()
        self._updates: collections.deque[_Update] = collections.deque()
        self._closed = False
        self._weight_version = 0
        self._held: list[tuple[Request, GenerationOutput | BaseException]] = []
        self._num_running = 0  # rows in the running batch (set on the engine thread, read by `engine_load`)
        self.num_requests = 0
        """Requests accepted by `generate_async` so far."""
        self.num_forward_passes = 0
        """Model forward passes run so far (prefill and decode steps): a measure of batching."""
        self.num_decode_steps = 0
        """Decode steps run so far (forward passes that advance every running row by one token)."""
        self.num_prefills = 0
        """Prefill passes run so far (a group of requests joining the batch)."""
        self.num_batches = 0
        """Times the engine started decoding from an empty batch."""
        self.num_generated_tokens = 0
        """Tokens generated so far, over all rows (cancelled, aborted and failed rows included)."""
        self.num_cancelled = 0
        """Requests whose caller cancelled them before they finished (they left the queue or the batch)."""
        self.num_aborted = 0
        """Requests stopped with FinishReason.ABORTED by `update_weights(..., in_flight="abort")`."""
        self.num_row_failures = 0
        """Requests that failed alone inside a batch (the rest of their batch went on)."""
        self._thread = threading.Thread(target=self._engine, name="hf-generation", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", **kwargs
    ) -> HfGeneration:
        """Load a model folder (as written by `save_pretrained`) and serve it."""
        # local: no cycle, nothing heavy (torch and transformers are loaded here already); could move up
        from nemo_rl_ext.models.loading import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(path, dtype=dtype, device=device)
        return cls(model, tokenizer, **kwargs)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def engine_load(self) -> EngineLoad:
        """Rows decoding now, and requests waiting to join them (cancelled ones not counted)."""
        with self._cond:
            waiting = sum(not r.cancelled for r in self._pending)
        return EngineLoad(running=self._num_running, waiting=waiting)

    async def generate_async(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        request = await self._submit(prompt_token_ids, config)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True  # read by the engine, which drops the row at its next step
            raise

    async def generate_stream(
        self, prompt_token_ids: Sequence[int], config: GenerationConfig
    ) -> AsyncIterator[StreamEvent]:
        """Each decode step's token as it is sampled (see `GenerationInterface.generate_stream`)."""
        tokens = TokenQueue()
        request = await self._submit(prompt_token_ids, config, on_token=tokens.put_token)
        try:
            async with contextlib.aclosing(tokens.events(request.future)) as events:
                async for event in events:
                    yield event
        finally:
            if not request.future.done():
                request.cancelled = True  # the reader left: the engine drops the row at its next step

    async def _submit(
        self, prompt_token_ids: Sequence[int], config: GenerationConfig, on_token=None
    ) -> Request:
        """Check the prompt, compile its grammar (if any) and queue a request for the engine thread."""
        if self._closed:
            raise RuntimeError("HfGeneration was shut down")
        arrived = time.monotonic()
        prompt = [int(t) for t in prompt_token_ids]
        check_prompt(prompt, self._max_model_len, self._vocab_size)
        grammar = None  # compiled here, off the engine thread; a bad schema is a ValueError
        if config.structured_output is not None:
            grammar = await asyncio.to_thread(self._grammars.row, config.structured_output)
        loop = asyncio.get_running_loop()
        request = Request(
            prompt, config, loop, loop.create_future(), arrived=arrived, grammar=grammar, on_token=on_token
        )
        with self._cond:
            if self._closed:
                raise RuntimeError("HfGeneration was shut down")
            self._pending.append(request)
            self.num_requests += 1
            self._cond.notify()
        return request

    @property
    def accepts_partial_update(self) -> bool:
        return True  # `load_state_dict(strict=False)` keeps the tensors not named

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, in_flight: InFlightPolicy = "finish", partial: bool = False
    ) -> None:
        """Load new weights in place between two decode steps (see `GenerationInterface.update_weights`)."""
        if self._closed:
            raise RuntimeError("HfGeneration was shut down")
        check_in_flight(in_flight)
        check_state_dict(self.model.state_dict().keys(), state_dict, partial)
        update = _Update(state_dict, in_flight, partial)
        with self._cond:
            if self._closed:
                raise RuntimeError("HfGeneration was shut down")
            self._updates.append(update)
            self._cond.notify()
        while not update.done.wait(0.5):
            if not self._thread.is_alive():
                raise RuntimeError("HfGeneration's engine thread stopped before the weight update applied")
        if update.error is not None:
            raise update.error

    def shutdown(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(_SHUTDOWN_JOIN_S)
        if self._thread.is_alive():
            logger.warning("the hf engine thread did not stop within %.0f s", _SHUTDOWN_JOIN_S)

    # ---- the engine thread ----------------------------------------------------------------------

    def _engine(self) -> None:
        if self.num_threads is not None and self.model.device.type == "cpu":
            torch.set_num_threads(self.num_threads)  # this thread's OpenMP pool
        batch: KvBatch | None = None
        try:
            while True:
                with self._cond:
                    while not (self._closed or self._pending or self._updates or batch is not None):
                        self._cond.wait()
                    if self._closed:
                        break
                if batch is None and not self._updates and self.batch_wait_s > 0:
                    time.sleep(self.batch_wait_s)  # let requests made at the same time as the first join it
                batch = self._step(batch)
        finally:
            self._close_out(batch)

    def _close_out(self, batch: KvBatch | None) -> None:
        """Fail every request and update still held: the engine is gone."""
        error = RuntimeError("HfGeneration was shut down")
        self._num_running = 0
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending), collections.deque()
            updates, self._updates = list(self._updates), collections.deque()
        self._release_held()
        for request in pending + ([row.request for row in batch.rows] if batch else []):
            deliver(request, error)
        for update in updates:
            update.error = error
            update.done.set()

    def _step(self, batch: KvBatch | None) -> KvBatch | None:
        """One scheduling step: apply a due weight update, admit waiting requests, run one decode step."""
        with self._cond:
            update = self._updates[0] if self._updates else None
        if update is not None:
            if batch is not None and update.in_flight == "abort":
                for row in batch.rows:
                    if not row.done:
                        row.finish = FinishReason.ABORTED
                        self.num_aborted += 1
                batch = self._settle(batch)
            if batch is None:
                self._release_held()
                self._num_running = 0
                self._apply(update)
                return None
        elif batch is None or self.scheduler == "continuous":
            admitted = self._admit(room=self.max_batch_size - (len(batch.rows) if batch else 0))
            if admitted:
                self._num_running = (len(batch.rows) if batch is not None else 0) + len(admitted)
                if batch is None:
                    self.num_batches += 1
                try:
                    batch = self._prefill(batch, admitted)
                except Exception as exc:  # the joining requests hear why; the running rows go on
                    logger.exception("prefilling %d requests failed", len(admitted))
                    for request in admitted:
                        deliver(request, exc)
        if batch is not None:
            try:
                batch = self._decode(batch)
            except Exception as exc:  # the whole step failed: every running row's caller hears why
                logger.exception("a decode step over %d rows failed", len(batch.rows))
                for row in batch.rows:
                    deliver(row.request, exc)
                batch = None
        if batch is None and self._held:
            self._release_held()
        self._num_running = len(batch.rows) if batch is not None else 0
        return batch

    def _apply(self, update: _Update) -> None:
        try:
            with torch.no_grad():
                if update.partial:  # tensor by tensor, in the mapping's order: a streamed one is made as read
                    own = self.model.state_dict()
                    for name in update.state_dict:
                        own[name].copy_(update.state_dict[name])
                else:
                    self.model.load_state_dict(dict(update.state_dict), strict=True)
            self._weight_version += 1
        except Exception as exc:  # the caller hears why; the engine goes on serving
            update.error = exc
        with self._cond:
            self._updates.popleft()
        update.done.set()

    def _admit(self, room: int) -> list[Request]:
        """Take waiting requests within the row and prefill-token bounds (at least one); drop cancelled ones."""
        admitted: list[Request] = []
        width = 0
        with self._cond:
            while self._pending and len(admitted) < room:
                request = self._pending[0]
                if request.cancelled or request.future.done():
                    self._pending.popleft()
                    self.num_cancelled += 1
                    continue
                wider = max(width, len(request.prompt_ids))
                if admitted and wider * (len(admitted) + 1) > self.max_prefill_tokens:
                    break
                admitted.append(self._pending.popleft())
                width = wider
        return admitted


def _check_options(scheduler: str, max_batch_size: int, max_prefill_tokens: int, num_threads: int | None) -> None:
    """One ValueError naming every bad engine option (and its value)."""
    problems = []
    if scheduler not in ("continuous", "static"):
        problems.append(f'scheduler must be "continuous" or "static", got {scheduler!r}')
    for name, value in (("max_batch_size", max_batch_size), ("max_prefill_tokens", max_prefill_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{name} must be an int >= 1, got {value!r}")
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        problems.append(f"num_threads must be None or an int >= 1, got {num_threads!r}")
    if problems:
        raise ValueError("HfGeneration: " + "; ".join(problems))


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that ends a generation naturally: the model's and the tokenizer's EOS."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("the model and tokenizer define no eos_token_id; generation could never stop naturally")
    return frozenset(ids)
