"""Turning NeMo Gym `/run` results into `Completion`s (token ids and logprobs from the output items)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.data.records import Completion, Message, StopReason, check_reward_components
from nemo_rl_ext.experience.prompt_length import too_long_extras

TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
GENERATED_TYPES = frozenset({"function_call", "reasoning"})
"""Output item types a model call produces (besides assistant messages); tool outputs are not among them."""


class GymResultError(ValueError):
    """A Gym result whose token information is inconsistent (the prefix property is broken)."""


def result_to_completion(
    result: Mapping[str, Any],
    agent_name: str,
    tokenizer: PreTrainedTokenizerBase,
    reward_components: Sequence[str] = (),
) -> Completion:
    """One Gym result -> one Completion.

    Of the items one model call produced, the last carries the prompt ids of that call and the ids it
    generated (Gym 0.7.0; earlier items of the call carry none). The first call's prompt becomes the
    prompt message; later calls' prompts must start with everything seen so far, and the ids in between
    (tool results, user turns) become one message each.

    A model call the policy server refused for context length comes back from Gym as an empty assistant
    message without token ids and the response `incomplete`: the rollout is a truncated completion (with
    the calls before it, possibly none, and Gym's reward), not an error. Refused at the first call (nothing
    generated), the prompt alone was too long: the completion carries `records.PROMPT_TOO_LONG` (the prompt's
    length unknown here: Gym does not pass the refusal on).

    `reward_components` names the /verify response's fields that are parts of the reward (`gym_components`).
    """
    response = result.get("response") or {}
    messages, last_generated_has_ids, last_generated = _output_messages(response.get("output") or [], tokenizer)
    turns = sum(m.role == "assistant" for m in messages)
    incomplete = response.get("status") == "incomplete" or bool(response.get("incomplete_details"))
    refused_for_length = incomplete and last_generated_has_ids is False
    reason, error = _stop_reason(result, incomplete, turns, refused_for_length)
    last_text = next((m.content for m in reversed(messages) if m.role == "assistant"), None)
    extras: dict[str, Any] = {"answer": _final_answer(last_text), "gym_result": dict(result)}
    if refused_for_length and turns == 0 and error is None and _is_placeholder(last_generated):
        # the first call refused (Gym's empty stand-in, not a reply without ids): the prompt alone is too long
        extras.update(too_long_extras(None, None))
    return Completion(
        message_log=tuple(messages),
        reward=0.0 if error else float(result.get("reward") or 0.0),
        truncated=incomplete,
        stop_reason=reason,
        num_turns=turns,
        agent_name=agent_name,
        env_extras=extras,
        error=error,
        reward_components={} if error else gym_components(result, agent_name, reward_components),
    )


def gym_components(result: Mapping[str, Any], agent_name: str, names: Sequence[str]) -> dict[str, float]:
    """The named reward components of a Gym result: each name a top-level field of the /verify response (Gym's
    /run result carries all of them), else a key of its `reward_components` mapping (NeMo-RL's multi-reward
    servers); `records.RewardComponentError` naming the environment server (else the agent) and every field
    that is missing or not a finite number."""
    if not names:
        return {}
    nested = result.get("reward_components")
    nested = nested if isinstance(nested, Mapping) else {}
    found = {n: result[n] if n in result else nested[n] for n in names if n in result or n in nested}
    env = str(result.get("_ng_environment_server") or agent_name)
    return check_reward_components(env, found, required=names)


def _output_messages(
    output: Sequence[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase
) -> tuple[list[Message], bool | None, Mapping[str, Any]]:
    """The messages of a Gym response's output items (see `result_to_completion`), whether the last generated
    item carried token ids (None: no generated item at all), and that item ({} when none)."""
    messages: list[Message] = []
    seen: list[int] = []
    last_call: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    previous_type = None
    last_generated_has_ids: bool | None = None  # None: no generated item at all
    last_generated: Mapping[str, Any] = {}
    for n, item in enumerate(output):
        has_ids = all(item.get(k) is not None for k in TOKEN_KEYS)
        if _is_generated(item):
            last_generated_has_ids, last_generated = has_ids, item
        else:  # what came in between calls (a tool output, a user message) names the ids in between
            previous_type = item.get("type", previous_type)
        if not has_ids:
            continue
        prompt, generated = tuple(item["prompt_token_ids"]), tuple(item["generation_token_ids"])
        if (prompt, generated) == last_call:  # several items from the same model call
            continue
        last_call = (prompt, generated)
        _check_call(n, item, prompt, generated, seen)
        messages.extend(_call_messages(item, prompt, generated, seen, previous_type, tokenizer))
        seen = list(prompt) + list(generated)
    return messages, last_generated_has_ids, last_generated


def _check_call(
    n: int, item: Mapping[str, Any], prompt: tuple[int, ...], generated: tuple[int, ...], seen: list[int]
) -> None:
    """A model call's ids are consistent: one logprob per generated id, and its prompt extends `seen`."""
    if len(generated) != len(item["generation_log_probs"]):
        raise GymResultError(
            f"output item {n}: {len(generated)} generation ids but {len(item['generation_log_probs'])} logprobs"
        )
    if list(prompt[: len(seen)]) != seen:
        raise GymResultError(
            f"output item {n}: its prompt ids do not start with the previous prompt + generation ids "
            "(the policy server re-tokenized an earlier turn)"
        )


