"""A simulated accelerator: a generation backend that sleeps per decode step instead of computing.

Each engine decodes at most `max_batch_size` requests at once, one token per `token_s` seconds (a batch
step costs the same whatever the batch holds, as on a GPU); further requests wait for a slot. It uses
almost no CPU, so a 2-core machine can host several of them and show how a replica pool scales.

Its first output id is the engine's `tag` (by default the process id), so a caller can tell which
replica served a request; the other ids and the logprobs are a function of the prompt and the seed.
Pickle it by value to ship it to Ray workers: `ray.cloudpickle.register_pickle_by_value(sleep_engine)`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_rl_ext.models.generation.interfaces import (
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
)


class SleepGeneration(GenerationInterface):
    """Sleeps `token_s` per generated token, `max_batch_size` requests at a time; see the module docstring."""

    def __init__(self, token_s: float = 0.005, max_batch_size: int = 8, tag: int | None = None,
                 max_model_len: int = 4096) -> None:
        self.token_s = token_s
        self.max_batch_size = max_batch_size
        self.tag = os.getpid() if tag is None else tag
        self._max_model_len = max_model_len
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self.updates = 0
        """update_weights calls served (its `weight_version`)."""

    @property
    def tokenizer(self) -> Any:
        return None  # a simulated engine serves ids only

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def generate_async(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.max_batch_size))
        n = config.max_new_tokens
        async with slots:
            for _ in range(n):
                await asyncio.sleep(self.token_s)
        base = (sum(prompt_token_ids) + (config.seed or 0)) % 1000
        ids = (self.tag, *((base + i) % 1000 for i in range(1, n)))
        return GenerationOutput(ids[:n], tuple(-0.5 for _ in ids[:n]), FinishReason.MAX_NEW_TOKENS,
                                weight_version=self.updates)

    def update_weights(self, state_dict: Mapping[str, Any], *, in_flight: str = "finish") -> None:
        self.updates += 1

    @property
    def weight_version(self) -> int:
        return self.updates

    def shutdown(self) -> None:
        pass


def make_sleep_engine(token_s: float = 0.005, max_batch_size: int = 8) -> SleepGeneration:
    """The factory a replica calls (pickles with this module)."""
    return SleepGeneration(token_s=token_s, max_batch_size=max_batch_size)
