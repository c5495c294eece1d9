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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from nemo_rl_ext.models.loading import cache_kwarg

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


def _picked(
    rows: torch.Tensor,
    targets: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    entropy: str | None = None,
    extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """([N] float32 logprob of `targets[i]` under `log_softmax(head(rows[i]) / temperature)`, [N] entropy of that
    distribution or None): the head and the log-softmax run in chunks of `LOGSOFTMAX_CHUNK_ELEMENTS` logits, and
    so does the entropy -sum p log p, from each chunk's log-softmax (`entropy` "detached": no gradient, one more
    pass over the chunk; "grad": with its gradient, each chunk then also keeps p for the backward; None: none), and
    with `extra` ([N, k] ids) the [N, k] logprobs of those ids from the same log-softmax (with the gradient)."""
    vocab = int(getattr(head, "out_features", rows.shape[-1]))
    step = max(1, LOGSOFTMAX_CHUNK_ELEMENTS // vocab)
    picked, entropies, extras = [], [], []
    for lo in range(0, rows.shape[0], step):
        logits = head(rows[lo : lo + step]).float()
        if temperature != 1.0:  # x / 1.0 == x exactly: skip a pass over the logits
            logits = logits / temperature
        log_p = torch.log_softmax(logits, dim=-1)
        picked.append(log_p.gather(-1, targets[lo : lo + step, None])[:, 0])
        if extra is not None:
            extras.append(log_p.gather(-1, extra[lo : lo + step]))
        if entropy is not None:
            with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
                lp = log_p if entropy == "grad" else log_p.detach()
                entropies.append(-(lp.exp() * lp).sum(dim=-1))
    return (torch.cat(picked), torch.cat(entropies) if entropy is not None else None,
            torch.cat(extras) if extra is not None else None)


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    score_mask: torch.Tensor | None = None,
    entropy: str | None = None,
    topk_ids: torch.Tensor | None = None,
) -> Any:
    """[B, T] float32 logprobs of the scored tokens under `log_softmax(logits / temperature)`, 0 elsewhere; with
    `entropy` ("detached" or "grad", see `_picked`) the pair (logprobs, [B, T] entropy of each scored token's
    distribution, 0 elsewhere); with `topk_ids` ([B, T, k] ids per token, a distillation teacher's top-k) the
    triple (logprobs, entropies or None, [B, T, k] logprobs of those ids at each scored token, 0 elsewhere).

    `logprobs[b, t]` scores `input_ids[b, t]` with the logits at position t - 1 (the loss convention), so
    position 0 is always 0. `score_mask` ([B, T], nonzero on the tokens to score, e.g. the loss mask)
    selects the tokens; None scores every position from 1 on. Only the selected rows go through the LM
    head and the log-softmax (in chunks of `LOGSOFTMAX_CHUNK_ELEMENTS` logits); a batch with none
    selected does not run the model. `attention_mask` is 1 on real tokens. Temperature 0 (greedy) counts
    as 1, as in the generation backend.
    """
    temperature = temperature if temperature > 0 else 1.0
    batch, width = input_ids.shape
    zeros = torch.zeros(batch, width, dtype=torch.float32, device=input_ids.device)
    scored = score_mask[:, 1:] != 0 if score_mask is not None else torch.ones_like(input_ids[:, 1:], dtype=torch.bool)
    if width < 2 or not bool(scored.any()):
        return _result(zeros, zeros if entropy else None, topk_ids, None, scored)
    module, head = _decoder_and_head(model)
    states = _states(module, input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    # the states before the scored tokens
    extra = topk_ids[:, 1:][scored] if topk_ids is not None else None
    values, ent, topk = _picked(states[:, :-1][scored], input_ids[:, 1:][scored], head, temperature, entropy, extra)
    out = torch.cat([zeros[:, :1], zeros[:, 1:].masked_scatter(scored, values)], dim=1)
    ent_out = torch.cat([zeros[:, :1], zeros[:, 1:].masked_scatter(scored, ent)], dim=1) if ent is not None else None
    return _result(out, ent_out, topk_ids, topk, scored)


def _result(
    out: torch.Tensor, ent: torch.Tensor | None, topk_ids: torch.Tensor | None, topk: torch.Tensor | None,
    scored: torch.Tensor,
) -> Any:
    """`token_logprobs`' return value: logprobs, the pair with entropies, or the triple with the top-k logprobs
    (`topk`: [N, k] values of the `scored` positions from 1 on, placed into [B, T, k] zeros)."""
    if topk_ids is None:
        return out if ent is None else (out, ent)
    full = torch.zeros(topk_ids.shape, dtype=torch.float32, device=out.device)
    if topk is not None:
        full = torch.cat([full[:, :1], full[:, 1:].masked_scatter(scored[..., None].expand_as(full[:, 1:]), topk)], 1)
    return out, ent, full


def shared_prefix_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    score_mask: torch.Tensor | None = None,
    entropy: str | None = None,
) -> Any:
    """`token_logprobs` of right-padded sequences ([B, T], 0 outside the scored tokens; with `entropy` the pair
    with the entropies, as `token_logprobs`), computing each distinct unscored prefix once; None when no two
    sequences share one (nothing to save).

    A sequence's prefix is every token before its first scored one. The decoder runs over the distinct
    prefixes (right-padded), the KV cache is copied to each sequence of a prefix, and the rest of every
    sequence runs on top of its copy with its own positions; padding between a short prefix and its rest
    is masked out. The head scores a sequence's first scored token from its prefix's last state, the others
    from the rest's states. A sequence with nothing to score is not run (its row is 0). The values equal
    `token_logprobs` up to float rounding (different matmul shapes), and so do the gradients, which flow
    through the cache copies into the shared prefix pass. `attention_mask` must be 1 on a prefix of each row
    (right padding); `score_mask` None scores every position from 1 on (then nothing is shared).
    """
    temperature = temperature if temperature > 0 else 1.0
    batch, width = input_ids.shape
    if score_mask is None or width < 2:
        return None
    lengths, scored_rows, starts, active = _scored_spans(attention_mask, score_mask)
    prefixes: dict[tuple[int, ...], int] = {}
    group_of = [prefixes.setdefault(tuple(input_ids[b, : starts[b]].tolist()), len(prefixes)) for b in active]
    if len(prefixes) == len(active):
        return None
    device = input_ids.device
    module, head = _decoder_and_head(model)
    prefix_lengths = [len(k) for k in prefixes]
    prefix_ids = right_pad([torch.tensor(k, dtype=torch.int64, device=device) for k in prefixes], 0)
    prefix_mask = right_pad([torch.ones(n, dtype=torch.int64, device=device) for n in prefix_lengths], 0)
    cache, keyword = DynamicCache(), cache_kwarg(module)
    prefix_states = _states(
        module, input_ids=prefix_ids, attention_mask=prefix_mask, use_cache=True, **{keyword: cache}
    )
    if cache.get_seq_length() != prefix_ids.shape[1]:  # the model kept no cache (e.g. gradient checkpointing)
        return None
    index = torch.tensor(group_of, dtype=torch.int64, device=device)
    cache.batch_select_indices(index)  # each sequence continues from its own (autograd-linked) copy
    rest_ids = right_pad([input_ids[b, starts[b] : lengths[b]] for b in active], 0)  # padding: masked out below
    rest_mask = right_pad([attention_mask[b, starts[b] : lengths[b]] for b in active], 0)
    offsets = torch.tensor([prefix_lengths[g] for g in group_of], dtype=torch.int64, device=device)
    rest_states = _states(
        module,
        input_ids=rest_ids,
        attention_mask=torch.cat([prefix_mask[index], rest_mask], dim=1),
        position_ids=offsets[:, None] + torch.arange(rest_ids.shape[1], device=device),
        use_cache=True,
        **{keyword: cache},
    )
    states, targets, where = _scored_states(
        input_ids, scored_rows, active, group_of, starts, lengths, prefix_states, rest_states
    )
    values, ent, _ = _picked(states, targets, head, temperature, entropy)
    out = torch.zeros(batch, width, dtype=torch.float32, device=device)
    return out.index_put(where, values) if ent is None else (out.index_put(where, values), out.index_put(where, ent))


def _scored_spans(
    attention_mask: torch.Tensor, score_mask: torch.Tensor
) -> tuple[list[int], torch.Tensor, list[int], list[int]]:
    """For `shared_prefix_logprobs`: each row's length, which of its tokens from 1 on are scored, its first
    scored token, and the rows with any scored token."""
    lengths = attention_mask.sum(dim=1).tolist()
    scored_rows = score_mask[:, 1:] != 0
    hits = scored_rows.any(dim=1).tolist()
    starts = (scored_rows.int().argmax(dim=1) + 1).tolist()  # each row's first scored token
    active = [b for b in range(len(hits)) if hits[b]]
    return lengths, scored_rows, starts, active


def _scored_states(
    input_ids: torch.Tensor,
    scored_rows: torch.Tensor,
    active: list[int],
    group_of: list[int],
    starts: list[int],
    lengths: list[int],
    prefix_states: torch.Tensor,
    rest_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """For `shared_prefix_logprobs`: the hidden state before each scored token of the active sequences (the
    first from its prefix's last state, the others from its rest's), those tokens, and their (row, position)."""
    rows, targets, where_b, where_t = [], [], [], []
    for a, b in enumerate(active):
        start, n = starts[b], lengths[b]
        keep = scored_rows[b, start - 1 : n - 1]  # tokens start .. n-1
        before = torch.cat([prefix_states[group_of[a], start - 1 : start], rest_states[a, : n - start - 1]])
        rows.append(before[keep])
        targets.append(input_ids[b, start:n][keep])
        t = torch.arange(start, n, device=input_ids.device)[keep]
        where_t.append(t)
        where_b.append(torch.full_like(t, b))
    return torch.cat(rows), torch.cat(targets), (torch.cat(where_b), torch.cat(where_t))


def right_pad(rows: Sequence[torch.Tensor], value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[len(rows), longest] with each 1-D row at the left and `value` after it, on the rows' device (`dtype`:
    the rows' by default)."""
    width = max(int(r.numel()) for r in rows)
    out = torch.full((len(rows), width), value, dtype=dtype or rows[0].dtype, device=rows[0].device)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r
    return out
