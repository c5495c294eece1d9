"""The generation contract every backend implements: token ids in, token ids and logprobs out."""

from __future__ import annotations

import abc
import enum
import json
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SEED_LIMIT = 2**63
"""Seeds are in [0, SEED_LIMIT): what torch's and vLLM's generators accept (a signed 64-bit integer)."""
MAX_TOP_K = 2**31 - 1
"""Largest top_k accepted (vLLM keeps top_k in int32 tensors); any k at or above the vocabulary means all."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask for per token (`top_logprobs`, `prompt_logprobs`), as OpenAI allows."""

TopLogprobs = tuple[tuple[int, float], ...]
"""The likeliest tokens at one position, best first: (token id, logprob) pairs."""

PromptScores = tuple[tuple[float, ...], tuple[TopLogprobs, ...] | None]
"""One prompt's scores: each prompt id's logprob from the 2nd on, and its top alternatives (None for k = 0)."""

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


class StructuredOutput(BaseModel):
    """A constraint on a generation's text: JSON that matches a JSON Schema (compiled by llguidance)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_schema: str = Field(
        default='{"type": "object"}',
        description="The JSON Schema, as JSON text, that the generated text must match; the default accepts "
        "any JSON object (OpenAI's response_format json_object).",
    )

    @field_validator("json_schema")
    @classmethod
    def _a_json_object(cls, value: str) -> str:
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        return value


class GenerationConfig(BaseModel):
    """Sampling parameters of one request; validated on construction (every bad field in one error)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = Field(default=256, ge=1, description="Most tokens to generate for this request.")
    temperature: float = Field(
        default=1.0, ge=0.0, allow_inf_nan=False, description="Softmax temperature; 0 means greedy."
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int | None = Field(
        default=None, ge=1, le=MAX_TOP_K, description="Sample among the k likeliest tokens; None = all."
    )
    stop_strings: tuple[str, ...] = Field(
        default=(), description="Generation ends once the generated text contains one of these."
    )
    stop_token_ids: tuple[int, ...] = Field(
        default=(), description="Generation ends after one of these ids (kept in the output)."
    )
    seed: int | None = Field(
        default=None, ge=0, lt=SEED_LIMIT, description="Seed of this request's sampler; None = unseeded."
    )
    top_logprobs: int = Field(
        default=0,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Also report this many likeliest tokens per generated position, from the distribution the "
        "logprobs come from (after temperature, before top-k/top-p); 0: none.",
    )
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Also score the prompt: each prompt token's logprob (from the 2nd on) under log_softmax(logits) "
        "at temperature 1, as vLLM's prompt_logprobs, plus this many likeliest tokens per position; None: no.",
    )
    session: tuple[int, ...] | None = Field(
        default=None,
        exclude=True,
        description="Routing key, e.g. (prompt index, sample index): a replica pool keeps a session's turns on "
        "one replica (its prefix cache); engines ignore it, and it is left out of dumped configs.",
    )
    structured_output: StructuredOutput | None = Field(
        default=None,
        description="Constrain the generation to JSON matching a schema (a per-row token mask on the hf backend, "
        "vLLM's structured outputs on vllm); its logprobs are then those of the masked distribution. None: free.",
    )

    @field_validator("stop_strings")
    @classmethod
    def _no_empty_stop_string(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        empty = [i for i, s in enumerate(value) if not s]
        if empty:
            raise ValueError(f"stop_strings must not contain empty strings (positions {empty})")
        return value

    @property
    def greedy(self) -> bool:
        """True when decoding takes the argmax token (temperature 0)."""
        return self.temperature == 0.0


class FinishReason(str, enum.Enum):
    """Why a generation ended."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"
    STOP_STRING = "stop_string"
    MAX_NEW_TOKENS = "max_new_tokens"
    MAX_MODEL_LEN = "max_model_len"
    ABORTED = "aborted"
    """A weight update (`update_weights(..., in_flight="abort")`) stopped it; continue from prompt + output."""

    @property
    def truncated(self) -> bool:
        """True when a length limit, not the model, ended the generation."""
        return self in (FinishReason.MAX_NEW_TOKENS, FinishReason.MAX_MODEL_LEN)

    @property
    def openai(self) -> str:
        """The OpenAI API's name for this reason: "stop", "length", or "abort" (vLLM's name) when aborted."""
        if self is FinishReason.ABORTED:
            return "abort"
        return "length" if self.truncated else "stop"


InFlightPolicy = Literal["finish", "abort"]
"""What `update_weights` does with generations in flight: let them finish on the old weights, or abort them."""


@dataclass(frozen=True)
class GenerationOutput:
    """The result of one request."""

    output_ids: tuple[int, ...]
    """Generated token ids, including the EOS / stop token that ended the generation."""
    logprobs: tuple[float, ...]
    """Log-probability of each generated id under the temperature-scaled distribution (one per id)."""
    finish_reason: FinishReason
    """Why the generation ended."""
    matched_stop: str | int | None = None
    """The stop string or stop token id that ended it, if any."""
    weight_version: int = 0
    """The backend's `weight_version` that every token of this output was generated under (never spans an update)."""
    time_to_first_token_s: float | None = field(default=None, compare=False)
    """Seconds from the `generate_async` call to the engine sampling the first token; None when the backend does
    not measure it. A timing, so it takes no part in comparing outputs."""
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    """Per generated id, the `config.top_logprobs` likeliest tokens of its distribution; None when not asked."""
    prompt_logprobs: tuple[float, ...] | None = None
    """Per prompt id from the 2nd on, its logprob at temperature 1 (`config.prompt_logprobs`); None when not asked."""
    prompt_top_logprobs: tuple[TopLogprobs, ...] | None = None
    """Per prompt id from the 2nd on, the `config.prompt_logprobs` likeliest tokens; None when not asked."""

    @property
    def truncated(self) -> bool:
        """True when max_new_tokens or max_model_len cut the generation short."""
        return self.finish_reason.truncated


