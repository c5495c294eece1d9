"""The reference that engine logprobs are checked against: one plain forward pass, as a trainer computes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def forward_logprobs(model: Any, context: Sequence[int], output: Sequence[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each id of `output` after `context`, from one forward pass of `model` over
    both (T = 0, greedy, counts as 1): the logprobs a backend must report for those ids."""
    import torch  # lazy: torch loads only when a test computes reference logprobs

    ids = torch.tensor([[*context, *output]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(-1, torch.tensor(list(output))[:, None])[:, 0]


def forward_top_logprobs(model: Any, context: Sequence[int], output: Sequence[int], k: int) -> tuple[list, list]:
    """(values, ids) of the k likeliest ids at each position of `output` after `context` (temperature 1), from
    one forward pass of `model` over both: a teacher's top-k must equal these."""
    import torch  # lazy: torch loads only when a test computes reference logprobs

    ids = torch.tensor([[*context, *output]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float()
    values, indices = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return values.tolist(), indices.tolist()