def _call_messages(
    item: Mapping[str, Any],
    prompt: tuple[int, ...],
    generated: tuple[int, ...],
    seen: list[int],
    previous_type: str | None,
    tokenizer: PreTrainedTokenizerBase,
) -> list[Message]:
    """A model call's messages: the ids its prompt adds to `seen` (a user or tool turn), if any, then its reply."""
    messages: list[Message] = []
    between = prompt[len(seen) :]
    if between:
        role = "user" if not seen else ("tool" if previous_type == "function_call_output" else "user")
        messages.append(Message(role, tokenizer.decode(between, skip_special_tokens=True), between))
    text = tokenizer.decode(generated, skip_special_tokens=True)
    messages.append(Message("assistant", text, generated, tuple(float(x) for x in item["generation_log_probs"])))
    return messages


def _stop_reason(
    result: Mapping[str, Any], incomplete: bool, turns: int, refused_for_length: bool
) -> tuple[StopReason, str | None]:
    """The completion's stop reason and error: Gym's failure, no model call at all, else truncated or natural."""
    failure = result.get("failure_kind")
    if failure:
        return StopReason.ERROR, f"{failure}: {result.get('failure_reason')}"[:500]
    if turns == 0 and not refused_for_length:
        return StopReason.ERROR, "Gym result has no output item with token ids"
    return (StopReason.TRUNCATED if incomplete else StopReason.NATURAL), None


def _is_placeholder(item: Mapping[str, Any]) -> bool:
    """True for the assistant message Gym puts in place of a refused model call: no text at all."""
    if item.get("type") != "message":
        return False
    content = item.get("content")
    if content is None or content == "":
        return True
    return isinstance(content, list) and not any(
        isinstance(part, Mapping) and part.get("text") for part in content
    )


def _is_generated(item: Mapping[str, Any]) -> bool:
    """True for an output item a model call produced: an assistant message, a function call, reasoning."""
    kind = item.get("type")
    return kind in GENERATED_TYPES or (kind == "message" and item.get("role", "assistant") == "assistant")


def _final_answer(text: str | None) -> str | None:
    if not text:
        return None
    # lazy: the environment registry imports every implementation
    from nemo_rl_ext.environments.math_env import extract_answer

    return extract_answer(text)


def gym_numeric_metrics(results: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, float]:
    """Mean of every numeric top-level key of Gym's results, per agent: `agent/<name>/gym/<key>/mean`."""
    values: dict[tuple[str, str], list[float]] = {}
    for agent, result in results:
        for key, value in result.items():
            if key.startswith("_ng_") or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            values.setdefault((agent, key), []).append(float(value))
    return {f"agent/{agent}/gym/{key}/mean": float(np.mean(v)) for (agent, key), v in sorted(values.items())}
