"""A scripted policy: a `GenerationInterface` that answers with chosen text or token ids instead of a model.

The replies are real ids of whatever tokenizer it is given (the tiny model's, SmolLM2's, ...), so everything
downstream (chat rendering, tool-call parsing, token-exact records, the policy server) sees what a model
that wrote that text would have produced. It can also wrap a real backend and only step in for some
requests (to inject faults), recording every call either way.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nemo_rl_ext.models.generation.interfaces import (
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    InFlightPolicy,
    StreamEvent,
    TokenDelta,
    check_in_flight,
    check_prompt,
    check_state_dict,
)
from nemo_rl_ext.testing.faults import Fault, inject

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

Reply = str | Sequence[int] | GenerationOutput | BaseException | Fault
"""One scripted answer: text (encoded with the tokenizer, no special tokens added), token ids, a whole
`GenerationOutput`, an exception instance (raised) or a `Fault` (a hang)."""

ASSISTANT_HEADER = "<|im_start|>assistant"
"""How a ChatML prompt (the tiny model's and SmolLM2's template) opens each assistant turn."""


@dataclass(frozen=True)
class ScriptedRequest:
    """What a reply function sees of one `generate_async` call."""

    prompt_token_ids: list[int]
    """The prompt as sent."""
    config: GenerationConfig
    """The request's sampling parameters (seed, stops, max_new_tokens)."""
    index: int
    """0 for the generation's first call, +1 per call."""
    tokenizer: Any
    """The scripted generation's tokenizer (None for an ids-only one)."""
    turn_marker: str
    """The text that opens an assistant turn in a decoded prompt."""

    @functools.cached_property
    def prompt_text(self) -> str:
        """The prompt decoded with special tokens kept (computed on first use)."""
        if self.tokenizer is None:
            raise ValueError("an ids-only ScriptedGeneration (tokenizer=None) has no prompt text")
        return self.tokenizer.decode(self.prompt_token_ids)

    @property
    def turn(self) -> int:
        """0 for the first assistant turn of a conversation: the turn markers in the prompt, minus one."""
        return max(self.prompt_text.count(self.turn_marker) - 1, 0)


@dataclass(frozen=True)
class ScriptedCall:
    """One recorded `generate_async` call."""

    prompt_token_ids: list[int]
    """The prompt as sent."""
    config: GenerationConfig
    """The request's sampling parameters."""
    output: GenerationOutput | None
    """What was returned; None when the call raised or hung."""


ReplyFunction = Callable[[ScriptedRequest], "Reply | None"]
"""Gives the reply to one request; None lets the wrapped backend answer."""
Logprobs = float | Callable[[Sequence[int], Sequence[int], GenerationConfig], Sequence[float]]
"""The logprob of every scripted token, or a function (prompt ids, output ids, config) -> one per output id."""


