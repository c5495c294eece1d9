"""Building `DatumSpec`s from chat messages: the prompt is rendered and tokenized once, per message."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.experience.records import DatumSpec, Message


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `message` whose missing or None `content` is "": vLLM's OpenAI server renders it so, and
    templates that read `message['content']` (SmolLM2's) fail on None."""
    return {**message, "content": message.get("content") or ""}


def tokenize_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> tuple[Message, ...]:
    """Render `messages` with the chat template (generation prompt at the end) into token-carrying Messages.

    Each message gets the ids of the text its turn adds to the rendered prompt (the template's own
    default system prompt, if any, goes with the first message; the generation prompt with the last).
    `content: None` (an assistant turn with only tool calls) is rendered as "" (see `template_message`).
    """
    if not messages:
        raise ValueError("a prompt needs at least one message")
    messages = [template_message(m) for m in messages]
    rendered = [""]
    for i in range(1, len(messages) + 1):
        rendered.append(
            tokenizer.apply_chat_template(
                messages[:i],
                tools=list(tools) if tools else None,
                add_generation_prompt=i == len(messages),
                tokenize=False,
            )
        )
    out = []
    for i, message in enumerate(messages):
        before, after = rendered[i], rendered[i + 1]
        if not after.startswith(before):
            raise ValueError(f"the chat template re-renders earlier turns differently at message {i}")
        ids = tokenizer(after[len(before) :], add_special_tokens=False)["input_ids"]
        out.append(Message(role=message["role"], content=message["content"], token_ids=tuple(ids)))
    return tuple(out)


def datum_from_messages(
    tokenizer: PreTrainedTokenizerBase,
    idx: int,
    messages: Sequence[Mapping[str, str]],
    task_name: str,
    extra_env_info: Mapping[str, Any] | None = None,
    agent_name: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> DatumSpec:
    """A ready-to-roll-out row from plain chat messages."""
    return DatumSpec(
        idx=idx,
        message_log=tokenize_prompt(tokenizer, messages, tools),
        task_name=task_name,
        extra_env_info=dict(extra_env_info or {}),
        agent_name=agent_name,
        metadata=dict(metadata or {}),
    )
