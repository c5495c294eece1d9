"""Per-step sampling seeds: a generation wrapper that mixes a "salt" (the training step) into request seeds.

The rollout implementations derive each request's seed from the generation config's seed and
(prompt index, sample, turn) (`rollout_seed`), which is the same at every step. Without a per-step salt a
prompt seen again in a later epoch would reuse the same random draws. Wrapping the policy's generation
backend, rather than rebuilding the RolloutManager each step, keeps one manager for the whole run (the
NeMo Gym manager starts servers on first use) and works for any rollout mode: every seeded request that
reaches the backend, in-process or through the policy server, gets `mix(seed, salt)`. Unseeded requests
stay unseeded.

Asynchronous GRPO has groups of several steps in flight at once, so each group runs inside a `RequestScope`
(a context variable: the native rollouts' requests run in the group's task) that carries its own salt and
records the oldest weight version its outputs came back with. Requests from outside any scope (the policy
server's thread in nemo_gym mode, validation) use the wrapper's `salt`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.interfaces import (
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    InFlightPolicy,
    StreamEvent,
)

TRAIN_SALT = 1
"""First element of the seed salt of GRPO's training rollouts: (TRAIN_SALT, step, rollout batch)."""
VAL_SALT = 2
"""Seed salt of GRPO's validation rollouts: the same draws at every validation, so they compare across steps."""


def mix_seed(seed: int, salt: Sequence[int]) -> int:
    """A well-mixed 31-bit seed from a seed and a salt (deterministic, distinct salts differ)."""
    entropy = [int(seed) % 2**63, *(int(s) % 2**63 for s in salt)]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0]) % (2**31 - 1)


@dataclass
class RequestScope:
    """The requests of one asynchronous group: the salt they are seeded with and the versions they came back with."""

    salt: tuple[int, ...]
    """Mixed into every seeded request made inside the scope (instead of the wrapper's `salt`)."""
    min_version: int | None = None
    """The oldest `weight_version` of an output returned inside the scope so far (None: none yet)."""


REQUEST_SCOPE: ContextVar[RequestScope | None] = ContextVar("nemo_rl_ext_request_scope", default=None)
"""The scope of the running task (set by the asynchronous collector for each group's task)."""


def _note_version(scope: RequestScope | None, output: GenerationOutput) -> None:
    """Keep the oldest weight version a scope's requests were served with."""
    if scope is not None and (scope.min_version is None or output.weight_version < scope.min_version):
        scope.min_version = output.weight_version


class SaltedGeneration(GenerationInterface):
    """Forwards to `inner`, replacing each request's seed with `mix_seed(seed, salt)`; set `salt` per step
    (or run the requests inside a `RequestScope`, whose salt wins)."""

    def __init__(self, inner: GenerationInterface, salt: Sequence[int] = ()) -> None:
        self.inner = inner
        self.salt: tuple[int, ...] = tuple(salt)

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.inner.tokenizer

    async def generate_async(self, prompt_token_ids: list[int], config: GenerationConfig) -> GenerationOutput:
        scope, config = self._salted(config)
        output = await self.inner.generate_async(prompt_token_ids, config)
        _note_version(scope, output)
        return output

    async def generate_stream(
        self, prompt_token_ids: list[int], config: GenerationConfig
    ) -> AsyncIterator[StreamEvent]:
        """The inner backend's stream of the salted request (so a policy server over it streams too)."""
        scope, config = self._salted(config)
        async with contextlib.aclosing(self.inner.generate_stream(prompt_token_ids, config)) as events:
            async for event in events:
                if isinstance(event, GenerationOutput):
                    _note_version(scope, event)
                yield event

    def _salted(self, config: GenerationConfig) -> tuple[RequestScope | None, GenerationConfig]:
        """The running task's scope, and `config` with its seed mixed with the salt in force."""
        scope = REQUEST_SCOPE.get()
        salt = scope.salt if scope is not None else self.salt
        if config.seed is not None and salt:
            config = config.model_copy(update={"seed": mix_seed(config.seed, salt)})
        return scope, config

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, in_flight: InFlightPolicy = "finish", partial: bool = False
    ) -> None:
        if partial:  # only a backend that `accepts_partial_update` is asked to
            self.inner.update_weights(state_dict, in_flight=in_flight, partial=True)
        else:
            self.inner.update_weights(state_dict, in_flight=in_flight)

    @property
    def accepts_partial_update(self) -> bool:
        return self.inner.accepts_partial_update

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def shutdown(self) -> None:
        self.inner.shutdown()

    def __getattr__(self, name: str) -> Any:  # counters and other backend-specific attributes
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
