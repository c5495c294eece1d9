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
from typing import Any

from nemo_rl_ext.models.config import ReplicaResources
from nemo_rl_ext.models.generation.interfaces import (
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    InFlightPolicy,
)

logger = logging.getLogger(__name__)

BackendFactory = Callable[[], GenerationInterface]
"""Builds the backend inside the replica's process; must pickle (a module-level function or a partial)."""


class GenerationReplica:
    """Hosts one backend in a Ray actor; shifts the backend's weight versions to the pool's numbering.

    The backend does the in-flight handling itself (`update_weights(..., in_flight=...)`: requests in
    flight finish on the old weights, or stop `FinishReason.ABORTED` with their partial tokens; requests
    arriving during an update wait for it) and labels each output with its own `weight_version`. A
    replica restarted at pool version v loads the pool's weights once (backend version 1), so the replica
    adds `offset` = pool version - backend version to every version it reports.
    """

    def __init__(
        self,
        factory: BackendFactory,
        *,
        index: int,
        weights: Mapping[str, Any] | None = None,
        weight_version: int = 0,
        torch_threads: int | None = 1,
        partial: bool = False,
    ) -> None:
        if torch_threads:
            import torch  # Ray actor code: caps torch threads in the worker process

            torch.set_num_threads(torch_threads)  # Ray does not cap torch threads
        self.index = index
        self.backend = factory()
        self._offset = 0
        """Pool version minus the backend's own version."""
        self._update_lock: asyncio.Lock | None = None
        if weights is not None:  # a restarted replica serves the pool's current weights from its first request
            # (a partial update, a LoRA refit's merged target modules, applies on top of the folder's weights)
            self._load_sync(weights, weight_version, "finish", partial)

    def ready(self) -> dict[str, Any]:
        """Where this replica runs and what it serves (returns once the backend is built)."""
        import ray  # Ray actor code: runs in the worker process

        return {"index": self.index, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "weight_version": self.weight_version()}

    def weight_version(self) -> int:
        return self.backend.weight_version + self._offset

    def accepts_partial_update(self) -> bool:
        """Whether this replica's backend serves `update_weights(..., partial=True)`."""
        return self.backend.accepts_partial_update

    async def generate(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        out = await self.backend.generate_async(prompt_token_ids, config)
        return dataclasses.replace(out, weight_version=out.weight_version + self._offset)

    async def update_weights(
        self, state_dict: Mapping[str, Any], version: int, in_flight: InFlightPolicy = "finish", partial: bool = False
    ) -> int:
        """Serve `state_dict` as pool version `version`; returns the version now served."""
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:  # the backend's call blocks: run it off the loop that serves requests
            await asyncio.to_thread(self._load_sync, state_dict, version, in_flight, partial)
            return self.weight_version()

    def _load_sync(self, state_dict: Mapping[str, Any], version: int, in_flight: str, partial: bool = False) -> None:
        before = self.backend.weight_version
        kwargs: dict[str, Any] = {}  # only what differs from the defaults: test backends may not take them
        if in_flight != "finish":
            kwargs["in_flight"] = in_flight
        if partial:
            kwargs["partial"] = True
        self.backend.update_weights(state_dict, **kwargs)
        if self.backend.weight_version != before + 1:
            raise RuntimeError(
                f"{type(self.backend).__name__}.update_weights did not advance its weight_version "
                f"({before} -> {self.backend.weight_version}): a pool's backend must count its updates"
            )
        self._offset = version - self.backend.weight_version

    def shutdown(self) -> None:
        self.backend.shutdown()


def replica_actor_options(resources: ReplicaResources, *, spread: bool = True) -> tuple[dict[str, Any], Any]:
    """Ray options of one replica actor, and the placement group it needs (None when it needs none).

    CPU replicas and single-GPU replicas reserve `num_cpus` / `num_gpus` directly and are spread over
    nodes. A replica with `num_gpus` > 1 is an engine sharded over several GPUs (vLLM's tensor parallelism):
    it gets a placement group of one {GPU: 1, CPU: 1} bundle per GPU, packed on one node, which the
    engine's Ray workers (vLLM's Ray executor, asked for by the backend's `replica_engine_kwargs`, started
    from inside the actor) fill. NOT TESTED here (no GPU): the CPU path is what CI runs.
    """
    if resources.num_gpus <= 1:
        options = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus, "max_restarts": 0}
        if spread:
            options["scheduling_strategy"] = "SPREAD"
        return options, None
    # lazy: ray loads only when Ray is used, not by importing this module
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus = int(resources.num_gpus)
    if gpus != resources.num_gpus:
        raise ValueError(f"cluster.replica.num_gpus above 1 must be a whole number of GPUs, got {resources.num_gpus}")
    group = placement_group([{"GPU": 1, "CPU": 1}] * gpus, strategy="STRICT_PACK")
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
    return {"num_cpus": 0, "num_gpus": 0, "max_restarts": 0, "scheduling_strategy": strategy}, group


def build_policy_backend(policy_cfg: Any, engine_kwargs: Mapping[str, Any] | None = None) -> GenerationInterface:
    """The backend a replica serves for a `PolicyConfig` (built inside the replica's process), with the
    engine arguments its registry entry asks for in a replica (`policy_backend_factory`)."""
    # lazy: models.backends loads torch; runs in the replica's worker process
    from nemo_rl_ext.models.backends import build_generation

    return build_generation(policy_cfg, engine_kwargs=engine_kwargs)


def policy_backend_factory(policy_cfg: Any) -> BackendFactory:
    """A picklable factory of `build_policy_backend(policy_cfg, ...)`; the backend's registry entry
    (`replica_engine_kwargs`) says which engine arguments a replica adds."""
    # lazy: models.backends loads torch; importing cluster stays light
    from nemo_rl_ext.models.backends import backend_entry

    engine_kwargs = backend_entry(policy_cfg.backend).replica_engine_kwargs(policy_cfg)
    return functools.partial(build_policy_backend, policy_cfg, dict(engine_kwargs) if engine_kwargs else None)
