"""AsyncNemoGymRolloutImpl: N rows per prompt go to NeMo Gym agents, which call our policy server.

Gym owns the turn loop and the reward; we own the policy. On first use the implementation starts an
OpenAI-compatible policy server over `policy_generation` (and, with `gym.launch`, NeMo Gym itself,
pointed at that server), then sends rows through a `GymClient`.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.experience.fault_policy import FaultPolicy, RolloutError, describe, gather_or_cancel
from nemo_rl_ext.experience.generation_counts import GenerationCounts
from nemo_rl_ext.experience.gym_results import gym_numeric_metrics, result_to_completion
from nemo_rl_ext.experience.native_rollouts import rollout_seed
from nemo_rl_ext.experience.records import Completion, DatumSpec, PromptGroupRecord, StopReason
from nemo_rl_ext.experience.rollout_metrics import rollout_metrics
from nemo_rl_ext.gym.client import GymClient, agent_name_of
from nemo_rl_ext.gym.config import GymConfig
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationInterface

logger = logging.getLogger(__name__)


def check_gym_parameters(max_rollout_turns: int | None, config: GenerationConfig) -> list[str]:
    """Problems with settings that Gym owns (every one of them)."""
    problems = []
    if max_rollout_turns is not None:
        problems.append(f"max_rollout_turns must be None with NeMo Gym (agents own the turn loop), got {max_rollout_turns}")
    if config.stop_strings:
        problems.append(f"stop_strings must be empty with NeMo Gym, got {list(config.stop_strings)}")
    if config.stop_token_ids:
        problems.append(f"stop_token_ids must be empty with NeMo Gym, got {list(config.stop_token_ids)}")
    if config.top_k is not None:
        problems.append(f"top_k must be None with NeMo Gym (the Responses API has no top_k), got {config.top_k}")
    return problems


class AsyncNemoGymRolloutImpl:
    """Builds N Gym rows per prompt, sends them, converts each result into a Completion."""

    def __init__(
        self,
        *,
        tokenizer: PreTrainedTokenizerBase,
        counts: GenerationCounts,
        max_seq_len: int,
        max_rollout_turns: int | None,
        policy_generation: GenerationInterface,
        generation_config: GenerationConfig,
        fault_policy: FaultPolicy,
        gym_config: GymConfig | Mapping[str, Any] | None,
    ) -> None:
        problems = check_gym_parameters(max_rollout_turns, generation_config)
        if gym_config is None:
            problems.append("gym_config is required with use_nemo_gym=True")
        if problems:
            raise ValueError("NeMo Gym rollouts: " + "; ".join(problems))
        self.gym = gym_config if isinstance(gym_config, GymConfig) else GymConfig.model_validate(gym_config)
        self.tokenizer = tokenizer
        self.counts = counts
        self.max_seq_len = max_seq_len
        self.policy = policy_generation
        self.config = generation_config
        self.faults = fault_policy
        self._client: GymClient | None = None
        self._server = None
        self._launcher = None
        self._start_lock = asyncio.Lock()
        self._life_lock = threading.Lock()  # start-up runs in a worker thread that a shutdown may overtake
        self._closed = False

    # ---- lifecycle ------------------------------------------------------------------------------

    async def client(self) -> GymClient:
        """The Gym client, starting the policy server (and Gym, with `gym.launch`) on first use."""
        async with self._start_lock:
            if self._client is None:
                self._closed = False
                agent_urls = dict(self.gym.agent_urls)
                if self.gym.launch is not None:
                    agent_urls = await asyncio.to_thread(self._start_servers)
                elif self.gym.serve_policy:
                    await asyncio.to_thread(self.start_policy_server)
                self._client = GymClient(
                    head_server_url=self.gym.head_server_url,
                    agent_urls=agent_urls or None,
                    servers=self._launcher.servers if self._launcher is not None else None,
                    max_concurrency=self.gym.max_concurrency,
                    row_timeout_s=self.gym.row_timeout_s,
                    max_attempts=self.gym.max_attempts,
                    retry_backoff_s=self.gym.retry_backoff_s,
                    health_interval_s=self.gym.health_check_interval_s,
                    health_timeout_s=self.gym.health_check_timeout_s,
                    health_failures=self.gym.health_check_failures,
                )
            return self._client

    def _start_servers(self) -> dict[str, str]:
        from nemo_rl_ext.gym.launcher import GymLauncher

        self.start_policy_server()
        with self._life_lock:
            if self._closed:
                raise RuntimeError("NeMo Gym rollouts were shut down during start-up")
            self._launcher = launcher = GymLauncher(self.gym.launch, policy_base_url=self._server.base_url,
                                                    policy_model_name=self.gym.policy_model_name)
        return launcher.start()  # a shutdown from now on makes it stop and raise

    def start_policy_server(self) -> str:
        """Serve `policy_generation` over the OpenAI-compatible API; returns its base URL."""
        from nemo_rl_ext.models.generation.policy_server import PolicyServer

        with self._life_lock:
            server = self._server
        if server is None:
            server = PolicyServer(
                self.policy, self.tokenizer, host=self.gym.policy_host, port=self.gym.policy_port,
                served_model_name=self.gym.policy_model_name,
            )
            server.start()
            with self._life_lock:
                closed = self._closed
                if not closed:
                    self._server = server
            if closed:  # shut down while it was starting
                server.stop()
                raise RuntimeError("NeMo Gym rollouts were shut down during start-up")
        return server.base_url

    async def shutdown(self) -> None:
        """Stop what this implementation started (Gym first, then the policy server), even mid-start-up."""
        with self._life_lock:
            self._closed = True
            launcher, self._launcher = self._launcher, None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if launcher is not None:
            await asyncio.to_thread(launcher.stop)
        with self._life_lock:
            server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.stop)

    # ---- rollouts -------------------------------------------------------------------------------

    def build_rows(self, datum: DatumSpec) -> list[dict[str, Any]]:
        """The N rows of one prompt: sampling parameters from the generation config, a seed per sample."""
        row = datum.extra_env_info
        if "responses_create_params" not in row:
            raise ValueError(f"row {datum.idx}: missing 'responses_create_params' (keys: {sorted(row)})")
        agent = agent_name_of(row) if "agent_ref" in row else datum.agent
        n = self.counts.for_agent(agent)
        rows = []
        for sample in range(n):
            r = copy.deepcopy(dict(row))
            r.setdefault("agent_ref", {"name": agent})
            params = r["responses_create_params"]
            params["temperature"] = self.config.temperature
            params["top_p"] = self.config.top_p
            params["max_output_tokens"] = self.config.max_new_tokens
            seed = rollout_seed(self.config.seed, datum.idx, sample, 0)
            if seed is not None:
                metadata = dict(params.get("metadata") or {})
                extra = json.loads(metadata.get("extra_body") or "{}")
                metadata["extra_body"] = json.dumps({**extra, "seed": seed})
                params["metadata"] = metadata
            r["_ng_task_index"] = datum.idx
            r["_ng_rollout_index"] = sample
            rows.append(r)
        return rows

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord:
        rows = self.build_rows(datum)
        agent = rows[0]["agent_ref"]["name"]
        client = await self.client()
        known = await client.agent_urls()
        if agent not in known:
            raise ValueError(f"row {datum.idx}: unknown Gym agent {agent!r}; known agents: {sorted(known)}")
        start = time.perf_counter()
        pairs = await gather_or_cancel(self._one(client, datum, agent, i, r) for i, r in enumerate(rows))
        completions = [c for c, _ in pairs]
        metrics = rollout_metrics(completions, [1] * len(completions), time.perf_counter() - start)
        metrics.update(gym_numeric_metrics([(agent, r) for _, r in pairs if r is not None]))
        prompt = next((c.message_log[:1] for c in completions if c.stop_reason is not StopReason.ERROR), ())
        return PromptGroupRecord(
            prompt_idx=datum.idx,
            prompt=prompt,
            extra_env_info=datum.extra_env_info,
            agent_name=agent,
            completions=tuple(completions),
            rollout_metrics=metrics,
            metadata=datum.metadata,
        )

    async def _one(
        self, client: GymClient, datum: DatumSpec, agent: str, sample: int, row: dict[str, Any]
    ) -> tuple[Completion, dict[str, Any] | None]:
        label = f"row {datum.idx}, sample {sample}"
        try:
            result = await client.run(row, label=label)
            completion = result_to_completion(result, agent, self.tokenizer)
        except Exception as exc:
            if self.faults.on_error == "raise":
                raise RolloutError(f"{label}: {describe(exc)}") from exc
            error = Completion((), 0.0, False, StopReason.ERROR, 0, agent, {"answer": None}, describe(exc))
            return error, None
        if completion.stop_reason is StopReason.ERROR and self.faults.on_error == "raise":
            raise RolloutError(f"{label}: {completion.error}")
        return completion, result
