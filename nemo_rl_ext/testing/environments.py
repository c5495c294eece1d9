"""Environment doubles: a scripted environment whose every answer is a parameter, and a failing one.

Each rollout in a step is answered on its own from a `RolloutStep` (its messages, its metadata, its turn),
so a double is written as a few small functions (or constants) instead of a whole `step`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Observation
from nemo_rl_ext.testing.faults import Fault, inject

T = TypeVar("T")


@dataclass(frozen=True)
class RolloutStep:
    """One rollout as a scripted environment sees it in one step."""

    message_log: Sequence[Message]
    """The rollout's messages so far, the latest assistant turn last."""
    metadata: Mapping[str, Any]
    """The rollout's metadata as passed to `step` ({} for None)."""
    index: int
    """Its position in the step's batch."""

    @functools.cached_property
    def turn(self) -> int:
        """Assistant messages in the log: 1 on a rollout's first step."""
        return sum(m.role == "assistant" for m in self.message_log)

    @property
    def reply(self) -> str:
        """The text of the latest assistant message ("" if none)."""
        return next((m.content for m in reversed(self.message_log) if m.role == "assistant"), "")

    @property
    def question(self) -> str:
        """The text of the first user message ("" if none)."""
        return next((m.content for m in self.message_log if m.role == "user"), "")


Scripted = T | Callable[[RolloutStep], T]
"""A constant, or a function of the rollout's step."""


def _value(scripted: Any, step: RolloutStep) -> Any:
    return scripted(step) if callable(scripted) else scripted


class ScriptedEnvironment(EnvironmentInterface):
    """Answers each rollout from its parameters: each is a constant or a function of the `RolloutStep`.

    A rollout terminates once it has `turns` assistant turns (None: never). `metadata` None passes each
    rollout's metadata back unchanged. `fault` (if given) runs first for every rollout: an exception it
    returns is raised, a `Fault` hangs the step, None lets the rollout be answered; the first fault in a
    batch ends the whole step, as a crashing environment would. Each step then sleeps `delay_s` (0 still
    suspends the caller once). `num_steps` counts rollouts stepped.
    """

    def __init__(
        self,
        *,
        turns: Scripted[int | None] = 1,
        reward: Scripted[float] = 0.0,
        observation: Scripted[Observation] = Observation("user", ""),  # noqa: B008 - frozen, shared safely
        answer: Scripted[str | None] = None,
        next_stop_strings: Scripted[tuple[str, ...] | None] = None,
        metadata: Scripted[Mapping[str, Any] | None] | None = None,
        extras: Scripted[Mapping[str, Any]] | None = None,
        reward_components: Scripted[Mapping[str, Any]] | None = None,
        fault: Callable[[RolloutStep], BaseException | Fault | None] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.turns = turns
        self.reward = reward
        self.observation = observation
        self.answer = answer
        self.next_stop_strings = next_stop_strings
        self.metadata = metadata
        self.extras = extras
        self.reward_components = reward_components
        self.fault = fault
        self.delay_s = delay_s
        self.num_steps = 0
        """Rollouts stepped so far (a batch of n counts n)."""

    async def step(
        self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn:
        """Answer every rollout of the batch; see the class docstring."""
        steps = [RolloutStep(log, meta or {}, i) for i, (log, meta) in enumerate(zip(message_logs, metadata, strict=True))]
        if self.fault is not None:
            for s in steps:
                fault = self.fault(s)
                if fault is not None:
                    await inject(fault)
        await asyncio.sleep(self.delay_s)  # even 0 suspends the caller once, as a real step does
        self.num_steps += len(steps)
        turns = [_value(self.turns, s) for s in steps]
        return EnvironmentReturn(
            observations=[_value(self.observation, s) for s in steps],
            metadata=list(metadata) if self.metadata is None else [_value(self.metadata, s) for s in steps],
            next_stop_strings=[_value(self.next_stop_strings, s) for s in steps],
            rewards=[float(_value(self.reward, s)) for s in steps],
            terminateds=[t is not None and s.turn >= t for s, t in zip(steps, turns, strict=True)],
            answers=[_value(self.answer, s) for s in steps],
            extras=None if self.extras is None else [_value(self.extras, s) for s in steps],
            reward_components=None
            if self.reward_components is None
            else [_value(self.reward_components, s) for s in steps],
        )


def always(step: RolloutStep) -> bool:
    """Every rollout: `FailingEnvironment`'s default `when`."""
    return True


class FailingEnvironment(ScriptedEnvironment):
    """A scripted environment that injects `fault` (an exception to raise, or a `Fault` hang) into every
    step holding a rollout for which `when(step)` is true; the other steps are answered as scripted."""

    def __init__(
        self,
        fault: BaseException | Fault,
        *,
        when: Callable[[RolloutStep], bool] = always,
        **scripted: Any,
    ) -> None:
        super().__init__(fault=lambda s: fault if when(s) else None, **scripted)
        self.injected = fault
        """The fault this environment injects."""
