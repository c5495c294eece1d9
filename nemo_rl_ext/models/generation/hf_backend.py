"""The transformers generation backend: concurrent requests gathered into padded, KV-cached batches.

FACTS.md measured transformers' continuous batching at ~25x slower than one padded `generate` on 2 CPU
cores, without logprobs; so this backend runs its own batched decode loop: every request that arrives
while a batch runs joins the next one, each row keeps its own sampling parameters and seeded generator,
finished rows leave the batch (their KV cache rows are dropped), and one forward pass serves all rows.

One request never fails another: a row that fails alone (its sampler cannot be built, its logits cannot
be sampled, its stop check raises) gets its own error and leaves the batch while the others go on, and
a cancelled `generate_async` call (a client that went away) leaves at the next decode step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.interfaces import (
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    check_prompt,
    check_state_dict,
)
from nemo_rl_ext.models.generation.sampling import select_tokens

logger = logging.getLogger(__name__)

_STOP_STRING_TOKEN_SLACK = 8
"""Extra tokens decoded beyond a stop string's length when looking for it at the end of a generation."""


@dataclass
class _Request:
    """One pending `generate_async` call."""

    prompt_ids: list[int]
    config: GenerationConfig
    future: asyncio.Future
    cancelled: bool = False
    """Set on the caller's loop when the caller stopped waiting; the decode loop then drops the row."""


@dataclass
class _Row:
    """Decode state of one request inside a batch."""

    request: _Request
    budget: int
    budget_reason: FinishReason
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    matched: str | int | None = None
    error: Exception | None = None
    """Why this row (and only this row) failed; set rows leave the batch."""

    def output(self) -> GenerationOutput | Exception | None:
        """The row's result: its output, its error, or None if it was cancelled."""
        if self.error is not None:
            return self.error
        if self.finish is None:
            return None
        return GenerationOutput(tuple(self.output_ids), tuple(self.logprobs), self.finish, self.matched)


