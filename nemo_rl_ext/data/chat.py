"""The one chat renderer: prompts tokenized per message, and the template's text after an assistant turn.

Everything uses the tokenizer's own chat template; earlier turns are never re-rendered or re-tokenized.
`text_after_turn` is the one way to find what a template puts after an assistant turn (the close of the
turn, the next messages, the generation prompt): `ObservationFormatter` frames observations with it, and the
policy server's token-exact continuation (`serving.chat_prompt`) continues a conversation with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from nemo_rl_ext.data.records import Message

if TYPE_CHECKING:  # annotations only: importing transformers takes seconds, which `--help` and config checks skip
    from transformers import PreTrainedTokenizerBase

TURN_MARK = "@@NEMO_RL_EXT_ASSISTANT_TURN_5b1e9c@@"
"""Content that stands in for an assistant turn while rendering (no whitespace: templates trim)."""
_CONTENT_MARK = "@@NEMO_RL_EXT_CONTENT_5b1e9c@@"
"""Content that stands in for an observation while its frame is rendered."""


class TurnNotRendered(ValueError):
    """The chat template did not render the marked assistant turn's content exactly once."""


def text_after_turn(rendered: str, *, drop_eos: str = "") -> str:
    """The template's text after the assistant turn whose content is `TURN_MARK` in `rendered`.

    `drop_eos`: the EOS text the caller already has at the end of that turn (its generation ended with it);
    the template's own copy, where the text starts with it, is dropped. Raises `TurnNotRendered` unless the
    marker appears exactly once (a template that drops or repeats the turn cannot be continued).
    """
    count = rendered.count(TURN_MARK)
    if count != 1:
        raise TurnNotRendered(f"the chat template rendered the assistant turn's content {count} times, not once")
    after = rendered[rendered.index(TURN_MARK) + len(TURN_MARK) :]
    return after.removeprefix(drop_eos) if drop_eos else after


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


class ObservationFormatter:
    """Renders observations with the tokenizer's own chat template, as a continuation of the context.

    The template is rendered once per role around marker strings; what `text_after_turn` finds after the
    assistant's turn (up to the next generation prompt) becomes the frame of the observation. The template's
    EOS that closes the turn is left out of the frame: `render` adds it when the model did not write it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.eos_token or ""
        self._frame = lru_cache(maxsize=16)(self._compute_frame)

    def _compute_frame(self, role: str) -> tuple[str, str]:
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": TURN_MARK}]
        text = self.tokenizer.apply_chat_template(
            [*base, {"role": role, "content": _CONTENT_MARK}], add_generation_prompt=True, tokenize=False
        )
        after = text_after_turn(text, drop_eos=self.eos_text)
        if _CONTENT_MARK not in after:
            raise ValueError(f"the chat template drops messages of role {role!r}; cannot render observations")
        prefix, suffix = after.split(_CONTENT_MARK, 1)
        return prefix, suffix

    def render(self, role: str, content: str | None, assistant_ended_with_eos: bool) -> str:
        """Text to append after an assistant turn: closes the turn if the model didn't, then the observation.

        None content is rendered as "" (as vLLM's OpenAI server does), never as the text "None".
        """
        prefix, suffix = self._frame(role)
        close = "" if assistant_ended_with_eos else self.eos_text
        return f"{close}{prefix}{content or ''}{suffix}"

    def tokenize(self, text: str) -> list[int]:
        """Token ids of rendered text, with no special tokens added (template tokens are in the text)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