class ScriptedGeneration(GenerationInterface):
    """Answers from a script: a list of replies (picked by turn or by call) or a function of the request.

    - `replies` a sequence, `pick="turn"`: the k-th assistant turn of each conversation gets `replies[k]`
      (the last one for later turns), read off the turn markers in the decoded prompt; `pick="call"`: the
      j-th call gets `replies[j]`, and a call past the end fails the test with an AssertionError.
    - `replies` a function of a `ScriptedRequest`: its reply; None hands the request to `backend`.
    - `replies` None: every request goes to `backend`, a recording wrapper (with no backend, a call fails
      the test with an AssertionError).

    A text or id reply is cut at `config.max_new_tokens` (`MAX_NEW_TOKENS`, truncated) unless
    `cut_at_max_new_tokens=False` (a script whose replies outgrow the caller's limit); otherwise it ends
    with `EOS` when its last id is the tokenizer's EOS (`matched_stop` is that id, as the hf backend says),
    else with `finish_reason`. `eos=True` appends EOS to text replies. Every call first sleeps `delay_s`
    (0 still suspends the caller once, as a real engine does); a request that is waiting it out counts as
    not yet started: a weight update meanwhile applies to it.

    `update_weights` follows the interface: `in_flight` is checked, the state dict must hold every name in
    `expected_weights` (if given), each update is recorded in `updates` and bumps `weight_version`, which
    every later output carries. A scripted reply is made at once, so no generation is ever in flight
    across an update. With a backend, updates and shutdown go to it. After `shutdown` (idempotent) calls
    raise RuntimeError. `generate_stream` sends each reply one token per delta, as an engine streams.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        replies: Sequence[Reply] | ReplyFunction | None = (),
        *,
        pick: str = "turn",
        eos: bool = False,
        finish_reason: FinishReason = FinishReason.STOP_STRING,
        logprobs: Logprobs = -0.5,
        delay_s: float = 0.0,
        max_model_len: int = 4096,
        backend: GenerationInterface | None = None,
        expected_weights: Sequence[str] | None = None,
        record: bool = True,
        turn_marker: str = ASSISTANT_HEADER,
        cut_at_max_new_tokens: bool = True,
    ) -> None:
        if pick not in ("turn", "call"):
            raise ValueError(f'pick must be "turn" or "call", got {pick!r}')
        self._tokenizer = tokenizer
        self.replies = replies
        """The script; may be replaced between calls (None: the backend answers everything)."""
        self.pick = pick
        self.eos = eos
        self.finish_reason = finish_reason
        self.logprobs = logprobs
        self.delay_s = delay_s
        self._max_model_len = max_model_len
        self.backend = backend
        self.expected_weights = expected_weights
        self.record = record
        self.turn_marker = turn_marker
        self.cut_at_max_new_tokens = cut_at_max_new_tokens
        self.calls: list[ScriptedCall] = []
        """Every call in order (when `record`), answered, raised or hanging."""
        self.num_calls = 0
        """generate_async calls so far (counted whether or not `record`)."""
        self.updates: list[tuple[Mapping[str, Any], str]] = []
        """(state_dict, in_flight) of every update_weights call, in order."""
        self._version = 0
        self._shut_down = False

    # ---- the declared members ---------------------------------------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The tokenizer replies are encoded with (None: replies are ids only)."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self._tokenizer = tokenizer

    @property
    def max_model_len(self) -> int:
        """Most tokens a request may hold; longer prompts are refused as the real backends refuse them."""
        return self._max_model_len

    @property
    def weight_version(self) -> int:
        """0 at start, +1 per update_weights (the backend's own version when it wraps one)."""
        return self.backend.weight_version if self.backend is not None else self._version

    async def generate_async(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        """The scripted reply to this request (or the backend's); see the class docstring."""
        self._check_open()
        prompt = list(prompt_token_ids)
        if self._tokenizer is not None:
            check_prompt(prompt, self._max_model_len, len(self._tokenizer))
        request = ScriptedRequest(prompt, config, self.num_calls, self._tokenizer, self.turn_marker)
        self.num_calls += 1
        call_index = len(self.calls)
        if self.record:
            self.calls.append(ScriptedCall(prompt, config, None))
        await asyncio.sleep(self.delay_s)  # even 0 suspends the caller once, as a real engine does
        reply = self._reply(request)
        if reply is None:
            if self.backend is None:
                raise AssertionError(f"no reply scripted for call {request.index} and no backend to ask")
            out = await self.backend.generate_async(prompt, config)
        elif isinstance(reply, BaseException | Fault):
            await inject(reply)
        else:
            out = self._output(prompt, reply, config)
        if self.record:
            self.calls[call_index] = ScriptedCall(prompt, config, out)
        return out

    async def generate_stream(
        self, prompt_token_ids: Sequence[int], config: GenerationConfig
    ) -> AsyncIterator[StreamEvent]:
        """The output `generate_async` gives, one token per delta (suspending the caller between them, as an
        engine's decode steps do), then the output itself."""
        out = await self.generate_async(prompt_token_ids, config)
        for token, logprob in zip(out.output_ids, out.logprobs, strict=True):
            yield TokenDelta((token,), (logprob,))
            await asyncio.sleep(0)
        yield out

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], *, in_flight: InFlightPolicy = "finish") -> None:
        """Record the update and serve the next version (the backend's update when it wraps one)."""
        self._check_open()
        check_in_flight(in_flight)
        if self.expected_weights is not None:
            check_state_dict(self.expected_weights, state_dict)
        if self.backend is not None:
            self.backend.update_weights(state_dict, in_flight=in_flight)
        self.updates.append((state_dict, in_flight))
        self._version += 1

    def shutdown(self) -> None:
        """Idempotent; shuts the wrapped backend down too. Later calls raise RuntimeError."""
        if self._shut_down:
            return
        self._shut_down = True
        if self.backend is not None:
            self.backend.shutdown()

    # ---- what the tests read ------------------------------------------------------------------------

    @property
    def prompts(self) -> list[list[int]]:
        """The prompt of every recorded call, in order."""
        return [c.prompt_token_ids for c in self.calls]

    @property
    def configs(self) -> list[GenerationConfig]:
        """The config of every recorded call, in order."""
        return [c.config for c in self.calls]

    def encode(self, text: str) -> list[int]:
        """The ids of `text` under this generation's tokenizer, no special tokens added."""
        if self._tokenizer is None:
            raise ValueError("an ids-only ScriptedGeneration (tokenizer=None) cannot encode text")
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    # ---- internals -------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("this ScriptedGeneration was shut down")

    def _reply(self, request: ScriptedRequest) -> Reply | None:
        replies = self.replies
        if replies is None:
            return None
        if callable(replies):
            return replies(request)
        if not replies:
            raise AssertionError(f"no reply scripted: this generation must not be called (call {request.index})")
        if self.pick == "call":
            if request.index >= len(replies):
                raise AssertionError(f"call {request.index} but only {len(replies)} replies are scripted")
            return replies[request.index]
        return replies[0] if len(replies) == 1 else replies[min(request.turn, len(replies) - 1)]

    def _output(self, prompt: list[int], reply: Reply, config: GenerationConfig) -> GenerationOutput:
        if isinstance(reply, GenerationOutput):
            return reply if reply.weight_version == self.weight_version else _with_version(reply, self.weight_version)
        eos_id = getattr(self._tokenizer, "eos_token_id", None)
        if isinstance(reply, str):
            ids = self.encode(reply) + ([eos_id] if self.eos else [])
        else:
            ids = list(reply)
        cut = ids[: config.max_new_tokens] if self.cut_at_max_new_tokens else ids
        if len(cut) < len(ids):
            reason, matched = FinishReason.MAX_NEW_TOKENS, None
        elif cut and eos_id is not None and cut[-1] == eos_id:
            reason, matched = FinishReason.EOS, eos_id
        else:
            reason, matched = self.finish_reason, None
        if callable(self.logprobs):
            logprobs = tuple(self.logprobs(prompt, cut, config))
        else:
            logprobs = (float(self.logprobs),) * len(cut)
        return GenerationOutput(tuple(cut), logprobs, reason, matched, self.weight_version)


def _with_version(out: GenerationOutput, version: int) -> GenerationOutput:
    return GenerationOutput(out.output_ids, out.logprobs, out.finish_reason, out.matched_stop, version)