class HfGeneration(GenerationInterface):
    """Serves `generate_async` from a transformers causal LM, CPU or GPU."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_model_len: int | None = None,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.002,
    ) -> None:
        self.model = model.eval()
        self._tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self._max_model_len = max_model_len or int(model.config.max_position_embeddings)
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else next(iter(self._eos_ids)))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generation")
        self._lock = threading.Lock()
        self._queues: dict[asyncio.AbstractEventLoop, asyncio.Queue[_Request]] = {}
        self._workers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
        self._closed = False
        self.num_forward_passes = 0
        """Model forward passes run so far (prefill and decode steps): a measure of batching."""
        self.num_batches = 0
        """Batches run so far."""
        self.num_generated_tokens = 0
        """Tokens generated so far, over all rows (cancelled and failed rows included)."""
        self.num_cancelled = 0
        """Requests whose caller cancelled them before they finished (they left the queue or the batch)."""
        self.num_row_failures = 0
        """Requests that failed alone inside a batch (the rest of their batch went on)."""

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", **kwargs
    ) -> HfGeneration:
        """Load a model folder (as written by `save_pretrained`) and serve it."""
        from nemo_rl_ext.models.tiny import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(path, dtype=dtype, device=device)
        return cls(model, tokenizer, **kwargs)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate_async(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        if self._closed:
            raise RuntimeError("HfGeneration was shut down")
        prompt = [int(t) for t in prompt_token_ids]
        check_prompt(prompt, self._max_model_len, self._vocab_size)
        loop = asyncio.get_running_loop()
        request = _Request(prompt, config, loop.create_future())
        self._queue_for(loop).put_nowait(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True  # read by the decode loop, which drops the row at its next step
            raise

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load new weights in place, between batches (never during one)."""
        if self._closed:
            raise RuntimeError("HfGeneration was shut down")
        check_state_dict(self.model.state_dict().keys(), state_dict)
        self._executor.submit(self._load_state_dict, state_dict).result()

    def _load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.model.load_state_dict(dict(state_dict), strict=True)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for loop, task in list(self._workers.items()):
            if not loop.is_closed():
                loop.call_soon_threadsafe(task.cancel)
        self._workers.clear()
        self._queues.clear()
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ---- batching -------------------------------------------------------------------------------

    def _queue_for(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[_Request]:
        """The request queue of this event loop, with its worker task (one per loop that calls us)."""
        with self._lock:
            for stale in [lp for lp in self._queues if lp.is_closed()]:
                self._queues.pop(stale)
                self._workers.pop(stale, None)
            if loop not in self._queues:
                self._queues[loop] = asyncio.Queue()
                self._workers[loop] = loop.create_task(self._worker(self._queues[loop]))
            return self._queues[loop]

    async def _worker(self, queue: asyncio.Queue[_Request]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            await asyncio.sleep(self.batch_wait_s)  # let requests made in the same tick join
            while len(batch) < self.max_batch_size and not queue.empty():
                batch.append(queue.get_nowait())
            waiting = [r for r in batch if not r.future.done()]  # a done future here was cancelled
            self.num_cancelled += len(batch) - len(waiting)
            batch = waiting
            if not batch:
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self._run_batch, batch)
            except Exception as exc:  # the whole batch failed: every caller hears why
                logger.exception("generation batch of %d failed", len(batch))
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            for r, out in zip(batch, outputs, strict=True):
                if r.future.done():
                    continue
                if out is None:
                    r.future.cancel()
                elif isinstance(out, Exception):
                    r.future.set_exception(out)
                else:
                    r.future.set_result(out)

    # ---- the decode loop (runs in the executor thread) -----------------------------------------

    def _new_row(self, request: _Request) -> _Row:
        room = self._max_model_len - len(request.prompt_ids)
        cfg = request.config
        budget, reason = (
            (room, FinishReason.MAX_MODEL_LEN)
            if room < cfg.max_new_tokens
            else (cfg.max_new_tokens, FinishReason.MAX_NEW_TOKENS)
        )
        try:
            generator = None
            if not cfg.greedy:
                generator = torch.Generator(device=self.model.device)
                if cfg.seed is None:
                    generator.seed()
                else:
                    generator.manual_seed(cfg.seed)
        except Exception as exc:  # e.g. a seed torch cannot take: this request fails, not its batch
            row = _Row(request, budget, reason, None)
            self._fail(row, "creating its sampler", exc)
            return row
        return _Row(request, budget, reason, generator)

    @torch.inference_mode()
    def _run_batch(self, requests: list[_Request]) -> list[GenerationOutput | Exception | None]:
        """Decode one batch; per request its output, the error it failed with alone, or None if cancelled."""
        self.num_batches += 1
        rows = [self._new_row(r) for r in requests]
        active = self._still_running(rows, range(len(rows)))  # batch position -> row index
        if not active:
            return [row.output() for row in rows]
        device = self.model.device
        prompts = [rows[i].request.prompt_ids for i in active]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(active), width), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(active), width), dtype=torch.long)
        for pos, prompt in enumerate(prompts):
            input_ids[pos, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[pos, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        while True:
            logits = self._forward(input_ids, attention_mask, position_ids, cache)
            tokens, logprobs = self._select(logits, [rows[i] for i in active])
            for pos, i in enumerate(active):
                if rows[i].error is None:
                    self._append(rows[i], int(tokens[pos]), float(logprobs[pos]))
            running = self._still_running(rows, active)
            if not running:
                break
            if len(running) < len(active):
                still = set(running)
                keep = [pos for pos, i in enumerate(active) if i in still]
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                attention_mask, position_ids, tokens = attention_mask[index], position_ids[index], tokens[index]
                active = running
            input_ids = tokens[:, None]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=-1)
            position_ids = position_ids[:, -1:] + 1
        return [row.output() for row in rows]

    def _still_running(self, rows: list[_Row], indices: Sequence[int]) -> list[int]:
        """The rows of `indices` that go on decoding; counts the ones whose caller cancelled them."""
        running = []
        for i in indices:
            row = rows[i]
            if row.request.cancelled:
                self.num_cancelled += 1
            elif row.finish is None and row.error is None:
                running.append(i)
        return running

    def _select(self, logits: torch.Tensor, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _fail(self, row: _Row, stage: str, exc: Exception) -> None:
        """Mark one row failed (it leaves the batch; its caller gets the error) and log why."""
        cfg = row.request.config
        row.error = RuntimeError(
            f"generation failed while {stage} (temperature={cfg.temperature}, top_p={cfg.top_p}, "
            f"top_k={cfg.top_k}, seed={cfg.seed}): {type(exc).__name__}: {exc}"
        )
        row.error.__cause__ = exc
        self.num_row_failures += 1
        logger.warning("one request of a batch failed alone: %s", row.error)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        self.num_forward_passes += 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _append(self, row: _Row, token: int, logprob: float) -> None:
        """Add a generated token to a row and decide whether the row is finished (or failed alone)."""
        row.output_ids.append(token)
        row.logprobs.append(logprob)
        self.num_generated_tokens += 1
        try:
            self._check_finished(row, token)
        except Exception as exc:
            self._fail(row, "checking its stop conditions", exc)

    def _check_finished(self, row: _Row, token: int) -> None:
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
