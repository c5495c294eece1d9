"""Logprobs beyond the sampled token's, for the rows of a batch that ask: top alternatives and prompt scores.

Both are computed only for the rows whose config asks (`top_logprobs > 0`, `prompt_logprobs` not None), so a
batch where no row asks pays one list comprehension per step.

- **Top logprobs** come from the distribution the sampled token's logprob comes from: log_softmax(logits / T)
  in fp32, T = 1 for greedy rows (`sampling.scaled_logprobs`), before top-k/top-p filtering.
- **Prompt logprobs** are log_softmax(logits) at temperature 1, as vLLM computes `prompt_logprobs`: the model's
  own distribution, whatever the request's temperature (a harness scoring choices wants that one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from nemo_rl_ext.models.generation.interfaces import GenerationConfig, PromptScores, TopLogprobs
from nemo_rl_ext.models.generation.sampling import scaled_logprobs

if TYPE_CHECKING:
    from nemo_rl_ext.models.generation.hf_batch import Row

Fail = Callable[["Row", str, Exception], None]
"""How the engine fails one row alone (`HfGeneration._fail(row, stage, exc)`)."""


def _pairs(values: torch.Tensor, ids: torch.Tensor, k: int) -> TopLogprobs:
    """The first `k` (id, logprob) pairs of one position's topk result."""
    return tuple(zip(ids[:k].tolist(), values[:k].tolist(), strict=True))


def top_logprobs(logits: torch.Tensor, configs: Sequence[GenerationConfig]) -> list[TopLogprobs | None]:
    """Per row of `logits` [B, V], its config's `top_logprobs` likeliest tokens, best first (None: not asked)."""
    rows = [i for i, c in enumerate(configs) if c.top_logprobs]
    out: list[TopLogprobs | None] = [None] * len(configs)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    temperatures = torch.tensor([configs[i].temperature for i in rows], device=logits.device, dtype=torch.float32)
    logprobs = scaled_logprobs(logits[index], temperatures)
    k = min(max(configs[i].top_logprobs for i in rows), logprobs.shape[-1])
    values, ids = logprobs.topk(k, dim=-1)
    values, ids = values.cpu(), ids.cpu()
    for j, i in enumerate(rows):
        out[i] = _pairs(values[j], ids[j], configs[i].top_logprobs)
    return out




def prompt_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, prompt_lens: Sequence[int], configs: Sequence[GenerationConfig]
) -> list[PromptScores | None]:
    """Per left-padded prompt row of a prefill (`logits` [B, L, V] over every position, `input_ids` [B, L]),
    the scores of its prompt ids from the 2nd on when its config asks (`prompt_logprobs`), else None."""
    out: list[PromptScores | None] = [None] * len(configs)
    width = input_ids.shape[1]
    for row, config in enumerate(configs):
        if config.prompt_logprobs is None:
            continue
        start = width - prompt_lens[row]
        logprobs = torch.log_softmax(logits[row, start : width - 1].float(), dim=-1)  # predicts ids start+1..
        targets = input_ids[row, start + 1 :]
        chosen = tuple(logprobs.gather(-1, targets[:, None])[:, 0].tolist())
        tops = None
        if config.prompt_logprobs:
            k = min(config.prompt_logprobs, logprobs.shape[-1])
            values, ids = logprobs.topk(k, dim=-1)
            tops = tuple(_pairs(v, i, k) for v, i in zip(values.cpu(), ids.cpu(), strict=True))
        out[row] = (chosen, tops)
    return out


def rows_top_logprobs(logits: torch.Tensor, rows: list[Row], fail: Fail) -> list[TopLogprobs | None]:
    """`top_logprobs` for the hf engine's rows; if that raises, the rows that asked fail and the others go on."""
    try:
        return top_logprobs(logits, [row.request.config for row in rows])
    except Exception as exc:
        for row in rows:
            if row.request.config.top_logprobs and row.error is None:
                fail(row, "computing its top logprobs", exc)
        return [None] * len(rows)


def score_prompts(rows: list[Row], logits: torch.Tensor, input_ids: torch.Tensor, fail: Fail) -> None:
    """Set `prompt_scores` of the prefilled rows that ask (`prompt_logprobs`; `logits` of every position); if
    that raises, the rows that asked fail and the others go on."""
    configs = [row.request.config for row in rows]
    try:
        scores = prompt_logprobs(logits, input_ids, [len(row.request.prompt_ids) for row in rows], configs)
    except Exception as exc:
        for row, config in zip(rows, configs, strict=True):
            if config.prompt_logprobs is not None and row.error is None:
                fail(row, "scoring its prompt", exc)
        return
    for row, score in zip(rows, scores, strict=True):
        row.prompt_scores = score
