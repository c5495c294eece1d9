"""`RoutedGeneration`: one `GenerationInterface` over N replica actors, routed in the caller's process.

No router actor sits on the request path: the caller picks a replica and calls it directly (one actor
round trip per request). Routing:

- A request whose `GenerationConfig.session` is set (native rollouts set (prompt index, sample index))
  goes to the replica that served that session before, so a multi-turn prompt extends a prefix that
  replica has seen (its prefix cache).
- A new session, or a request without one, goes to the replica with the fewest requests in flight.
- A session moves to the least-loaded replica when its own would end up more than `move_threshold`
  requests in flight above it (sticky routing alone piles load on one replica); moves are counted.

Health: a replica whose actor dies (killed, its node lost, its process crashed) has its in-flight requests
sent again to another replica (nothing lost; counted as retries) and is restarted with the pool's current
weights; after `max_failures` deaths in a row without a served request it is taken out, with a log line.

`update_weights` puts the state dict in Ray's object store once and hands every replica the same
reference; it returns when every replica serves the new version, which each output's `weight_version`
carries.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nemo_rl_ext.cluster.replica import BackendFactory, GenerationReplica, replica_actor_options
from nemo_rl_ext.models.config import ClusterConfig, ReplicaResources
from nemo_rl_ext.models.generation.interfaces import (
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    InFlightPolicy,
    check_in_flight,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

MAX_SESSIONS = 1 << 16
"""Sessions remembered (least recently used forgotten first): bounds the routing table's memory."""


@dataclass
class _Replica:
    """The caller's view of one replica: its actor and its counters."""

    index: int
    actor: Any
    placement_group: Any = None
    incarnation: int = 0
    removed: bool = False
    consecutive_failures: int = 0
    in_flight: int = 0
    requests: int = 0
    tokens: int = 0
    in_flight_max: int = 0
    in_flight_sum: int = 0
    session_moves: int = 0
    retries: int = 0
    restarts: int = 0
    session_requests: int = 0
    prefix_reuses: int = 0


