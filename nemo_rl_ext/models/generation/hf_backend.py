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
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.extra_logprobs import rows_top_logprobs, score_prompts
from nemo_rl_ext.models.generation.grammar import Grammars
from nemo_rl_ext.models.generation.hf_batch import KvBatch, Request, Row
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
from nemo_rl_ext.models.generation.sampling import select_tokens
from nemo_rl_ext.models.generation.token_stream import TokenQueue
from nemo_rl_ext.models.loading import cache_kwarg

logger = logging.getLogger(__name__)

_STOP_STRING_TOKEN_SLACK = 8
"""Extra tokens decoded beyond a stop string's length when looking for it at the end of a generation."""
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


class HfGeneration(GenerationInterface):
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
            _deliver(request, error)
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
                        _deliver(request, exc)
        if batch is not None:
            try:
                batch = self._decode(batch)
            except Exception as exc:  # the whole step failed: every running row's caller hears why
                logger.exception("a decode step over %d rows failed", len(batch.rows))
                for row in batch.rows:
                    _deliver(row.request, exc)
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

    # ---- prefill and decode (on the engine thread) ----------------------------------------------

    def _new_row(self, request: Request) -> Row:
        room = self._max_model_len - len(request.prompt_ids)
        cfg = request.config
        budget, reason = (
            (room, FinishReason.MAX_MODEL_LEN)
            if room < cfg.max_new_tokens
            else (cfg.max_new_tokens, FinishReason.MAX_NEW_TOKENS)
        )
        row = Row(request, budget, reason, None, self._weight_version)
        try:
            if not cfg.greedy:
                row.generator = torch.Generator(device=self.model.device)
                if cfg.seed is None:
                    row.generator.seed()
                else:
                    row.generator.manual_seed(cfg.seed)
        except Exception as exc:  # e.g. a seed torch cannot take: this request fails, not its batch
            self._fail(row, "creating its sampler", exc)
        return row

    @torch.inference_mode()
    def _prefill(self, batch: KvBatch | None, requests: list[Request]) -> KvBatch | None:
        """Prefill `requests` together, sample their first tokens and merge the survivors into `batch`."""
        rows = [self._new_row(r) for r in requests]
        for row in rows:
            if row.done:
                self._finish(row)
        rows = [row for row in rows if not row.done]
        if not rows:
            return batch
        self.num_prefills += 1
        input_ids, attention_mask, position_ids = KvBatch.prefill_inputs(
            [row.request.prompt_ids for row in rows], self._pad_id, self.model.device
        )
        cache = DynamicCache()
        if any(row.request.config.prompt_logprobs is not None for row in rows):
            # logits of every position: score the prompts that ask, then sample from the last
            logits = self._forward(input_ids, attention_mask, position_ids, cache, all_positions=True)
            score_prompts(rows, logits, input_ids, self._fail)
            logits = logits[:, -1, :]
        else:
            logits = self._forward(input_ids, attention_mask, position_ids, cache)
        tokens = self._sample(logits, rows)
        joining = self._settle(KvBatch(rows, cache, attention_mask, position_ids[:, -1:], tokens))
        if batch is None or joining is None:
            return batch or joining
        batch.merge(joining)
        return batch

    @torch.inference_mode()
    def _decode(self, batch: KvBatch) -> KvBatch | None:
        """One decode step over every running row."""
        self.num_decode_steps += 1
        input_ids, attention_mask, position_ids = batch.decode_inputs()
        logits = self._forward(input_ids, attention_mask, position_ids, batch.cache)
        batch.tokens = self._sample(logits, batch.rows)
        return self._settle(batch)

    def _sample(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Select and append one token per row (a failed row gets its error instead); returns the tokens."""
        logits = Grammars.mask(logits, [row.request.grammar for row in rows])
        tokens, logprobs = self._select(logits, rows)
        tops = rows_top_logprobs(logits, rows, self._fail)
        for pos, row in enumerate(rows):
            if row.error is None:
                self._append(row, int(tokens[pos]), float(logprobs[pos]), tops[pos])
        return tokens

    def _settle(self, batch: KvBatch) -> KvBatch | None:
        """Deliver the results of rows that are done and drop them; None once no row is left."""
        keep = []
        for pos, row in enumerate(batch.rows):
            if row.done:
                self._finish(row)
            else:
                keep.append(pos)
        batch.keep(keep)
        return batch if batch.rows else None

    def _finish(self, row: Row) -> None:
        """Hand a done row's result to its caller (a cancelled row is only counted); the static scheduler
        holds it until its whole batch has finished, as a padded `generate` call does."""
        if row.request.cancelled:
            self.num_cancelled += 1
        elif self.scheduler == "static":
            self._held.append((row.request, row.output()))
        else:
            self._hand_over(row.request, row.output())

    def _release_held(self) -> None:
        """Static scheduler: the batch has ended; hand over every result it held."""
        held, self._held = self._held, []
        for request, result in held:
            self._hand_over(request, result)

    def _hand_over(self, request: Request, result: GenerationOutput | BaseException) -> None:
        """Resolve a request's future on its caller's loop (the moment its caller hears the result)."""
        _deliver(request, result)

    def _select(self, logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row; a row that cannot be sampled gets an error and the others draw as without it.

        Each sampler's state is saved first: if the batch's draw raises, the rows that fail alone (tried
        on copies of their samplers) are marked failed, and the rest draw again, together, from the saved
        states, which is the draw they would have made in a batch without the failed rows.
        """
        configs = [row.request.config for row in rows]
        generators = [row.generator for row in rows]
        states = [None if g is None else g.get_state() for g in generators]
        try:
            return select_tokens(logits, configs, generators)
        except Exception:
            logger.warning("sampling a batch of %d failed; looking for the rows that fail alone", len(rows))
        ok = []
        for pos, (row, generator, state) in enumerate(zip(rows, generators, states, strict=True)):
            trial = None
            if generator is not None:
                trial = torch.Generator(device=generator.device)
                trial.set_state(state)
            try:
                select_tokens(logits[pos : pos + 1], [configs[pos]], [trial])
                ok.append(pos)
            except Exception as exc:
                self._fail(row, "sampling its next token", exc)
        for generator, state in zip(generators, states, strict=True):
            if generator is not None:
                generator.set_state(state)
        tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        logprobs = torch.zeros(len(rows), dtype=torch.float32, device=logits.device)
        if ok:
            index = torch.tensor(ok, device=logits.device)
            picked, picked_logprobs = select_tokens(
                logits[index], [configs[p] for p in ok], [generators[p] for p in ok]
            )
            tokens[index], logprobs[index] = picked, picked_logprobs
        return tokens, logprobs

    def _fail(self, row: Row, stage: str, exc: Exception) -> None:
        """Mark one row failed (it leaves the batch; its caller gets the error) and log why."""
        cfg = row.request.config
        row.error = RuntimeError(
            f"generation failed while {stage} (temperature={cfg.temperature}, top_p={cfg.top_p}, "
            f"top_k={cfg.top_k}, seed={cfg.seed}): {type(exc).__name__}: {exc}"
        )
        row.error.__cause__ = exc
        self.num_row_failures += 1
        logger.warning("one request of a batch failed alone: %s", row.error)

    def _forward(self, input_ids, attention_mask, position_ids, cache, all_positions: bool = False) -> torch.Tensor:
        """The last position's logits [B, V]; with `all_positions`, every position's [B, L, V]."""
        self.num_forward_passes += 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=0 if all_positions else 1,
            **{self._cache_kwarg: cache},
        )
        return out.logits if all_positions else out.logits[:, -1, :]

    def _append(self, row: Row, token: int, logprob: float, top=None) -> None:
        """Add a generated token (and its top alternatives, when asked) to a row and decide whether the row is
        finished (or failed alone)."""
        if row.first_token_at is None:
            row.first_token_at = time.monotonic()
        row.output_ids.append(token)
        row.logprobs.append(logprob)
        if top is not None:
            row.top_logprobs.append(top)
        if row.request.on_token is not None:  # a streamed request
            row.request.on_token(token, logprob, top)
        self.num_generated_tokens += 1
        try:
            if row.request.grammar is not None:
                row.request.grammar.accept(token)
            self._check_finished(row, token)
        except Exception as exc:
            self._fail(row, "checking its stop conditions", exc)

    def _check_finished(self, row: Row, token: int) -> None:
        cfg = row.request.config
        if token in cfg.stop_token_ids:
            row.finish, row.matched = FinishReason.STOP_TOKEN, token
        elif token in self._eos_ids:
            row.finish, row.matched = FinishReason.EOS, token
        elif cfg.stop_strings and (matched := self._find_stop_string(row.output_ids, cfg.stop_strings)):
            row.finish, row.matched = FinishReason.STOP_STRING, matched
        elif len(row.output_ids) >= row.budget:
            row.finish = row.budget_reason

    def _find_stop_string(self, output_ids: list[int], stop_strings: Sequence[str]) -> str | None:
        window = max(len(s) for s in stop_strings) + _STOP_STRING_TOKEN_SLACK
        tail = self.tokenizer.decode(output_ids[-window:], skip_special_tokens=False)
        return next((s for s in stop_strings if s in tail), None)


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


def _deliver(request: Request, result: GenerationOutput | BaseException) -> None:
    """Resolve a request's future on its caller's loop (a closed loop or a caller gone is left alone)."""

    def resolve() -> None:
        if request.future.done():
            return
        if isinstance(result, BaseException):
            request.future.set_exception(result)
        else:
            request.future.set_result(result)

    try:
        request.loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the caller's loop was closed
        pass
