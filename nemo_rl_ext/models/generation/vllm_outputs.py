"""vLLM's finished `CompletionOutput` as our `GenerationOutput`: its tokens, logprobs, finish reason and weight
version (importable without vLLM: these read only the output's fields)."""

from __future__ import annotations

from nemo_rl_ext.models.generation.interfaces import FinishReason, GenerationConfig, GenerationOutput


def to_generation_output(
    completion,
    config: GenerationConfig,
    budget: int,
    budget_reason: FinishReason,
    eos_ids: frozenset[int],
    *,
    weight_version: int = 0,
    aborted_by_update: bool = False,
) -> GenerationOutput:
    """Our `GenerationOutput` from a vLLM `CompletionOutput` (token_ids, logprobs, finish/stop reason).

    vLLM says "length" for both limits; `budget` (the max_tokens we asked for) and `budget_reason` say
    which one it was. For "stop" the precedence is the hf backend's: a requested stop token, then EOS,
    then a stop string (vLLM's stop_reason is the string, the stop token id, or None for EOS). "abort" is
    `FinishReason.ABORTED` (partial output kept) when an abort-mode weight update ended the request, and
    an error otherwise.
    """
    ids = tuple(int(t) for t in completion.token_ids)
    steps = completion.logprobs
    if steps is None or len(steps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(steps or ())} logprob entries for {len(ids)} tokens")
    logprobs = tuple(float(step[tok].logprob) for step, tok in zip(steps, ids, strict=True))
    reason, stop = completion.finish_reason, completion.stop_reason
    v = weight_version
    if reason == "abort" and aborted_by_update:
        return GenerationOutput(ids, logprobs, FinishReason.ABORTED, weight_version=v)
    if reason == "length":
        if len(ids) != budget:
            raise RuntimeError(f"vLLM stopped for length after {len(ids)} tokens; max_tokens was {budget}")
        return GenerationOutput(ids, logprobs, budget_reason, weight_version=v)
    if reason != "stop" or not ids:
        raise RuntimeError(f"vLLM ended the request with finish_reason={reason!r} (stop_reason={stop!r})")
    last = ids[-1]
    if last in config.stop_token_ids:
        return GenerationOutput(ids, logprobs, FinishReason.STOP_TOKEN, last, v)
    if last in eos_ids or not isinstance(stop, str):
        return GenerationOutput(ids, logprobs, FinishReason.EOS, last, v)
    return GenerationOutput(ids, logprobs, FinishReason.STOP_STRING, stop, v)


def weight_version_of(completion) -> int:
    """The one weight version a finished vLLM `CompletionOutput`'s tokens were sampled under.

    Read from vLLM's `weight_versions` spans (the engine labels each step with the version set during the
    last update); raises if the tokens span several versions or carry no label.
    """
    spans = getattr(completion, "weight_versions", None)
    versions = {span.version for span in spans or () if span.end > span.start}
    if len(versions) != 1:
        raise RuntimeError(
            f"vLLM reported weight versions {sorted(versions)} for {len(completion.token_ids)} tokens "
            f"(spans {spans!r}); an output must carry exactly one"
        )
    return int(versions.pop())
