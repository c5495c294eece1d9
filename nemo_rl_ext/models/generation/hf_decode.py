"""The hf engine's prefill and decode steps (on its engine thread): new rows, forward passes, sampling (a row that
fails alone leaves alone), stop checks, and handing finished rows' results to their callers.

`HfDecodeSteps` is a part of `hf_backend.HfGeneration`, which sets the state it reads (the model, the counters,
the scheduler); it is not used on its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.extra_logprobs import rows_top_logprobs, score_prompts
from nemo_rl_ext.models.generation.grammar import GrammarError, Grammars
from nemo_rl_ext.models.generation.hf_batch import KvBatch, Request, Row
from nemo_rl_ext.models.generation.interfaces import FinishReason, GenerationOutput
from nemo_rl_ext.models.generation.sampling import select_tokens

logger = logging.getLogger("nemo_rl_ext.models.generation.hf_backend")  # the engine's one logger

_STOP_STRING_TOKEN_SLACK = 8
"""Extra tokens decoded beyond a stop string's length when looking for it at the end of a generation."""


class HfDecodeSteps:
    """Prefill, decode, sample and finish rows: the engine thread's work between two scheduling decisions."""

    model: PreTrainedModel
    scheduler: str
    num_forward_passes: int
    num_decode_steps: int
    num_prefills: int
    num_generated_tokens: int
    num_cancelled: int
    num_row_failures: int
    _cache_kwarg: str
    _tokenizer: PreTrainedTokenizerBase
    _max_model_len: int
    _eos_ids: frozenset[int]
    _pad_id: int
    _weight_version: int
    _held: list[tuple[Request, GenerationOutput | BaseException]]

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
        deliver(request, result)

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
        if isinstance(exc, GrammarError):  # the request's schema, not the engine: its caller says so (a 400)
            row.error = exc
        else:
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
        tail = self._tokenizer.decode(output_ids[-window:], skip_special_tokens=False)
        return next((s for s in stop_strings if s in tail), None)


def deliver(request: Request, result: GenerationOutput | BaseException) -> None:
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
