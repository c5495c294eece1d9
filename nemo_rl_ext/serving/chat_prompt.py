"""Prompt ids of a chat request: rendered with the chat template, or continued token-exactly.

Token-in, token-out: when the request holds an assistant message that carries the `prompt_token_ids` and
`generation_token_ids` it was generated from and as (the last such message), the prompt is exactly those
ids followed by the template's text for everything after that turn, tokenized on its own. Earlier turns
are never re-rendered or re-tokenized, so where the ids and the rendered text disagree, the ids win.

The text after that turn is found by `data.chat.text_after_turn`, as observations are framed: render the
real conversation with a marker as that assistant turn's content and take what follows the marker (the
close of the turn, any number of tool/user messages, the tools block if the template puts it there, the
generation prompt). If the generation already ended with the EOS token that closes the turn, the
template's copy of it is dropped.

`/tokenize` and `/v1/chat/completions` both call `build_chat_prompt`, so their prompt ids are equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.data.chat import TURN_MARK, TurnNotRendered, text_after_turn
from nemo_rl_ext.serving.api_errors import ApiError
from nemo_rl_ext.serving.openai_schemas import PromptParams


@dataclass(frozen=True)
class ChatPrompt:
    """The prompt of one request."""

    token_ids: list[int]
    """Every prompt id, prefix included."""
    prefix_len: int
    """How many leading ids were copied from an assistant message's prompt + generation ids (0: none)."""
    continued_message: int | None
    """Index of the assistant message whose ids form the prefix; None when the prompt is rendered whole."""
    rendered_text: str
    """The template text that was tokenized: the whole prompt, or the part after the prefix."""


def continued_message_index(params: PromptParams) -> int | None:
    """Index of the last assistant message that carries prompt and generation token ids, if any."""
    for i in range(len(params.messages) - 1, -1, -1):
        if params.messages[i].carries_token_ids:
            return i
    return None


def build_chat_prompt(
    tokenizer: PreTrainedTokenizerBase, params: PromptParams, *, trust_request_chat_template: bool = False
) -> ChatPrompt:
    """The prompt ids of `params` (see the module docstring); raises ApiError (400) if it can't be built.

    A chat template sent with the request is refused unless `trust_request_chat_template`.
    """
    params.check_chat_template(trust_request_chat_template)
    messages = [m.for_template() for m in params.messages]
    k = continued_message_index(params)
    if k is None:
        text = _render(tokenizer, messages, params)
        ids = _tokenize(tokenizer, text, params.add_special_tokens)
        return ChatPrompt(ids, 0, None, text)

    source = params.messages[k]
    prefix = [*source.prompt_token_ids, *source.generation_token_ids]
    messages[k] = {"role": "assistant", "content": TURN_MARK}
    text = _render(tokenizer, messages, params)
    ended_with_eos = bool(source.generation_token_ids) and source.generation_token_ids[-1] == tokenizer.eos_token_id
    try:
        delta = text_after_turn(text, drop_eos=(tokenizer.eos_token or "") if ended_with_eos else "")
    except TurnNotRendered:
        raise ApiError(
            f"the chat template does not render the content of messages[{k}] (the assistant turn to continue) "
            "exactly once, so the text after it cannot be found; token-exact continuation is impossible",
            param=f"messages.{k}",
        ) from None
    return ChatPrompt(prefix + _tokenize(tokenizer, delta, False), len(prefix), k, delta)


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], params: PromptParams) -> str:
    """The template's text; a request's own `chat_template` is used only if the caller checked it first."""
    kwargs = dict(params.chat_template_kwargs or {})
    if params.chat_template is not None:
        kwargs["chat_template"] = params.chat_template
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=params.template_tools(),
            add_generation_prompt=params.add_generation_prompt,
            continue_final_message=params.continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except ApiError:
        raise
    except Exception as exc:  # jinja errors (raise_exception in templates), transformers' ValueErrors
        raise ApiError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from exc


def _tokenize(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
