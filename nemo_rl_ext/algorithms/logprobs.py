"""Per-token logprobs for the trainer, computed only where the loss reads them.

`token_logprobs` runs the decoder over a padded batch, then the LM head and the full-vocabulary
log-softmax on the scored positions only (completion tokens, assistant spans), in chunks of rows.
`shared_prefix_logprobs` gives the same values for a list of sequences whose unscored beginnings repeat
(a GRPO group's samples all start with the group's prompt): the decoder runs once over each distinct
prefix, and the sequences continue from a copy of that prefix's KV cache. The copies are views of one
autograd graph, so the gradients equal those of a forward over every sequence in full, while the prompt
tokens are computed once per group instead of once per sample.

Both use the generation backend's distribution, `log_softmax(logits / T)`, so the engine's logprobs and
the trainer's are directly comparable.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

LOGSOFTMAX_CHUNK_ELEMENTS = 2**24
"""Logits per chunk of the log-softmax (rows x vocabulary, 64 MiB in fp32): bounds the peak memory of the
no-grad passes; with gradients, each chunk keeps its [rows, vocabulary] log-softmax for the backward."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of causal LMs whose logits are more than `lm_head(last hidden state)` (Gemma 2/3 soft-capping,
Cohere, Granite): those models take the full forward and only the log-softmax is restricted to scored rows."""


def _decoder_and_head(model: PreTrainedModel) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """(module, head) such that `head(module(...) states)` are the model's logits.

    For a plain causal LM (logits = lm_head(decoder output)): the decoder and the LM head, so the head can run
    on selected rows only. Otherwise: the model itself (its states are the logits) and the identity.
    """
    head = model.get_output_embeddings()
    plain = isinstance(head, torch.nn.Linear) and not any(
        getattr(model.config, key, None) not in (None, 1.0) for key in _LOGIT_TRANSFORMS
    )
    decoder = model.get_decoder() if plain else model
    if plain and decoder is not model:
        return decoder, head
    return model, lambda x: x


def _states(module: torch.nn.Module, **inputs: Any) -> torch.Tensor:
    """The [B, T, D] states `module` (a decoder or a whole model, see `_decoder_and_head`) gives for `inputs`."""
    out = module(**inputs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


def _score(
    states: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    scored: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """[B, T] logprobs of `input_ids[:, 1:][scored]` from the states before them, 0 elsewhere (see token_logprobs)."""
    batch, width = input_ids.shape
    out = torch.zeros(batch, width, dtype=torch.float32, device=input_ids.device)
    rows = states[:, :-1][scored]  # [N, D]: the states whose next token is scored
    targets = input_ids[:, 1:][scored]
    vocab = int(getattr(head, "out_features", states.shape[-1]))
    step = max(1, LOGSOFTMAX_CHUNK_ELEMENTS // vocab)
    picked = []
    for lo in range(0, rows.shape[0], step):
        logits = head(rows[lo : lo + step]).float()
        if temperature != 1.0:  # x / 1.0 == x exactly: skip a pass over the logits
            logits = logits / temperature
        picked.append(torch.log_softmax(logits, dim=-1).gather(-1, targets[lo : lo + step, None])[:, 0])
    values = torch.cat(picked)
    return torch.cat([out[:, :1], out[:, 1:].masked_scatter(scored, values)], dim=1)


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    score_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, T] float32 logprobs of the scored tokens under `log_softmax(logits / temperature)`, 0 elsewhere.

    `logprobs[b, t]` scores `input_ids[b, t]` with the logits at position t - 1 (the loss convention), so
    position 0 is always 0. `score_mask` ([B, T], nonzero on the tokens to score, e.g. the loss mask)
    selects the tokens; None scores every position from 1 on. Only the selected rows go through the LM
    head and the log-softmax (in chunks of `LOGSOFTMAX_CHUNK_ELEMENTS` logits); a batch with none
    selected does not run the model. `attention_mask` is 1 on real tokens. Temperature 0 (greedy) counts
    as 1, as in the generation backend.
    """
    temperature = temperature if temperature > 0 else 1.0
    batch, width = input_ids.shape
    if width < 2:
        return torch.zeros(batch, width, dtype=torch.float32, device=input_ids.device)
    scored = score_mask[:, 1:] != 0 if score_mask is not None else torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    if not bool(scored.any()):
        return torch.zeros(batch, width, dtype=torch.float32, device=input_ids.device)
    module, head = _decoder_and_head(model)
    states = _states(module, input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return _score(states, head, input_ids, scored, temperature)


def shared_prefix_logprobs(
    model: PreTrainedModel,
    sequences: Sequence[torch.Tensor],
    score_masks: Sequence[torch.Tensor],
    temperature: float = 1.0,
    pad_token_id: int = 0,
) -> torch.Tensor | None:
    """`token_logprobs` of the right-padded `sequences` ([B, T], 0 outside the scored tokens), computing each
    distinct unscored prefix once; None when no two sequences share one (nothing to save).

    A sequence's prefix is every token before its first scored one. The decoder runs over the distinct
    prefixes (right-padded), the KV cache is copied to each sequence of a prefix, and the rest of every
    sequence runs on top of its copy with its own positions; padding between a short prefix and its rest
    is masked out. A sequence with nothing to score is not run (its row is 0). The values equal
    `token_logprobs` over the full sequences up to float rounding (different matmul shapes), and so do
    the gradients, which flow through the cache copies into the shared prefix pass.
    """
    if len(sequences) != len(score_masks):
        raise ValueError(f"{len(sequences)} sequences but {len(score_masks)} score masks")
    temperature = temperature if temperature > 0 else 1.0
    device = next(model.parameters()).device
    width = max(int(s.numel()) for s in sequences)
    starts: list[int | None] = []
    for mask in score_masks:
        hits = torch.nonzero(mask[1:] != 0)
        starts.append(int(hits[0, 0]) + 1 if hits.numel() else None)  # the first scored token's index
    prefixes: dict[tuple[int, ...], int] = {}
    active: list[int] = []
    group_of: list[int] = []
    for b, start in enumerate(starts):
        if start is None:
            continue
        key = tuple(sequences[b][:start].tolist())
        group_of.append(prefixes.setdefault(key, len(prefixes)))
        active.append(b)
    if len(prefixes) == len(active):
        return None
    module, head = _decoder_and_head(model)
    lengths = [len(k) for k in prefixes]
    prefix_ids = _right_pad([torch.tensor(k, dtype=torch.int64) for k in prefixes], pad_token_id).to(device)
    prefix_mask = _right_pad([torch.ones(n, dtype=torch.int64) for n in lengths], 0).to(device)
    cache, cache_kwarg = DynamicCache(), _cache_kwarg(module)
    prefix_states = _states(module, input_ids=prefix_ids, attention_mask=prefix_mask, use_cache=True,
                            **{cache_kwarg: cache})
    index = torch.tensor(group_of, dtype=torch.int64, device=device)
    cache.batch_select_indices(index)  # each sequence continues from its own (autograd-linked) copy
    rests = [sequences[b][starts[b] :].to(torch.int64) for b in active]
    rest_ids = _right_pad(rests, pad_token_id).to(device)
    rest_mask = _right_pad([torch.ones(r.numel(), dtype=torch.int64) for r in rests], 0).to(device)
    offsets = torch.tensor([lengths[g] for g in group_of], dtype=torch.int64, device=device)
    rest_states = _states(
        module,
        input_ids=rest_ids,
        attention_mask=torch.cat([prefix_mask[index], rest_mask], dim=1),
        position_ids=offsets[:, None] + torch.arange(rest_ids.shape[1], device=device),
        use_cache=True,
        **{cache_kwarg: cache},
    )
    rows = [prefix_states.new_zeros(width, prefix_states.shape[-1]) for _ in sequences]
    for a, b in enumerate(active):
        start, n = starts[b], int(sequences[b].numel())
        row = torch.cat([prefix_states[group_of[a], :start], rest_states[a, : n - start]])
        rows[b] = torch.nn.functional.pad(row, (0, 0, 0, width - n))
    ids = _right_pad([s.to(torch.int64) for s in sequences], pad_token_id).to(device)
    scored = _right_pad([m != 0 for m in score_masks], False).to(device)[:, 1:]
    return _score(torch.stack(rows), head, ids, scored, temperature)


def _cache_kwarg(module: torch.nn.Module) -> str:
    """The name `module.forward` takes its KV cache under: `cache` (transformers >= 5.24), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _right_pad(rows: Sequence[torch.Tensor], value: Any) -> torch.Tensor:
    """[len(rows), longest] with each row at the left, `value` after it."""
    width = max(int(r.numel()) for r in rows)
    out = torch.full((len(rows), width), value, dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r
    return out
