"""RolloutImpl: what a rollout mode implements, every hook the RolloutManager calls declared in one place.

A mode (`native`, `nemo_gym`, or one of yours, see `rollout_modes`) subclasses `RolloutImpl`: it must build
itself from the manager's checked arguments (`from_setup`), say its per-agent sample `counts` and roll out
one prompt (`run_rollout`); every other hook has a default for a mode with nothing to do there.
`RolloutCall` is the per-call state a caller passes down with each prompt (explicitly, not in a context
variable).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from nemo_rl_ext.data.generation_counts import GenerationCounts
from nemo_rl_ext.data.records import DatumSpec, PromptGroupRecord
from nemo_rl_ext.environments.interfaces import EnvironmentInterface
from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.experience.rollout_params import TokenizerType
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationInterface


@dataclass(frozen=True)
class RolloutCall:
    """Per-call state of one batch of rollouts (`RolloutManager.stream_rollouts` -> `run_rollout(datum, call=...)`
    -> the mode), passed down as an argument."""

    counts: GenerationCounts | None = None
    """Sample counts for this call only (e.g. validation with another count); None: the mode's own."""

    def counts_or(self, own: GenerationCounts) -> GenerationCounts:
        """The counts in force for this call: the call's, else `own`."""
        return own if self.counts is None else self.counts


NO_CALL = RolloutCall()
"""A call with nothing of its own (what `run_rollout` uses when given no `call`)."""


@dataclass(frozen=True)
class RolloutSetup:
    """The RolloutManager's constructor arguments, as every mode is built from them (`RolloutImpl.from_setup`)."""

    tokenizer: TokenizerType
    """What rollouts tokenize with."""
    task_to_env: Mapping[str, EnvironmentInterface] | None
    """task_name -> the environment that steps native rollouts (None where the mode scores elsewhere)."""
    num_generations_per_prompt: int | Mapping[str, int] | GenerationCounts
    """Samples per prompt: an int, or agent name -> int with `_default` as fallback."""
    max_seq_len: int
    """Most tokens (prompt + every turn) per rollout."""
    max_rollout_turns: int | None
    """Most generations per rollout (None: no limit, or the mode's own loop decides)."""
    policy_generation: GenerationInterface | None
    """The engine rollouts generate with."""
    generation_config: GenerationConfig
    """Sampling settings of every request."""
    fault_policy: FaultPolicy
    """Retries, deadlines, record-or-raise."""
    gym_config: Any = None
    """nemo_gym: where the Gym agents are (`GymConfig` or its dict); other modes ignore it."""


class RolloutImpl(ABC):
    """A rollout mode: turns one `DatumSpec` into a `PromptGroupRecord` of N scored completions."""

    records_token_versions: ClassVar[bool] = True
    """True when every generated token of a record carries the engine's `weight_version`; False where results
    carry none (a caller then judges a group by when it started)."""

    @classmethod
    @abstractmethod
    def from_setup(cls, setup: RolloutSetup) -> RolloutImpl:
        """Build the mode from the manager's arguments; one ValueError naming every bad one."""

    @property
    @abstractmethod
    def counts(self) -> GenerationCounts:
        """The per-agent sample counts the mode was built with."""

    @abstractmethod
    async def run_rollout(self, input_sample: DatumSpec, *, call: RolloutCall = NO_CALL) -> PromptGroupRecord:
        """Roll out one prompt N times (N from `call.counts_or(self.counts)`) and score the completions."""

    @property
    def environments(self) -> Mapping[str, EnvironmentInterface] | None:
        """The environments this mode steps in-process (None: it steps none)."""
        return None

    async def shutdown(self) -> None:
        """Stop what the mode started (servers, clients); nothing by default."""
        return None

    def request_rows(self, datums: Sequence[DatumSpec]) -> dict[int, list[dict[str, Any]]] | None:
        """Prompt index -> the request rows the mode sends for that datum, one per sample; None: it sends none
        (the prompt is rendered in this process)."""
        return None

    def pin_rows(self, rows_by_prompt: Mapping[int, Sequence[Mapping[str, Any]]]) -> None:
        """Send exactly these rows for these prompts (`request_rows`' shape) instead of building them;
        ValueError for a mode that sends none."""
        raise ValueError(f"{type(self).__name__} sends no request rows to pin")

    async def aggregate_metrics(
        self, results_by_agent: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> dict[str, dict[str, Any]] | None:
        """Agent -> the mode's own aggregate of finished results; None: it has none."""
        return None
