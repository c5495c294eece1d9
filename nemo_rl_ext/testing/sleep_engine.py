"""A simulated accelerator: a generation backend that sleeps per decode step instead of computing.

Each engine decodes at most `max_batch_size` requests at once, one token per `token_s` seconds (a batch
step costs the same whatever the batch holds, as on a GPU); further requests wait for a slot. It uses
almost no CPU, so a 2-core machine can host several of them and show how a replica pool scales.

Its first output id is the engine's `tag` (by default the process id), so a caller can tell which
replica served a request; the other ids and the logprobs are a function of the prompt and the seed.
To ship it to Ray workers that may not import this package, pickle it by value:
`ray.cloudpickle.register_pickle_by_value(nemo_rl_ext.testing.sleep_engine)`.
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
    InFlightPolicy,
    check_in_flight,
)


class SleepGeneration(GenerationInterface):
    """Sleeps `token_s` per generated token, `max_batch_size` requests at a time; see the module docstring.

    Weight updates follow the interface: a request that holds a slot when `update_weights` is called
    finishes on the old version (`in_flight="finish"`) or stops at its next token with `ABORTED`, keeping
    the ids made so far (`"abort"`); requests still waiting for a slot run on the new version.
    """

    def __init__(self, token_s: float = 0.005, max_batch_size: int = 8, tag: int | None = None,
                 max_model_len: int = 4096, tokenizer: Any = None) -> None:
        self.token_s = token_s
        self.max_batch_size = max_batch_size
        self.tag = os.getpid() if tag is None else tag
        self._max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self._aborts = 0
        self._shut_down = False
        self.updates = 0
        """update_weights calls served (its `weight_version`)."""

    @property
    def tokenizer(self) -> Any:
        """None by default: a simulated engine serves ids only."""
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        """Most tokens a request may hold (only reported; the simulation never runs out of room)."""
        return self._max_model_len

    async def generate_async(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        """`max_new_tokens` ids after `max_new_tokens` sleeps of `token_s`, once a batch slot is free."""
        self._check_open()
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.max_batch_size))
        n = config.max_new_tokens
        base = (sum(prompt_token_ids) + (config.seed or 0)) % 1000
        ids = (self.tag, *((base + i) % 1000 for i in range(1, n)))
        async with slots:
            version, aborts = self.updates, self._aborts
            for done in range(n):
                await asyncio.sleep(self.token_s)
                if self._aborts != aborts:
                    return GenerationOutput(ids[: done + 1], (-0.5,) * (done + 1), FinishReason.ABORTED,
                                            weight_version=version)
        return GenerationOutput(ids[:n], tuple(-0.5 for _ in ids[:n]), FinishReason.MAX_NEW_TOKENS,
                                weight_version=version)

    def update_weights(self, state_dict: Mapping[str, Any], *, in_flight: InFlightPolicy = "finish") -> None:
        """Serve the next version at once (there are no weights to load); see the class docstring."""
        self._check_open()
        check_in_flight(in_flight)
        if in_flight == "abort":
            self._aborts += 1
        self.updates += 1

    @property
    def weight_version(self) -> int:
        """0 at start, +1 per update_weights."""
        return self.updates

    def shutdown(self) -> None:
        """Idempotent; later calls raise RuntimeError."""
        self._shut_down = True

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("this SleepGeneration was shut down")


def make_sleep_engine(token_s: float = 0.005, max_batch_size: int = 8) -> SleepGeneration:
    """The factory a replica calls (pickles with this module)."""
    return SleepGeneration(token_s=token_s, max_batch_size=max_batch_size)
