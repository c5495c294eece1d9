"""vLLM's logprob dicts as our fields: top alternatives, prompt logprobs, a stream's new tokens.

vLLM reports a request's logprobs as one `{token id: Logprob(logprob, rank, decoded_token)}` dict per position:
with `SamplingParams(logprobs=k)` each generated position's dict holds the k likeliest tokens and the sampled
one (k + 1 entries when the sampled token is not among the k); with `prompt_logprobs=k`,
`RequestOutput.prompt_logprobs` is `[None, dict, ...]`, one dict per prompt token after the first, holding that
token and the k likeliest. Under the backend's `processed_logprobs` mode and its pre-filter hook, generated
positions' values come from log_softmax(logits / T) before top-k/top-p (the hf backend's definition); vLLM
computes prompt logprobs from the raw logits (temperature 1), as the hf backend does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationOutput, TopLogprobs


def top_of(step: Mapping[int, Any], k: int) -> TopLogprobs:
    """The `k` best-ranked (id, logprob) pairs of one position's dict (a sampled token ranked below k is left out)."""
    ranked = sorted(step.items(), key=lambda item: (item[1].rank, -item[1].logprob))
    return tuple((int(token), float(lp.logprob)) for token, lp in ranked[:k])


def with_extra_logprobs(
    out: GenerationOutput,
    completion: Any,
    config: GenerationConfig,
    prompt: Sequence[int],
    prompt_steps: Sequence[Mapping[int, Any] | None] | None,
) -> GenerationOutput:
    """`out` with the top alternatives and prompt logprobs `config` asks for, read from vLLM's dicts
    (`completion.logprobs` and the request output's `prompt_logprobs`); `out` itself when it asks for none."""
    fields: dict[str, Any] = {}
    if config.top_logprobs:
        fields["top_logprobs"] = tuple(top_of(step, config.top_logprobs) for step in completion.logprobs)
    if config.prompt_logprobs is not None:
        steps = list(prompt_steps or ())[1:]  # the first prompt token has none
        if len(steps) != len(prompt) - 1 or any(step is None for step in steps):
            raise RuntimeError(f"vLLM returned {len(steps)} prompt logprob entries for {len(prompt) - 1} positions")
        fields["prompt_logprobs"] = tuple(float(step[t].logprob) for step, t in zip(steps, prompt[1:], strict=True))
        if config.prompt_logprobs:
            fields["prompt_top_logprobs"] = tuple(top_of(step, config.prompt_logprobs) for step in steps)
    return dataclasses.replace(out, **fields) if fields else out


def send_new_tokens(completion, sent: int, on_tokens: Callable, top_k: int = 0) -> int:
    """Pass the tokens of a cumulative `CompletionOutput` beyond the first `sent` to `on_tokens(ids, logprobs,
    tops)` (tops: each token's `top_k` alternatives, None for 0); returns how many are sent now."""
    ids = completion.token_ids
    if len(ids) <= sent:
        return sent
    steps = completion.logprobs or ()
    new = [int(t) for t in ids[sent:]]
    logprobs = [float(step[t].logprob) for step, t in zip(steps[sent:], new, strict=False)]
    if len(logprobs) != len(new):  # never seen: the final output's check names the mismatch
        return sent
    on_tokens(new, logprobs, [top_of(step, top_k) for step in steps[sent:]] if top_k else None)
    return len(ids)
