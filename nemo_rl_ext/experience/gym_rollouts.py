"""AsyncNemoGymRolloutImpl: N rows per prompt go to NeMo Gym agents, which call our policy server.

Gym owns the turn loop and the reward; we own the policy. On first use the implementation starts an
OpenAI-compatible policy server over `policy_generation` (and, with `gym.launch`, NeMo Gym itself,
pointed at that server), then sends rows through a `GymClient`.

NeMo-RL's documented API: `AsyncNemoGymRolloutImpl(tokenizer, task_to_env, num_generations_per_prompt,
max_seq_len, generation_config, max_rollout_turns=None, **kwargs)` and `run_rollout(input_sample)`, whose
steps are the hooks a subclass overrides: `_validate_init_params`, `_build_inputs` (the prompt's N rows),
`_run_rollouts` (the rows as one batch -> completions), `_result_to_completion` (one Gym result) and
`_compute_rollout_metrics` (the group's metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from nemo_rl_ext.data.datasets import GYM_REPEAT_KEY, GYM_TASK_KEY
from nemo_rl_ext.data.generation_counts import GenerationCounts
from nemo_rl_ext.data.records import (
    DATA_ERROR,
    ERROR_KIND,
    Completion,
    DatumSpec,
    PromptGroupRecord,
    RewardComponentError,
    StopReason,
)
from nemo_rl_ext.experience.fault_policy import FaultPolicy, RolloutError, describe, gather_or_cancel
from nemo_rl_ext.experience.gym_results import gym_numeric_metrics, result_to_completion
from nemo_rl_ext.experience.native_rollouts import rollout_seed
from nemo_rl_ext.experience.prompt_length import prompt_too_long, too_long_extras
from nemo_rl_ext.experience.rollout_impl import NO_CALL, RolloutCall, RolloutImpl, RolloutSetup
from nemo_rl_ext.experience.rollout_metrics import rollout_metrics
from nemo_rl_ext.experience.rollout_params import TokenizerType, check_common_parameters
from nemo_rl_ext.gym.client import GymClient, GymRowError, agent_name_of
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


ROW_KEYS = ("agent_ref", "_ng_task_index", "_ng_rollout_index")
"""Row keys copied into a Gym result that lacks them (Gym 0.7.0 does not echo the row), as Gym's collector does."""


