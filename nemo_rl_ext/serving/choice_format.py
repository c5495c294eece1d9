"""How a finished generation reads in an OpenAI answer: its text, and its logprobs in the chat format.

Shared by chat completions (`policy_server`) and text completions (`completions`), so both cut the text and
spell tokens the same way.
"""

from __future__ import annotations

import math

from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.interfaces import FinishReason, GenerationOutput, TopLogprobs

MIN_LOGPROB = -9999.0
"""Stand-in for a -inf logprob (JSON has no infinity); vLLM uses the same value."""


def finite(logprob: float) -> float:
    """`logprob`, with -inf (and nan) as `MIN_LOGPROB`."""
    return float(logprob) if math.isfinite(logprob) else MIN_LOGPROB


def text_ids(out: GenerationOutput) -> list[int]:
    """The generated ids that make the text: the token that ended the generation is not part of it (as in vLLM)."""
    ids = list(out.output_ids)
    if out.finish_reason in (FinishReason.EOS, FinishReason.STOP_TOKEN) and ids:
        return ids[:-1]
    return ids


def generated_text(tokenizer: PreTrainedTokenizerBase, out: GenerationOutput, skip_special_tokens: bool) -> str:
    """The text of a generation, cut before the stop string that ended it (vLLM's default)."""
    text = tokenizer.decode(text_ids(out), skip_special_tokens=skip_special_tokens)
    if out.finish_reason is FinishReason.STOP_STRING and isinstance(out.matched_stop, str):
        cut = text.find(out.matched_stop)
        text = text[:cut] if cut != -1 else text
    return text


def stop_reason(out: GenerationOutput) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or stop token id that ended the generation (None for EOS, length)."""
    if out.finish_reason in (FinishReason.STOP_STRING, FinishReason.STOP_TOKEN):
        return out.matched_stop
    return None


def token_text(tokenizer: PreTrainedTokenizerBase, token_id: int, as_token_ids: bool) -> str:
    """How a token is spelled in logprobs: its decoded text, or `token_id:<id>` (vLLM's
    `return_tokens_as_token_ids`)."""
    return f"token_id:{token_id}" if as_token_ids else tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer: PreTrainedTokenizerBase, out: GenerationOutput, as_token_ids: bool) -> dict:
    """A chat choice's `logprobs`: per generated token its logprob and, when asked, its top alternatives."""
    tops: tuple[TopLogprobs | None, ...] = out.top_logprobs or (None,) * len(out.output_ids)
    content = []
    for token_id, logprob, top in zip(out.output_ids, out.logprobs, tops, strict=True):
        entry = _entry(tokenizer, token_id, logprob, as_token_ids)
        entry["top_logprobs"] = [_entry(tokenizer, t, lp, as_token_ids) for t, lp in top or ()]
        content.append(entry)
    return {"content": content}


def _entry(tokenizer: PreTrainedTokenizerBase, token_id: int, logprob: float, as_token_ids: bool) -> dict:
    token = token_text(tokenizer, token_id, as_token_ids)
    return {"token": token, "logprob": finite(logprob), "bytes": list(token.encode("utf-8", errors="replace"))}
