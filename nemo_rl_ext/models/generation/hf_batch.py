"""The running batch of the transformers backend: its rows and their left-padded KV cache.

Rows join between decode steps: a group of new requests is prefilled on its own (left-padded to its
longest prompt, a fresh cache) and then merged into the running batch, both caches left-padded to the
wider of the two, with the padding masked out. Rows leave by selecting the others; columns that every
remaining row masks (left padding a long row that left had forced on them) are trimmed away. A row's
tokens depend only on its own prompt, tokens and sampler: padding is masked and positions are per row.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from nemo_rl_ext.models.generation.interfaces import (
    FinishReason,
    GenerationConfig,
    GenerationOutput,
    PromptScores,
    TopLogprobs,
)

if TYPE_CHECKING:
    from nemo_rl_ext.models.generation.grammar import RowGrammar


@dataclass
class Request:
    """One pending `generate_async` call."""

    prompt_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    """The caller's event loop: results are delivered on it."""
    future: asyncio.Future
    cancelled: bool = False
    """Set on the caller's loop when the caller stopped waiting; the engine then drops the row."""
    arrived: float = field(default_factory=time.monotonic)
    """`time.monotonic()` when `generate_async` accepted it (the start of its time to first token)."""
    grammar: RowGrammar | None = None
    """Its structured output's matcher (`config.structured_output`); None: unconstrained."""
    on_token: Callable[[int, float, TopLogprobs | None], None] | None = None
    """Streamed requests: called on the engine thread with each sampled (id, logprob); must not raise."""


@dataclass
class Row:
    """Decode state of one request inside the running batch."""

    request: Request
    budget: int
    budget_reason: FinishReason
    generator: torch.Generator | None
    weight_version: int
    """The weight version this row's tokens are generated under."""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    matched: str | int | None = None
    error: Exception | None = None
    """Why this row (and only this row) failed; set rows leave the batch."""
    first_token_at: float | None = None
    """`time.monotonic()` when its first token was sampled."""
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """Per generated token, its top alternatives (filled only when the config asks for them)."""
    prompt_scores: PromptScores | None = None
    """The prompt's logprobs and their alternatives, when the config asks for them (set at prefill)."""

    @property
    def done(self) -> bool:
        """True once the row finished, failed or was cancelled: it leaves the batch."""
        return self.finish is not None or self.error is not None or self.request.cancelled

    def output(self) -> GenerationOutput | Exception:
        """The row's result: its error, or its output (call once it finished)."""
        if self.error is not None:
            return self.error
        assert self.finish is not None
        ttft = None if self.first_token_at is None else self.first_token_at - self.request.arrived
        prompt, prompt_tops = self.prompt_scores or (None, None)
        return GenerationOutput(
            tuple(self.output_ids), tuple(self.logprobs), self.finish, self.matched, self.weight_version, ttft,
            top_logprobs=tuple(self.top_logprobs) if self.request.config.top_logprobs else None,
            prompt_logprobs=prompt, prompt_top_logprobs=prompt_tops,
        )


class KvBatch:
    """Rows decoding together: one KV cache, attention mask and position per row, the next input token."""

    def __init__(
        self,
        rows: list[Row],
        cache: DynamicCache,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        tokens: torch.Tensor,
    ) -> None:
        self.rows = rows
        self.cache = cache
        self.attention_mask = attention_mask
        """[rows, cached columns]: 1 where a row has a real token, 0 on its left padding."""
        self.position_ids = position_ids
        """[rows, 1]: the position of each row's last token."""
        self.tokens = tokens
        """[rows]: each row's last sampled token, the next decode step's input."""

    @staticmethod
    def prefill_inputs(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, ...]:
        """(input_ids, attention_mask, position_ids) of prompts left-padded to the longest."""
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for pos, prompt in enumerate(prompts):
            input_ids[pos, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[pos, width - len(prompt) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return input_ids, attention_mask, position_ids

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Advance every row by one column; (input_ids, attention_mask, position_ids) of the next step."""
        self.attention_mask = torch.cat(
            [self.attention_mask, self.attention_mask.new_ones((len(self.rows), 1))], dim=-1
        )
        self.position_ids = self.position_ids + 1
        return self.tokens[:, None], self.attention_mask, self.position_ids

    def keep(self, positions: list[int]) -> None:
        """Keep only the rows at `positions` (their order), then trim columns no remaining row attends to."""
        if len(positions) == len(self.rows):
            return
        if not positions:  # the batch is over: the caller drops it
            self.rows = []
            return
        index = torch.tensor(positions, dtype=torch.long, device=self.tokens.device)
        self.rows = [self.rows[p] for p in positions]
        self.cache.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]
        self.position_ids = self.position_ids[index]
        self.tokens = self.tokens[index]
        self._trim()

    def _trim(self) -> None:
        # the number of leading columns that every row masks: a cumulative max over columns
        real = self.attention_mask.any(dim=0)
        start = int(real.int().argmax())
        if start == 0:
            return
        self.attention_mask = self.attention_mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, start:]
            layer.values = layer.values[:, :, start:]

    def merge(self, other: KvBatch) -> None:
        """Append `other`'s rows: both caches and masks left-padded to the wider one, then concatenated."""
        width = max(self.attention_mask.shape[1], other.attention_mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)], dim=0)
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)], dim=0)
        self.attention_mask = torch.cat(
            [_left_pad(self.attention_mask, width), _left_pad(other.attention_mask, width)], dim=0
        )
        self.position_ids = torch.cat([self.position_ids, other.position_ids], dim=0)
        self.tokens = torch.cat([self.tokens, other.tokens], dim=0)
        self.rows = self.rows + other.rows


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the sequence axis of a mask [B, L] or a cache tensor [B, H, L, D] on the left to `width`."""
    axis = 1 if t.dim() == 2 else 2
    missing = width - t.shape[axis]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([t.new_zeros(shape), t], dim=axis)
