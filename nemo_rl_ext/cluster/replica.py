"""One generation replica: the object a Ray actor hosts (a backend, the weight version it serves).

`GenerationReplica` is a plain class; `RoutedGeneration` makes it an actor (`ray.remote(GenerationReplica)`)
with the resources of `replica_actor_options`. It builds its backend from a picklable factory inside the
actor process (one torch thread on CPU), so the same class hosts hf, vLLM or a simulated engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from nemo_rl_ext.cluster.config import ReplicaResources
from nemo_rl_ext.models.generation.interfaces import (
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
)

logger = logging.getLogger(__name__)

BackendFactory = Callable[[], GenerationInterface]
"""Builds the backend inside the replica's process; must pickle (a module-level function or a partial)."""


class GenerationReplica:
    """Hosts one backend in a Ray actor; labels every output with the pool's weight version.

    Backends that keep no version (hf) get one here: an update waits for the requests in flight (or, with
    `in_flight="abort"`, cancels them: they return `FinishReason.ABORTED` with no tokens, since hf keeps no
    partial output), new requests wait for the update, and each output carries the version it ran under.
    Backends that keep their own (vLLM) do this themselves; their count is shifted to the pool's numbering.
    """

    def __init__(
        self,
        factory: BackendFactory,
        *,
        index: int,
        weights: Mapping[str, Any] | None = None,
        weight_version: int = 0,
        torch_threads: int | None = 1,
    ) -> None:
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)  # Ray does not cap torch threads
        self.index = index
        self.backend = factory()
        self._own_versions = type(self.backend).weight_version is GenerationInterface.weight_version
        self._version = 0
        """The pool's version of the weights served (when the backend keeps none)."""
        self._offset = 0
        """Pool version minus the backend's own version (backends that keep one)."""
        self._tasks: set[asyncio.Task] = set()
        self._aborted: set[asyncio.Task] = set()
        self._update_done: asyncio.Event | None = None
        self._update_lock: asyncio.Lock | None = None
        if weights is not None:  # a restarted replica serves the pool's current weights from its first request
            self._load_sync(weights, weight_version, "finish")

    def ready(self) -> dict[str, Any]:
        """Where this replica runs and what it serves (returns once the backend is built)."""
        import ray

        return {"index": self.index, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "weight_version": self.weight_version()}

    def weight_version(self) -> int:
        return self._version if self._own_versions else self.backend.weight_version + self._offset

    async def generate(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        while self._update_done is not None:  # requests arriving during an update run on the new weights
            await self._update_done.wait()
        if not self._own_versions:
            out = await self.backend.generate_async(prompt_token_ids, config)
            return dataclasses.replace(out, weight_version=out.weight_version + self._offset)
        version = self._version
        task = asyncio.ensure_future(self.backend.generate_async(prompt_token_ids, config))
        self._tasks.add(task)
        try:
            out = await task
        except asyncio.CancelledError:
            if task in self._aborted:  # cancelled by an abort-mode update, not by the caller
                return GenerationOutput((), (), FinishReason.ABORTED, weight_version=version)
            raise
        finally:
            self._tasks.discard(task)
            self._aborted.discard(task)
        return dataclasses.replace(out, weight_version=version)

    async def update_weights(
        self, state_dict: Mapping[str, Any], version: int, in_flight: Literal["finish", "abort"] = "finish"
    ) -> int:
        """Serve `state_dict` as pool version `version`; returns the version now served."""
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            if not self._own_versions:
                await asyncio.to_thread(self._load_sync, state_dict, version, in_flight)
                return self.weight_version()
            self._update_done = asyncio.Event()
            try:
                if in_flight == "abort":
                    for task in self._tasks:
                        self._aborted.add(task)
                        task.cancel()
                while self._tasks:
                    await asyncio.wait(set(self._tasks))
                await asyncio.to_thread(self._load_sync, state_dict, version, in_flight)
            finally:
                done, self._update_done = self._update_done, None
                done.set()
            return self._version

    def _load_sync(self, state_dict: Mapping[str, Any], version: int, in_flight: str) -> None:
        if self._own_versions:
            self.backend.update_weights(state_dict)
            self._version = version
            return
        if in_flight == "finish":
            self.backend.update_weights(state_dict)
        else:
            self.backend.update_weights(state_dict, in_flight=in_flight)
        self._offset = version - self.backend.weight_version

    def shutdown(self) -> None:
        self.backend.shutdown()


def replica_actor_options(resources: ReplicaResources, *, spread: bool = True) -> tuple[dict[str, Any], Any]:
    """Ray options of one replica actor, and the placement group it needs (None when it needs none).

    CPU replicas and single-GPU replicas reserve `num_cpus` / `num_gpus` directly and are spread over
    nodes. A replica with `num_gpus` > 1 is a tensor-parallel vLLM engine: it gets a placement group of
    one {GPU: 1, CPU: 1} bundle per GPU, packed on one node, which vLLM's Ray executor (started from
    inside the actor) fills with its workers. NOT TESTED here (no GPU): the CPU path is what CI runs.
    """
    if resources.num_gpus <= 1:
        options = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus, "max_restarts": 0}
        if spread:
            options["scheduling_strategy"] = "SPREAD"
        return options, None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus = int(resources.num_gpus)
    if gpus != resources.num_gpus:
        raise ValueError(f"cluster.replica.num_gpus above 1 must be a whole number of GPUs, got {resources.num_gpus}")
    group = placement_group([{"GPU": 1, "CPU": 1}] * gpus, strategy="STRICT_PACK")
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
    return {"num_cpus": 0, "num_gpus": 0, "max_restarts": 0, "scheduling_strategy": strategy}, group


def build_policy_backend(policy_cfg: Any, tensor_parallel_ray: bool = False) -> GenerationInterface:
    """The backend a replica serves for a `PolicyConfig` (built inside the replica's process).

    `tensor_parallel_ray`: a vLLM engine spanning several GPUs runs its workers as Ray actors in the
    replica's placement group (`distributed_executor_backend="ray"`). NOT TESTED here (no GPU).
    """
    if policy_cfg.backend == "vllm" and tensor_parallel_ray:
        from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration
        from nemo_rl_ext.models.policy import resolve_model_path

        return VllmGeneration(
            resolve_model_path(policy_cfg),
            max_model_len=policy_cfg.max_model_len,
            dtype=policy_cfg.dtype,
            gpu_memory_utilization=policy_cfg.vllm.gpu_memory_utilization,
            tensor_parallel_size=policy_cfg.vllm.tensor_parallel_size,
            enforce_eager=policy_cfg.vllm.enforce_eager,
            enable_prefix_caching=policy_cfg.vllm.enable_prefix_caching,
            engine_kwargs={"distributed_executor_backend": "ray"},
        )
    from nemo_rl_ext.models.policy import build_generation

    return build_generation(policy_cfg)


def policy_backend_factory(policy_cfg: Any) -> BackendFactory:
    """A picklable factory of `build_policy_backend(policy_cfg)`."""
    tensor_parallel_ray = policy_cfg.backend == "vllm" and policy_cfg.vllm.tensor_parallel_size > 1
    return functools.partial(build_policy_backend, policy_cfg, tensor_parallel_ray)