@dataclass(frozen=True)
class TokenDelta:
    """Tokens a streamed generation (`GenerationInterface.generate_stream`) sampled since its previous delta."""

    output_ids: tuple[int, ...]
    """The new ids, in order (one or more)."""
    logprobs: tuple[float, ...]
    """The logprob of each new id, as in `GenerationOutput.logprobs`."""
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    """Each new id's top alternatives when the config asks (`GenerationOutput.top_logprobs`); None otherwise."""


StreamEvent = TokenDelta | GenerationOutput
"""What `generate_stream` yields: deltas, then the whole output."""


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds right now (a snapshot: `GenerationInterface.engine_load`)."""

    running: int
    """Requests in the running batch (rows being decoded)."""
    waiting: int
    """Requests accepted and waiting to join the running batch."""


class GenerationInterface(abc.ABC):
    """A generation backend: many concurrent `generate_async` calls, served in batches.

    Everything a caller (rollouts, the eval driver, GRPO, the policy server) uses is declared here, so a
    backend that implements this class works behind every entry point: `tests/unit/models/test_generation_contract.py`
    holds the checks every backend must pass.
    """

    @property
    @abc.abstractmethod
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer of the served model (chat template included): what prompts are encoded with."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Most tokens (prompt + generation) a request may hold."""

    @abc.abstractmethod
    async def generate_async(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        """Generate a continuation of `prompt_token_ids`; raises ValueError on bad input.

        Cancelling the call stops its generation (a batching backend drops the request from its batch at
        the next decode step), and one request's failure never fails the others it is batched with.
        """

    async def generate_stream(
        self, prompt_token_ids: Sequence[int], config: GenerationConfig
    ) -> AsyncIterator[StreamEvent]:
        """`generate_async`, delivered as it is decoded: `TokenDelta`s, then the `GenerationOutput` (last).

        The deltas' ids, joined, are a prefix of the output's `output_ids` (the rest arrives with the output);
        the output is the one `generate_async` would return. Closing the iterator early (or cancelling the
        task that reads it) cancels the generation, as cancelling `generate_async` does. This default sends
        no delta: the whole output at the end; backends that decode step by step override it.
        """
        yield await self.generate_async(prompt_token_ids, config)

    @abc.abstractmethod
    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, in_flight: InFlightPolicy = "finish", partial: bool = False
    ) -> None:
        """Serve new weights (transformers parameter names, every weight of the model); returns once they serve.

        Safe to call while generations are in flight. `in_flight="finish"`: they finish on the old weights,
        then the update applies. `"abort"`: they stop at their next decode step with `FinishReason.ABORTED`,
        keeping the tokens and logprobs made so far (under the old version), then the update applies.
        Requests that arrive during the update wait and run on the new weights. `weight_version` then grows
        by one. Raises ValueError naming the missing weights if `state_dict` lacks any, before loading anything.

        `partial=True`: `state_dict` holds only the tensors that changed (a LoRA refit's merged target modules);
        the others keep what the engine holds, and a backend that reloads its model folder (a restarted pool
        replica) applies the latest partial update on top of the folder's weights. Names the model lacks are
        then the ValueError.
        """

    @property
    def accepts_partial_update(self) -> bool:
        """Whether `update_weights(..., partial=True)` is served (False: the caller sends every weight)."""
        return False

    @property
    def weight_version(self) -> int:
        """0 at start, +1 on each successful `update_weights`: what `GenerationOutput.weight_version` holds.

        Backends that serve weight updates override this; the default suits test doubles that never update.
        """
        return 0

    def engine_load(self) -> EngineLoad | None:
        """How many requests run and wait in the engine now (the policy server's `/metrics` gauges); None when
        the backend cannot tell, the default (vLLM's scheduler reports its counts only to its own stat loggers,
        which the vllm backend turns off)."""
        return None

    def metrics(self) -> dict[str, float]:
        """The backend's own counters as flat metrics with slash namespaces (a Ray pool's `cluster/...`), which a
        trainer logs with each step; the default has none."""
        return {}

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the engine's resources; idempotent. Later `generate_async` / `update_weights` calls raise
        RuntimeError."""


def check_in_flight(in_flight: str) -> None:
    """Raise a ValueError naming `in_flight` unless it is "finish" or "abort"."""
    if in_flight not in ("finish", "abort"):
        raise ValueError(f'update_weights: in_flight must be "finish" or "abort", got {in_flight!r}')


def check_state_dict(expected: Iterable[str], state_dict: Mapping[str, torch.Tensor], partial: bool = False) -> None:
    """Raise a ValueError naming the weights `state_dict` lacks (a partial reload would leave layers stale), or
    with `partial`, the names the model does not have."""
    if partial:
        unknown = sorted(set(state_dict) - set(expected))
        if unknown:
            raise ValueError(f"update_weights(partial=True): the model has no weights named {unknown[:10]}")
        return
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ValueError(
            f"update_weights needs every weight of the model; the state_dict lacks {len(missing)}: {missing[:10]}"
        )


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Raise a ValueError naming the problem if a prompt can't be served."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids is empty: a prompt needs at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_token_ids)} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len}"
        )
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt_token_ids holds ids outside [0, {vocab_size}): {bad[:10]}")
