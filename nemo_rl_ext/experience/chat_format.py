"""Turning an environment observation into the exact text that follows an assistant turn."""

from __future__ import annotations

from functools import lru_cache

from transformers import PreTrainedTokenizerBase

_ASSISTANT_MARK = "\x1fASSISTANT-8f3a\x1f"
_CONTENT_MARK = "\x1fCONTENT-8f3a\x1f"


class ObservationFormatter:
    """Renders observations with the tokenizer's own chat template, as a continuation of the context.

    The template is rendered once per role around marker strings; what sits between the end of the
    assistant's turn and the next generation prompt becomes the frame of the observation. Earlier turns
    are never re-rendered or re-tokenized.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.eos_token or ""
        self._frame = lru_cache(maxsize=16)(self._compute_frame)

    def _compute_frame(self, role: str) -> tuple[str, str]:
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ASSISTANT_MARK}]
        text = self.tokenizer.apply_chat_template(
            [*base, {"role": role, "content": _CONTENT_MARK}], add_generation_prompt=True, tokenize=False
        )
        after = text[text.rindex(_ASSISTANT_MARK) + len(_ASSISTANT_MARK) :]
        if self.eos_text and after.startswith(self.eos_text):
            after = after[len(self.eos_text) :]
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