class RoutedGeneration(GenerationInterface):
    """N generation replicas (Ray actors) behind one `GenerationInterface`; see the module docstring."""

    def __init__(
        self,
        factory: BackendFactory,
        *,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        num_replicas: int = 2,
        resources: ReplicaResources | None = None,
        move_threshold: int = 4,
        max_failures: int = 3,
        torch_threads: int | None = 1,
        ready_timeout_s: float = 600.0,
        owns_ray: bool = False,
    ) -> None:
        import ray  # lazy: ray loads only when Ray is used, not by importing this module

        if not ray.is_initialized():
            raise RuntimeError("RoutedGeneration needs Ray: call nemo_rl_ext.cluster.init_ray(cfg) first")
        if num_replicas < 1 or move_threshold < 1 or max_failures < 1:
            raise ValueError(
                f"num_replicas, move_threshold and max_failures must be >= 1, got {num_replicas}, "
                f"{move_threshold}, {max_failures}"
            )
        self._ray = ray
        self._factory = factory
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._resources = resources or ReplicaResources()
        self.move_threshold = move_threshold
        self.max_failures = max_failures
        self._torch_threads = torch_threads
        self._actor_class = ray.remote(GenerationReplica)
        self._lock = threading.Lock()
        self._sessions: OrderedDict[Hashable, int] = OrderedDict()
        self._last_prompt: OrderedDict[Hashable, tuple[int, int, int, int]] = OrderedDict()
        self._weights_ref: Any = None
        """The object-store reference of the latest weights (None: the factory's own); restarts load it."""
        self._ref_version = 0
        """The pool version `_weights_ref` holds (one above `_weight_version` while an update runs)."""
        self._ref_partial = False
        """`_weights_ref` holds only changed tensors (applied on top of the model folder's weights)."""
        self._accepts_partial: bool | None = None
        self._weight_version = 0
        self._spread_max = 0
        self._closed = False
        self._owns_ray = owns_ray
        """True when `init_ray` started or joined Ray for this pool: `shutdown` then also ends Ray."""
        self._replicas = [_Replica(i, None) for i in range(num_replicas)]
        try:
            for replica in self._replicas:
                options, replica.placement_group = replica_actor_options(self._resources)
                if replica.placement_group is not None:
                    ray.get(replica.placement_group.ready(), timeout=ready_timeout_s)
                replica.actor = self._new_actor(replica, options)
            self.replica_info = ray.get([r.actor.ready.remote() for r in self._replicas], timeout=ready_timeout_s)
            """Per replica at start: index, pid, node_id, weight_version."""
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def from_policy(
        cls, policy_cfg: Any, cluster_cfg: ClusterConfig, tokenizer: Any = None, **kwargs: Any
    ) -> RoutedGeneration:
        """A pool of `cluster_cfg.num_replicas` replicas of the backend `policy_cfg` names (a PolicyConfig).

        The model folder must be readable at the same path on every node (a shared file system).
        `tokenizer`: the caller's (default: the model folder's)."""
        # lazy: models.loading loads torch; only when built from a policy (no cycle)
        from nemo_rl_ext.cluster.replica import policy_backend_factory
        from nemo_rl_ext.models.loading import load_tokenizer
        from nemo_rl_ext.models.policy import resolve_model_path

        if tokenizer is None:
            tokenizer = load_tokenizer(resolve_model_path(policy_cfg))
        return cls(
            policy_backend_factory(policy_cfg),
            tokenizer=tokenizer,
            max_model_len=policy_cfg.max_model_len,
            num_replicas=cluster_cfg.num_replicas,
            resources=cluster_cfg.replica,
            move_threshold=cluster_cfg.move_threshold,
            max_failures=cluster_cfg.max_failures,
            **kwargs,
        )

    # ---- the interface ------------------------------------------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def weight_version(self) -> int:
        return self._weight_version

    async def generate_async(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        if self._closed:
            raise RuntimeError("RoutedGeneration was shut down")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("prompt_token_ids is empty: a prompt needs at least one token")
        session = config.session
        exclude: set[int] = set()
        for _ in range(len(self._replicas) * (self.max_failures + 1) + 1):
            replica, incarnation = self._dispatch(session, exclude, prompt)
            ref = replica.actor.generate.remote(prompt, config)
            try:
                out = await ref
            except asyncio.CancelledError:
                self._ray.cancel(ref)
                raise
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.ActorUnavailableError) as exc:
                self._replica_failed(replica, incarnation, exc)
                with self._lock:
                    replica.retries += 1
                exclude.add(replica.index)
                logger.warning("replica %d failed a request (%s); sending it to another replica",
                               replica.index, type(exc).__name__)
                continue
            finally:
                with self._lock:
                    replica.in_flight -= 1
            with self._lock:
                replica.tokens += len(out.output_ids)
                if replica.incarnation == incarnation:
                    replica.consecutive_failures = 0
            return out
        raise RuntimeError(f"generation failed on every replica after {len(exclude)} replica failures")

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, in_flight: InFlightPolicy = "finish", partial: bool = False
    ) -> None:
        """One `ray.put` of `state_dict`, the same reference to every live replica; returns when all serve it.
        `partial`: only the tensors that changed (a LoRA refit's merged target modules); a replica restarted later
        applies the latest one on top of its model folder's weights."""
        if self._closed:
            raise RuntimeError("RoutedGeneration was shut down")
        check_in_flight(in_flight)
        if partial and not self.accepts_partial_update:
            raise ValueError("update_weights(partial=True): this pool's backend takes every weight")
        ray = self._ray
        ref = ray.put(dict(state_dict))
        version = self._weight_version + 1
        with self._lock:
            previous = (self._weights_ref, self._ref_version, self._ref_partial)
            # a replica restarted from now on loads it
            self._weights_ref, self._ref_version, self._ref_partial = ref, version, partial
            targets = [(r, r.incarnation) for r in self._replicas if not r.removed]
        try:
            for replica, incarnation in targets:
                self._update_one(replica, incarnation, ref, version, in_flight, partial)
        except BaseException:
            with self._lock:
                self._weights_ref, self._ref_version, self._ref_partial = previous
            raise
        self._weight_version = version

    @property
    def accepts_partial_update(self) -> bool:
        """Whether the replicas' backend serves partial updates (asked of one live replica, once)."""
        if self._accepts_partial is None:
            replica = next(r for r in self._replicas if not r.removed)
            self._accepts_partial = bool(self._ray.get(replica.actor.accepts_partial_update.remote()))
        return self._accepts_partial

    def _update_one(
        self, replica: _Replica, incarnation: int, ref: Any, version: int, in_flight: str, partial: bool = False
    ) -> None:
        """Send the update to one replica; a replica that dies meanwhile restarts on the new weights."""
        ray = self._ray
        try:
            served = ray.get(replica.actor.update_weights.remote(ref, version, in_flight, partial))
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None  # e.g. the ValueError naming missing weights
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            self._replica_failed(replica, incarnation, exc)
            if replica.removed:
                return
            served = ray.get(replica.actor.weight_version.remote())
        if served != version:
            raise RuntimeError(f"replica {replica.index} serves weight version {served}, expected {version}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for replica in self._replicas:
            self._kill(replica)
        if self._owns_ray:
            self._ray.shutdown()

    # ---- routing ------------------------------------------------------------------------------

    def _dispatch(self, session: Hashable | None, exclude: set[int], prompt: list[int]) -> tuple[_Replica, int]:
        """Pick the replica for one request and count it in flight there; returns it and its incarnation."""
        with self._lock:
            replica = self._route(session, exclude)
            replica.in_flight += 1
            replica.requests += 1
            replica.in_flight_max = max(replica.in_flight_max, replica.in_flight)
            replica.in_flight_sum += replica.in_flight
            live = [r.in_flight for r in self._replicas if not r.removed]
            self._spread_max = max(self._spread_max, replica.in_flight - min(live))
            if session is not None:
                self._note_prefix(replica, session, prompt)
            return replica, replica.incarnation

    def _route(self, session: Hashable | None, exclude: set[int]) -> _Replica:
        live = [r for r in self._replicas if not r.removed]
        if not live:
            raise RuntimeError("no generation replica is left: every one failed repeatedly (see the log)")
        candidates = [r for r in live if r.index not in exclude] or live
        least = min(candidates, key=lambda r: (r.in_flight, r.requests))
        if session is None:
            return least
        index = self._sessions.get(session)
        if index is not None:
            own = self._replicas[index]
            if own in candidates:
                if own.in_flight + 1 - least.in_flight <= self.move_threshold:
                    self._sessions.move_to_end(session)
                    return own
                own.session_moves += 1
        self._sessions[session] = least.index
        self._sessions.move_to_end(session)
        if len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return least

    def _note_prefix(self, replica: _Replica, session: Hashable, prompt: list[int]) -> None:
        """Count whether this prompt extends the previous prompt of its session on the same replica."""
        replica.session_requests += 1
        previous = self._last_prompt.get(session)
        if previous is not None:
            index, incarnation, length, digest = previous
            if (
                index == replica.index
                and incarnation == replica.incarnation
                and length <= len(prompt)
                and hash(tuple(prompt[:length])) == digest
            ):
                replica.prefix_reuses += 1
        self._last_prompt[session] = (replica.index, replica.incarnation, len(prompt), hash(tuple(prompt)))
        self._last_prompt.move_to_end(session)
        if len(self._last_prompt) > MAX_SESSIONS:
            self._last_prompt.popitem(last=False)

    # ---- health -------------------------------------------------------------------------------

    def _new_actor(self, replica: _Replica, options: dict[str, Any] | None = None) -> Any:
        if options is None:
            options, _ = replica_actor_options(self._resources)
            if replica.placement_group is not None:  # the restarted actor goes back into its own group
                options = {**options, "scheduling_strategy": _same_group(replica.placement_group)}
        return self._actor_class.options(**options).remote(
            self._factory,
            index=replica.index,
            weights=self._weights_ref,
            weight_version=self._ref_version,
            torch_threads=self._torch_threads,
            partial=self._ref_partial,
        )

    def _replica_failed(self, replica: _Replica, incarnation: int, exc: BaseException) -> None:
        """Restart a replica whose actor died, or take it out after `max_failures` deaths in a row."""
        with self._lock:
            if replica.incarnation != incarnation or replica.removed or self._closed:
                return  # another request already handled this death
            replica.incarnation += 1
            replica.consecutive_failures += 1
            if replica.consecutive_failures >= self.max_failures:
                replica.removed = True
                left = sum(not r.removed for r in self._replicas)
                logger.error(
                    "generation replica %d taken out after %d failures in a row (last: %s: %s); %d replica(s) left",
                    replica.index, replica.consecutive_failures, type(exc).__name__, str(exc)[:300], left,
                )
            else:
                replica.restarts += 1
                logger.warning("generation replica %d died (%s); restarting it (restart %d)",
                               replica.index, type(exc).__name__, replica.restarts)
                old, replica.actor = replica.actor, self._new_actor(replica)
        if replica.removed:
            self._kill(replica)
        else:
            self._ray.kill(old, no_restart=True)

    def _kill(self, replica: _Replica) -> None:
        ray = self._ray
        if replica.actor is not None:
            try:
                ray.kill(replica.actor, no_restart=True)
            except Exception:  # already gone
                pass
        if replica.placement_group is not None and (replica.removed or self._closed):
            # lazy: ray loads only when Ray is used, not by importing this module
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(replica.placement_group)
            replica.placement_group = None

    # ---- metrics ------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Flat per-replica counters (`cluster/replica/<i>/...`), the pool's totals (`cluster/...`) and the
        version every replica serves (`cluster/weight_version`)."""
        out: dict[str, float] = {}
        with self._lock:
            for r in self._replicas:
                p = f"cluster/replica/{r.index}"
                out[f"{p}/requests"] = float(r.requests)
                out[f"{p}/tokens"] = float(r.tokens)
                out[f"{p}/in_flight/max"] = float(r.in_flight_max)
                out[f"{p}/in_flight/mean"] = r.in_flight_sum / r.requests if r.requests else 0.0
                out[f"{p}/session_moves"] = float(r.session_moves)
                out[f"{p}/retries"] = float(r.retries)
                out[f"{p}/restarts"] = float(r.restarts)
                out[f"{p}/prefix_reuse"] = r.prefix_reuses / r.session_requests if r.session_requests else 0.0
                out[f"{p}/live"] = 0.0 if r.removed else 1.0
            for name in ("requests", "tokens", "session_moves", "retries", "restarts"):
                out[f"cluster/{name}"] = float(sum(getattr(r, name) for r in self._replicas))
            out["cluster/replicas_live"] = float(sum(not r.removed for r in self._replicas))
            out["cluster/in_flight_spread/max"] = float(self._spread_max)
        out["cluster/weight_version"] = float(self.weight_version)
        return out

    def session_replica(self, session: Hashable) -> int | None:
        """The replica a session is routed to now (None: unknown or forgotten)."""
        with self._lock:
            return self._sessions.get(session)


@functools.cache
def _strategy_class() -> Any:
    # lazy: ray loads only when Ray is used, not by importing this module
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy


def _same_group(group: Any) -> Any:
    return _strategy_class()(group, placement_group_capture_child_tasks=True)