class AsyncNemoGymRolloutImpl(RolloutImpl):
    """Manages per-prompt NeMo Gym rollouts: each `run_rollout` sends the prompt's N rows as one batch.

    `task_to_env` is unused (Gym agents own the environments) and may be None; `max_rollout_turns` must be
    None. Ours, as keyword arguments: `policy_generation` (served to the agents; needed when Gym calls our
    policy server, i.e. with `gym.launch` or `gym.serve_policy`), `fault_policy` and `gym_config` (a
    `GymConfig` or its dict: where the agents are, timeouts, retries).
    """

    def __init__(
        self,
        tokenizer: TokenizerType,
        task_to_env: Mapping[str, Any] | None,
        num_generations_per_prompt: int | Mapping[str, int] | GenerationCounts,
        max_seq_len: int,
        generation_config: GenerationConfig,
        max_rollout_turns: int | None = None,
        *,
        policy_generation: GenerationInterface | None = None,
        fault_policy: FaultPolicy | None = None,
        gym_config: GymConfig | Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.task_to_env = task_to_env
        self.num_generations_per_prompt = num_generations_per_prompt
        self.max_seq_len = max_seq_len
        self.generation_config = generation_config
        self.max_rollout_turns = max_rollout_turns
        self.policy_generation = policy_generation
        self.fault_policy = fault_policy or FaultPolicy()
        self.gym_config = gym_config
        self._validate_init_params()
        self._counts: GenerationCounts = (
            num_generations_per_prompt
            if isinstance(num_generations_per_prompt, GenerationCounts)
            else GenerationCounts.parse(num_generations_per_prompt)
        )
        self.gym = gym_config if isinstance(gym_config, GymConfig) else GymConfig.model_validate(gym_config)
        self._client: GymClient | None = None
        self._server = None
        self._launcher = None
        self._start_lock = asyncio.Lock()
        self._life_lock = threading.Lock()  # start-up runs in a worker thread that a shutdown may overtake
        self._closed = False
        self._pinned: dict[int, list[dict[str, Any]]] = {}

    records_token_versions = False  # Gym's results carry no weight version per token

    @classmethod
    def from_setup(cls, setup: RolloutSetup) -> AsyncNemoGymRolloutImpl:
        """The nemo_gym mode of a RolloutManager (`rollout_impl.RolloutSetup`)."""
        return cls(
            setup.tokenizer, setup.task_to_env, setup.num_generations_per_prompt, setup.max_seq_len,
            setup.generation_config, setup.max_rollout_turns, policy_generation=setup.policy_generation,
            fault_policy=setup.fault_policy, gym_config=setup.gym_config,
        )

    @property
    def counts(self) -> GenerationCounts:
        """The per-agent sample counts (the constructor's `num_generations_per_prompt`, parsed)."""
        return self._counts

    def request_rows(self, datums: Sequence[DatumSpec]) -> dict[int, list[dict[str, Any]]]:
        """Prompt index -> the rows `run_rollout` sends for that datum (`_build_inputs`: pinned rows as pinned)."""
        return {d.idx: self._build_inputs(d) for d in datums}

    async def aggregate_metrics(
        self, results_by_agent: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> dict[str, dict[str, Any]]:
        """Agent -> Gym's `/aggregate_metrics` answer for its results (`agent_metrics`, `key_metrics`,
        `group_level_metrics`), or `{"error": ...}` when the call failed (logged, not raised: an infrastructure
        failure). The results are as Gym's collector sends them. Starts the servers if they are not running."""
        client = await self.client()
        metrics: dict[str, dict[str, Any]] = {}
        for agent, results in sorted(results_by_agent.items()):
            try:
                answer = await client.aggregate_metrics(agent, list(results))
            except Exception as exc:
                logger.warning("Gym /aggregate_metrics for agent %r failed: %s", agent, describe(exc))
                metrics[agent] = {"error": describe(exc)}
                continue
            metrics[agent] = {k: answer.get(k) for k in ("agent_metrics", "key_metrics", "group_level_metrics")}
        return metrics

    def pin_rows(self, rows_by_prompt: Mapping[int, Sequence[Mapping[str, Any]]]) -> None:
        """Send exactly these rows for these prompt indices (e.g. read back from a materialized file on
        resume) instead of building them with `_build_inputs`."""
        self._pinned.update({idx: [copy.deepcopy(dict(r)) for r in rows] for idx, rows in rows_by_prompt.items()})

    def _validate_init_params(self) -> None:
        """Raise one ValueError naming every bad constructor argument (Gym owns turns, stops and top_k)."""
        _, problems = check_common_parameters(self.num_generations_per_prompt, self.max_seq_len)
        if isinstance(self.generation_config, GenerationConfig):
            problems += check_gym_parameters(self.max_rollout_turns, self.generation_config)
        else:
            problems.append(f"generation_config must be a GenerationConfig, got {self.generation_config!r}")
        gym = None
        if self.gym_config is None:
            problems.append("gym_config is required with use_nemo_gym=True")
        elif isinstance(self.gym_config, GymConfig):
            gym = self.gym_config
        else:
            try:
                gym = GymConfig.model_validate(self.gym_config)
            except ValidationError as err:
                for e in err.errors():
                    where = ".".join(map(str, ("gym_config", *e["loc"])))
                    got = f" (got {e['input']!r})" if e["type"] != "missing" and e["loc"] else ""
                    problems.append(f"{where}: {e['msg']}{got}")
        if gym is not None and (gym.launch is not None or gym.serve_policy) and self.policy_generation is None:
            problems.append("policy_generation is required: the GenerationInterface our policy server serves to Gym")
        if problems:
            raise ValueError(f"{type(self).__name__}: " + "; ".join(problems))

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
                    aggregate_timeout_s=self.gym.aggregate_timeout_s,
                    health_interval_s=self.gym.health_check_interval_s,
                    health_timeout_s=self.gym.health_check_timeout_s,
                    health_failures=self.gym.health_check_failures,
                )
            return self._client

    def _start_servers(self) -> dict[str, str]:
        # local: only when this manager launches Gym itself (light; could move up)
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
        # lazy: the policy server loads fastapi, uvicorn and the backends
        from nemo_rl_ext.serving.policy_server import PolicyServer

        with self._life_lock:
            server = self._server
        if server is None:
            server = PolicyServer(
                self.policy_generation, self.tokenizer, host=self.gym.policy_host, port=self.gym.policy_port,
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

    async def run_rollout(self, input_sample: DatumSpec, *, call: RolloutCall = NO_CALL) -> PromptGroupRecord:
        """Send the prompt's N rows (N from `call`'s counts, else the mode's) to its Gym agent as one batch;
        one record."""
        if input_sample.stop_strings:
            raise ValueError(f"row {input_sample.idx}: stop_strings must be empty with NeMo Gym (agents own the "
                             f"turns), got {list(input_sample.stop_strings)}")
        inputs = self._inputs_for_call(input_sample, call)
        agent = agent_name_of(inputs[0])
        known = await (await self.client()).agent_urls()
        if agent not in known:
            raise ValueError(f"row {input_sample.idx}: unknown Gym agent {agent!r}; known agents: {sorted(known)}")
        completions, batch_metrics = await self._run_rollouts(inputs)
        metrics = {**self._compute_rollout_metrics(completions, agent), **batch_metrics}
        prompt = next((c.message_log[:1] for c in completions if c.stop_reason is not StopReason.ERROR), ())
        return PromptGroupRecord(
            prompt_idx=input_sample.idx,
            prompt=prompt,
            extra_env_info=input_sample.extra_env_info,
            metadata=input_sample.metadata,
            completions=tuple(completions),
            rollout_metrics=metrics,
            loss_multiplier=input_sample.loss_multiplier,
            agent_name=agent,
        )

    def _inputs_for_call(self, input_sample: DatumSpec, call: RolloutCall) -> list[dict[str, Any]]:
        """`_build_inputs`, with the call's own sample counts when it has them (a TypeError naming the fix when
        an override of that hook, NeMo-RL's one-argument signature, cannot take them)."""
        if call.counts is None:
            return self._build_inputs(input_sample)
        if "counts" not in inspect.signature(self._build_inputs).parameters:
            raise TypeError(
                f"{type(self).__name__}._build_inputs takes no `counts` keyword, so it cannot build the rows of a "
                "call with its own sample counts (stream_rollouts(counts=...)); add `*, counts=None` to it and "
                "pass it on to super()._build_inputs"
            )
        return self._build_inputs(input_sample, counts=call.counts)

    # ---- the hooks ------------------------------------------------------------------------------

    def _build_inputs(self, input_sample: DatumSpec, *, counts: GenerationCounts | None = None) -> list[dict[str, Any]]:
        """The N rows of one prompt, as Gym's collector builds them (see `datasets.prepare_gym_rows`):
        `agent_ref` (the row's, else the datum's agent, else `gym.agent_name`), `responses_create_params`
        with `gym.responses_create_params` merged in, then the sampling parameters of the generation config
        and a seed per sample in `metadata.extra_body`; Gym's `_ng_task_index` (from the datum's metadata,
        shared by identical rows, else the datum's index) and `_ng_rollout_index` (counting on across
        identical rows). Rows pinned with `pin_rows` are returned as pinned. `counts`: this call's (None: the
        mode's own)."""
        if input_sample.idx in self._pinned:
            return copy.deepcopy(self._pinned[input_sample.idx])
        row = input_sample.extra_env_info
        if not isinstance(row.get("responses_create_params"), Mapping):
            raise ValueError(f"row {input_sample.idx}: missing 'responses_create_params' (keys: {sorted(row)})")
        if "agent_ref" in row:
            agent = agent_name_of(row)
        else:
            agent = input_sample.agent_name or self.gym.agent_name or input_sample.agent
        config = self.generation_config
        count = (self._counts if counts is None else counts).for_agent(agent)
        first_rollout = int(input_sample.metadata.get(GYM_REPEAT_KEY, 0)) * count
        rows = []
        for sample in range(count):
            r = copy.deepcopy(dict(row))
            r.setdefault("agent_ref", {"name": agent})
            params = {**r["responses_create_params"], **copy.deepcopy(self.gym.responses_create_params)}
            params["temperature"] = config.temperature
            params["top_p"] = config.top_p
            params["max_output_tokens"] = config.max_new_tokens
            seed = rollout_seed(config.seed, input_sample.idx, sample, 0)
            if seed is not None:
                metadata = dict(params.get("metadata") or {})
                extra = json.loads(metadata.get("extra_body") or "{}")
                metadata["extra_body"] = json.dumps({**extra, "seed": seed})
                params["metadata"] = metadata
            r["responses_create_params"] = params
            r["_ng_task_index"] = input_sample.metadata.get(GYM_TASK_KEY, input_sample.idx)
            r["_ng_rollout_index"] = first_rollout + sample
            rows.append(r)
        return rows

    async def _run_rollouts(
        self, inputs: Sequence[Mapping[str, Any]], timer: Any = None, timer_prefix: str = "nemo_gym"
    ) -> tuple[list[Completion], dict[str, float]]:
        """Dispatch the rows to Gym as one batch (concurrently; the client bounds, times out and retries each)
        and convert every result with `_result_to_completion`; returns the completions in row order and the
        batch's metrics. A row that fails on every attempt becomes an error completion (or, with
        `on_error="raise"`, raises `RolloutError`). `timer`: optional, NeMo-RL's `Timer` shape
        (`with timer.time(label)`); the dispatch is timed as `f"{timer_prefix}/run_rollouts"`."""
        client = await self.client()
        start = time.perf_counter()
        timing = timer.time(f"{timer_prefix}/run_rollouts") if timer is not None else contextlib.nullcontext()
        with timing:
            pairs = await gather_or_cancel(self._run_row(client, row) for row in inputs)
        metrics = {
            "rollout/wall_time_s": time.perf_counter() - start,
            "rollout/gym/failed_rows": float(sum(not answered for _, answered in pairs)),
        }
        return [completion for completion, _ in pairs], metrics

    def _result_to_completion(self, result: Mapping[str, Any]) -> Completion:
        """One Gym result (with its row's `agent_ref`) -> a Completion: token ids and logprobs from the output
        items, the reward, and the stop reason (see `gym_results.result_to_completion`)."""
        return result_to_completion(result, agent_name_of(result), self.tokenizer, self.gym.reward_components)

    def _compute_rollout_metrics(self, completions: Sequence[Completion], agent_name: str) -> dict[str, float]:
        """The group's flat metrics: `rollout_metrics` of the completions plus the mean of every numeric field
        of Gym's results as `agent/<agent_name>/gym/<key>/mean`."""
        metrics = rollout_metrics(completions, [1] * len(completions))
        results = [c.env_extras["gym_result"] for c in completions if c.env_extras.get("gym_result") is not None]
        metrics.update(gym_numeric_metrics([(agent_name, r) for r in results]))
        return metrics

    async def _run_row(self, client: GymClient, row: Mapping[str, Any]) -> tuple[Completion, bool]:
        """One row -> (its completion, with the wall seconds of its /run call, retries included, as
        `latency_s`; whether Gym answered it)."""
        start = time.perf_counter()
        completion, answered = await self._row_completion(client, row)
        return dataclasses.replace(completion, latency_s=time.perf_counter() - start), answered

    async def _row_completion(self, client: GymClient, row: Mapping[str, Any]) -> tuple[Completion, bool]:
        label = f"row {row.get('_ng_task_index')}, sample {row.get('_ng_rollout_index')}"
        agent = agent_name_of(row)
        try:
            result = await client.run(row, label=label)
        except Exception as exc:
            if self.fault_policy.on_error == "raise":
                raise RolloutError(f"{label}: {describe(exc)}") from exc
            extras: dict[str, Any] = {"answer": None}
            message = describe(exc)
            if isinstance(exc, GymRowError):
                extras["gym_error"] = exc.record()
                if exc.is_data_error:  # Gym refused the row itself: not retried on resume (records.DATA_ERROR)
                    extras[ERROR_KIND] = DATA_ERROR
                    message = f"data error (Gym refused the row; fix it, retrying cannot help): {message}"
            error = Completion((), 0.0, False, StopReason.ERROR, 0, agent, extras, message)
            return error, False
        result = {**{k: row[k] for k in ROW_KEYS if k in row}, **result}
        try:
            completion = self._result_to_completion(result)
        except RewardComponentError:  # the environment's contract or the config's names: never recorded
            raise
        except Exception as exc:
            if self.fault_policy.on_error == "raise":
                raise RolloutError(f"{label}: {describe(exc)}") from exc
            completion = Completion((), 0.0, False, StopReason.ERROR, 0, agent, {"answer": None}, describe(exc))
        if completion.stop_reason is StopReason.ERROR and self.fault_policy.on_error == "raise":
            raise RolloutError(f"{label}: {completion.error}")
        return self._with_prompt_length(completion), True

    def _with_prompt_length(self, completion: Completion) -> Completion:
        """A completion whose prompt was too long, with the context limit and, when our policy server refused
        it, the longest prompt it had refused by then (Gym's result does not say how long the prompt was; the
        longest over a run's completions is the longest prompt refused)."""
        if prompt_too_long(completion) is None:
            return completion
        refused = self._server.refused_prompts.longest if self._server is not None else None
        limit = self.policy_generation.max_model_len if self.policy_generation is not None else None
        extras = {**completion.env_extras, **too_long_extras(refused, limit)}
        return dataclasses.replace(completion, env_extras=extras)
