"""RolloutManager: validates its arguments once and routes rollouts to the native or NeMo Gym implementation.

NeMo-RL's `nemo_rl.experience.rollout_manager` API, importable from here: `RolloutManager`,
`AsyncRolloutImpl`, `AsyncNemoGymRolloutImpl`, `PromptGroupRecord`, `TokenizerType`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tqdm.auto import tqdm

from nemo_rl_ext.data.generation_counts import GenerationCounts
from nemo_rl_ext.data.records import DatumSpec, PromptGroupRecord
from nemo_rl_ext.environments.interfaces import EnvironmentInterface
from nemo_rl_ext.experience.fault_policy import FaultPolicy, gather_or_cancel
from nemo_rl_ext.experience.gym_rollouts import AsyncNemoGymRolloutImpl
from nemo_rl_ext.experience.native_rollouts import AsyncRolloutImpl
from nemo_rl_ext.experience.rollout_metrics import rollout_metrics
from nemo_rl_ext.experience.rollout_params import TokenizerType
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationInterface

__all__ = [
    "AsyncNemoGymRolloutImpl",
    "AsyncRolloutImpl",
    "PromptGroupRecord",
    "RolloutManager",
    "TokenizerType",
    "batch_metrics",
]


class RolloutImpl(Protocol):
    """What both implementations provide."""

    counts: GenerationCounts

    async def run_rollout(self, input_sample: DatumSpec) -> PromptGroupRecord: ...


class RolloutManager:
    """Turns a dataset row into a `PromptGroupRecord` of N scored completions.

    `num_generations_per_prompt` is an int or a dict keyed by agent name with `_default` as fallback.
    With `use_nemo_gym=False` rollouts run in-process through `task_to_env` (`AsyncRolloutImpl`); with
    `use_nemo_gym=True` NeMo Gym agent servers own the turn loop and the reward (`AsyncNemoGymRolloutImpl`,
    see `gym_config`). The positional parameters are NeMo-RL's; `fault_policy` and `gym_config` are ours.
    """

    def __init__(
        self,
        tokenizer: TokenizerType,
        task_to_env: Mapping[str, EnvironmentInterface] | None,
        num_generations_per_prompt: int | Mapping[str, int],
        max_seq_len: int,
        max_rollout_turns: int | None = None,
        policy_generation: GenerationInterface | None = None,
        generation_config: GenerationConfig | None = None,
        use_nemo_gym: bool = False,
        *,
        fault_policy: FaultPolicy | None = None,
        gym_config: Any = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.generation_config = generation_config or GenerationConfig()
        self.fault_policy = fault_policy or FaultPolicy()
        self.use_nemo_gym = use_nemo_gym
        self.impl: RolloutImpl
        if use_nemo_gym:
            self.impl = AsyncNemoGymRolloutImpl(
                tokenizer,
                task_to_env,
                num_generations_per_prompt,
                max_seq_len,
                self.generation_config,
                max_rollout_turns,
                policy_generation=policy_generation,
                fault_policy=self.fault_policy,
                gym_config=gym_config,
            )
        else:
            self.impl = AsyncRolloutImpl(
                tokenizer,
                task_to_env,
                num_generations_per_prompt,
                max_seq_len,
                policy_generation,
                max_rollout_turns,
                generation_config=self.generation_config,
                fault_policy=self.fault_policy,
            )
        self.counts = self.impl.counts

    async def shutdown(self) -> None:
        """Stop servers the implementation started (the NeMo Gym path starts a policy server and Gym)."""
        stop = getattr(self.impl, "shutdown", None)
        if stop is not None:
            await stop()

    def preflight(self, datums: Sequence[DatumSpec]) -> None:
        """Check a dataset before any generation: every row's agent has a count (one error for all)."""
        self.counts.preflight((d.idx, d.agent) for d in datums)

    async def run_rollout(self, input_sample: DatumSpec) -> PromptGroupRecord:
        """Roll out one prompt N times and score the completions."""
        return await self.impl.run_rollout(input_sample)

    async def run_rollouts(
        self, datums: Sequence[DatumSpec], *, progress: bool = True, desc: str = "rollouts"
    ) -> tuple[list[PromptGroupRecord], dict[str, float]]:
        """Preflight, then roll out every prompt concurrently; returns the groups and metrics over all of them."""
        self.preflight(datums)
        start = time.perf_counter()
        bar = tqdm(total=len(datums), desc=desc, unit="prompt", disable=not progress)

        async def one(datum: DatumSpec) -> PromptGroupRecord:
            record = await self.run_rollout(datum)
            bar.update(1)
            return record

        try:
            records = await gather_or_cancel(one(d) for d in datums)
        finally:
            bar.close()
        return list(records), batch_metrics(records, time.perf_counter() - start)


def batch_metrics(records: Sequence[PromptGroupRecord], wall_time_s: float) -> dict[str, float]:
    """Rollout metrics over every completion of several groups."""
    completions = [c for r in records for c in r.completions]
    prompt_lens = [len(r.prompt) for r in records for _ in r.completions]
    metrics = rollout_metrics(completions, prompt_lens, wall_time_s)
    metrics["rollout/num_prompts"] = float(len(records))
    return metrics
