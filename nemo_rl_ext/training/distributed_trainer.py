"""The trainer with `trainer.workers > 1`: FSDP2 ranks as Ray actors (`fsdp_workers.TrainerRank`), driven from the
GRPO process, which holds no trainer model. Its interface is `PolicyTrainer`'s (`train_step`, `logprobs`,
`state_dict`), so the loop does not care how many ranks train; checkpoints are sharded (`save_sharded`: each rank
writes its shards, see `sharded_checkpoint`), and a checkpoint of one process loads too (its weights as the model
folder, its optimizer state through `optimizer.load_state_dict`).

A pass over a batch is cut into micro-batches exactly as the in-process trainer cuts it; micro-batch j goes to
rank j % workers, and every rank gets the same number of slots (None: a dummy). The driver computes each
minibatch's global token (or sequence) count and combines the per-micro-batch metrics in the in-process
order, so the metrics and the update are the in-process trainer's up to the order of float sums.

With `trainer.lora` the ranks train adapters (the KL reference is the policy with them off), `refit_weights` gathers
the merged target modules alone and a checkpoint's `policy/` holds the adapters, as with one worker.
`activation_checkpointing`, `mixed_precision: bf16`, `cpu_offload` and `sharding: none` are how each rank wraps
its model (`fsdp_wrap`).

Faults: a rank that dies (or fails) during a call raises `TrainerWorkerError` naming the rank, its pid, node id
and IP, and the other ranks are killed (they would wait in a collective). More ranks than the cluster can
place (`trainer.worker` resources) is a `ConfigError` before any model loads.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_rl_ext.cluster import ClusterConfig, init_ray
from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.objectives.aggregation import minibatch_count
from nemo_rl_ext.objectives.distillation import distillation_loss
from nemo_rl_ext.objectives.kl_reward import kl_in_reward_advantages
from nemo_rl_ext.training.config import TrainerSettings
from nemo_rl_ext.training.fsdp_workers import RankSpec, TrainerRank
from nemo_rl_ext.training.fsdp_wrap import WrapSettings
from nemo_rl_ext.training.sharded_checkpoint import check_shards_visible
from nemo_rl_ext.training.streamed_weights import StreamedWeights
from nemo_rl_ext.training.trainer import _MetricSums, minibatch_bounds

logger = logging.getLogger(__name__)

REFIT_BUCKET_BYTES = 64 * 2**20
"""Most bytes of weights one refit gather carries (a rank holds at most one such bucket beyond its shard)."""
DEAD_PEER_GRACE_S = 5.0
"""How long a rank's failure waits for a peer's death to be reported (the death is the cause to name)."""
START_TIMEOUT_S = 600.0
"""How long the ranks may take to start, join the process group and load the model."""


class TrainerWorkerError(RuntimeError):
    """A trainer rank died or failed; the message names it, its process and its node (and holds the cause's
    text, Ray's advice included); `summary` is the same in one line, for a CLI's `error:` line."""

    def __init__(self, message: str, *, rank: int, pid: Any, node_id: Any, ip: Any, what: str, cause: str) -> None:
        super().__init__(message)
        self.rank = rank
        """The rank that died or failed."""
        self.pid = pid
        """Its process id ('?' when it died before reporting it)."""
        self.node_id = node_id
        """Its Ray node id ('?' when unknown)."""
        self.ip = ip
        """Its node's IP address ('?' when unknown)."""
        self.what = what
        """'died' (its process is gone) or 'failed' (it raised)."""
        self.cause = cause
        """The cause in one line: the exception's type and the first line of its message."""

    @property
    def summary(self) -> str:
        """One line: `trainer worker rank R (pid P) on node N (IP) died: Cause: first line`."""
        return f"trainer worker rank {self.rank} (pid {self.pid}) on node {self.node_id} ({self.ip}) {self.what}: " \
               f"{self.cause}"


def _one_line(exc: BaseException) -> str:
    """`Type: first line of the message` of a rank's error; a task's error is its own exception's (`cause`),
    not Ray's wrapper, whose first line only names the task."""
    inner = getattr(exc, "cause", None)
    exc = inner if isinstance(inner, BaseException) else exc
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:300].rstrip('.')}" if first else type(exc).__name__


def check_trainer_resources(
    settings: TrainerSettings, resources: Mapping[str, float], pool: ClusterConfig | None = None
) -> None:
    """ConfigError when the cluster (`ray.cluster_resources()`) can never hold `settings.workers` ranks, next to
    the generation pool's replicas when `pool` (`policy.cluster`) puts them on the same Ray."""
    problems = []
    for key, per_rank in (("CPU", settings.worker.num_cpus), ("GPU", settings.worker.num_gpus)):
        field = f"num_{key.lower()}s"
        need, have = settings.workers * per_rank, float(resources.get(key, 0.0))
        what = f"trainer.workers={settings.workers} x trainer.worker.{field}={per_rank:g}"
        per_replica = getattr(pool.replica, field) if pool is not None else 0.0
        if per_replica:
            need += pool.num_replicas * per_replica
            what += f" + policy.cluster.num_replicas={pool.num_replicas} x policy.cluster.replica.{field}={per_replica:g}"
        if need > have:
            problems.append(f"{what} needs {need:g} {key}s, the Ray cluster has {have:g}")
    if problems:
        raise ConfigError("the trainer's ranks can't be placed:\n  - " + "\n  - ".join(problems))


class DistributedTrainer:
    """Trains the policy on `settings.workers` FSDP2 ranks (Ray actors); the same interface as PolicyTrainer."""

    def __init__(self, spec: RankSpec, settings: TrainerSettings, cluster: ClusterConfig | None = None) -> None:
        import ray  # lazy: ray loads only when Ray is used, not by importing this module

        self._owns_ray = init_ray(cluster)
        check_trainer_resources(settings, ray.cluster_resources(), cluster)
        self.spec = spec
        self.settings = spec.optimizer
        self.loss_config = spec.loss
        self.device = torch.device("cpu")
        """Where the driver keeps what it is handed (optimizer state of a checkpoint)."""
        self.world = settings.workers
        self.lora = spec.lora is not None
        """The ranks train LoRA adapters; the KL reference is the policy with them disabled."""
        self.refit_partial = self.lora
        """`refit_weights` holds only the tensors training changes (the engine keeps the others)."""
        self.optimizer = _CheckpointOptimizer(self)
        self._refit: dict[str, float] = {}
        self._submit = threading.Lock()  # one call to every rank at a time: each rank runs them in the same order
        self._failure: TrainerWorkerError | None = None  # a rank died or failed: every later call raises it
        self._teachers: dict[str, str] = {}  # distillation teachers on the ranks: key -> model spec
        actor = ray.remote(TrainerRank).options(
            num_cpus=settings.worker.num_cpus, num_gpus=settings.worker.num_gpus, max_restarts=0,
        )
        threads = 1 if spec.device == "cpu" else None
        self._ranks = [actor.remote(rank, self.world, threads) for rank in range(self.world)]
        self.workers: list[dict[str, Any]] = [{"rank": r} for r in range(self.world)]
        """Each rank's rank, pid, ip and node_id (what an error names)."""
        try:
            self.workers = self._call([(r.where, ()) for r in self._ranks], timeout_s=START_TIMEOUT_S)
            master = self.workers[0]
            self.loaded = self._call([(r.setup, (master["ip"], master["port"], spec)) for r in self._ranks],
                                     timeout_s=START_TIMEOUT_S)[0]
            """Rank 0's setup: parameter counts, and whether a reference model was loaded."""
            self._layout = self._call([(self._ranks[0].tensor_sizes, ())])[0]
            self._param_names = self._call([(self._ranks[0].trained_names, ())])[0]
        except BaseException:
            self.close()
            raise
        logger.info("trainer: %d FSDP2 ranks on %s", self.world, sorted({w["node_id"] for w in self.workers}))

    # ---- calling the ranks ------------------------------------------------------------------------

    def _call(self, calls: Sequence[tuple[Any, tuple]], timeout_s: float | None = None) -> list[Any]:
        """Run one call per rank (`(actor.method, args)`) and return their results in rank order; the first
        rank to die or fail raises `TrainerWorkerError` at once (and the other ranks are killed)."""
        import ray  # lazy: ray loads only when Ray is used, not by importing this module

        if self._failure is not None:
            raise self._failure
        # Ray runs one caller's calls to an actor in submission order; under the lock every rank gets the calls
        # of the threads that share this trainer (async GRPO trains on one, the rank teacher scores on another)
        # in the same order, so their collectives pair up
        with self._submit:
            refs = [method.remote(*args) for method, args in calls]
        rank_of = {ref: i for i, ref in enumerate(refs)}
        pending, deadline = list(refs), (time.monotonic() + timeout_s) if timeout_s else None
        while pending:
            wait = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:
                    self._fail(*self._cause(rank_of[ref], exc, [r for r in refs if r is not ref], rank_of))
            if deadline is not None and time.monotonic() >= deadline and pending:
                self._fail(rank_of[pending[0]], TimeoutError(f"no answer within {timeout_s:g} s"))
        return ray.get(refs)

    def _cause(self, rank: int, exc: BaseException, others: Sequence[Any], rank_of: dict[Any, int]
               ) -> tuple[int, BaseException]:
        """The rank to blame for `rank`'s failure: a rank whose collective broke because a peer died fails first
        (gloo sees the closed connection before Ray reports the death), so wait up to `DEAD_PEER_GRACE_S` for a
        peer that died, and name it instead."""
        import ray  # lazy: ray loads only when Ray is used, not by importing this module

        if isinstance(exc, ray.exceptions.RayActorError) or not others:
            return rank, exc
        pending, deadline = list(others), time.monotonic() + DEAD_PEER_GRACE_S
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as died:
                    return rank_of[ref], died
                except Exception:  # another rank that failed: keep looking for one that died
                    pass
        return rank, exc

    def _fail(self, rank: int, exc: BaseException) -> None:
        import ray  # lazy: ray loads only when Ray is used, not by importing this module

        where = self.workers[rank]
        died = isinstance(exc, ray.exceptions.RayActorError)
        what = "died" if died else "failed"
        text = str(exc).strip()
        error = TrainerWorkerError(
            f"trainer worker rank {rank} (pid {where.get('pid', '?')}) on node {where.get('node_id', '?')} "
            f"({where.get('ip', '?')}) {what}: {type(exc).__name__}: {text[:2000]}",
            rank=rank, pid=where.get("pid", "?"), node_id=where.get("node_id", "?"), ip=where.get("ip", "?"),
            what=what, cause=_one_line(exc),
        )
        self._failure = error
        self._kill_ranks(keep_handles=True)  # Ray itself stays up for the others using it (a generation pool)
        raise error from exc

    def _slots(self, chunks: Sequence[Any]) -> list[list[Any]]:
        """Chunk j to rank j % world; every rank gets ceil(len / world) slots, None where it has none."""
        rounds = math.ceil(len(chunks) / self.world)
        return [[chunks[j] if (j := i * self.world + r) < len(chunks) else None for i in range(rounds)]
                for r in range(self.world)]

    def _chunks(self, indices: range) -> list[range]:
        size = self.settings.micro_batch_size
        return [range(s, min(s + size, indices.stop)) for s in range(indices.start, indices.stop, size)]

    def _in_order(self, per_rank: Sequence[Sequence[Any]], n: int) -> list[Any]:
        """Undo `_slots`: the results of chunks 0..n-1."""
        return [per_rank[j % self.world][j // self.world] for j in range(n)]

    # ---- the trainer's interface ------------------------------------------------------------------

    def logprobs(self, items: Sequence[Any], *, reference: bool = False) -> list[torch.Tensor]:
        """Per-token logprobs of each completion under the current weights (or the reference model's), on
        its loss mask; 0 elsewhere (as `PolicyTrainer.logprobs`)."""
        chunks = [list(items[c.start : c.stop]) for c in self._chunks(range(len(items)))]
        per_rank = self._call([(rank.logprobs, (slots, reference))
                               for rank, slots in zip(self._ranks, self._slots(chunks), strict=True)])
        return [lp for chunk in self._in_order(per_rank, len(chunks)) for lp in chunk]

    def train_step(self, items: Sequence[Any], advantages: torch.Tensor) -> dict[str, float]:
        """One GRPO update (as `PolicyTrainer.train_step`), its micro-batches spread over the ranks."""
        bounds = minibatch_bounds(len(items), advantages, self.settings.minibatches_per_step)
        n_mini = len(bounds) - 1
        in_reward = self.loss_config.use_kl_in_reward
        old = self.logprobs(items) if n_mini > 1 or in_reward else None
        has_reference = self.spec.reference_path is not None or (self.lora and self.loss_config.kl_coef != 0.0)
        ref = self.logprobs(items, reference=True) if has_reference else None
        if in_reward:  # Reinforce++: the KL moves from the loss into the advantages, per token (on the driver)
            if ref is None:
                raise ValueError("loss.use_kl_in_reward needs the reference policy's logprobs (kl_coef > 0)")
            advantages = kl_in_reward_advantages(advantages, [x.loss_mask for x in items], old, ref,
                                                 self.loss_config)
        sums, grad_norms, skipped = _MetricSums(), [], 0
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            masks = [items[i].loss_mask for i in range(lo, hi)]
            count = minibatch_count(masks, self.loss_config)  # global: every rank divides by it
            chunks = [
                ([items[i] for i in c], advantages[c.start : c.stop],
                 [old[i] for i in c] if old else None, [ref[i] for i in c] if ref else None)
                for c in self._chunks(range(lo, hi))
            ]
            results = self._call([(rank.train_minibatch, (slots, count))
                                  for rank, slots in zip(self._ranks, self._slots(chunks), strict=True)])
            for metrics in self._in_order([r[0] for r in results], len(chunks)):
                sums.add(metrics)
            norm = results[0][1]
            if norm is None:
                skipped += 1
            else:
                grad_norms.append(norm)
        return sums.step_result(n_mini, grad_norms, skipped, self._call([(self._ranks[0].lr, ())])[0])

    def load_teacher(self, spec: str) -> str:
        """Load the distillation teacher `spec` names (a model name the loaders know, or a folder) on every rank,
        frozen and sharded as the reference model is; returns the key `score_teacher` takes."""
        from nemo_rl_ext.models.config import PolicyConfig  # lazy: models.policy builds the built-in models
        from nemo_rl_ext.models.policy import resolve_model_path

        key = f"teacher-{len(self._teachers)}"
        path = str(resolve_model_path(PolicyConfig(model_name=spec)))
        self._call([(rank.load_teacher, (key, path)) for rank in self._ranks], timeout_s=START_TIMEOUT_S)
        self._teachers[key] = spec
        logger.info("distillation teacher %s: loaded on %d ranks (%s)", spec, self.world, key)
        return key

    def score_teacher(self, key: str, batches: Sequence[list[list[int]]], top_k: int) -> list[list[Any]]:
        """Each batch's `TeacherScores` under teacher `key`: batch j on rank j % workers (a dummy forward on a
        rank with none), one forward pass per batch; in order."""
        per_rank = self._call([(rank.teacher_scores, (key, slots, top_k))
                               for rank, slots in zip(self._ranks, self._slots(list(batches)), strict=True)])
        return self._in_order(per_rank, len(batches))

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next optimizer steps, on every rank (`optimizer.scheduler`)."""
        self._call([(r.set_lr, (lr,)) for r in self._ranks])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights of the plain model (LoRA targets merged), gathered bucket by bucket (at most
        `REFIT_BUCKET_BYTES` at a time on a rank) to this process; `refit_metrics` then reports the gather."""
        return self._gather(changed_only=False)

    def refit_weights(self) -> Mapping[str, torch.Tensor]:
        """What a refit hands the engine: `state_dict()`, or with LoRA the merged target weights alone (the
        engine's other tensors are the base model's, which never change), each bucket gathered when the engine
        reads it (`StreamedWeights`): this process holds one bucket at a time besides the engine's weights."""
        if not self.lora:
            return self.state_dict()
        buckets, total = self._buckets(changed_only=True)
        self._refit = {"refit/gathered_bytes": float(total), "timing/refit/gather_seconds": 0.0,
                       "refit/buckets": float(len(buckets))}

        def fetch(names: list[str]) -> dict[str, torch.Tensor]:
            start = time.perf_counter()
            out = self._call([(rank.gather, (names,)) for rank in self._ranks])[0]
            self._refit["timing/refit/gather_seconds"] += time.perf_counter() - start
            return out

        return StreamedWeights(buckets, fetch, total)

    def _buckets(self, changed_only: bool) -> tuple[list[list[str]], int]:
        """The layout's names (a tied alias left out) in buckets of at most `REFIT_BUCKET_BYTES`, and their bytes."""
        buckets: list[list[str]] = [[]]
        size, total = 0, 0
        for name, nbytes, tied, changes in self._layout:
            if tied is not None or (changed_only and not changes):
                continue
            if buckets[-1] and size + nbytes > REFIT_BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += nbytes
            total += nbytes
        return buckets, total

    def _gather(self, changed_only: bool) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        buckets, total = self._buckets(changed_only)
        for names in buckets:
            out.update(self._call([(rank.gather, (names,)) for rank in self._ranks])[0])
        for name, _, tied, _ in self._layout:
            if tied is not None and tied in out:
                out[name] = out[tied]
        self._refit = {"refit/gathered_bytes": float(total), "timing/refit/gather_seconds": time.perf_counter() - start,
                       "refit/buckets": float(len(buckets))}
        return {name: out[name] for name, _, _, _ in self._layout if name in out}

    def save_sharded(self, folder: Path) -> None:
        """Every rank writes its shards of the trained parameters and their optimizer state into the checkpoint
        `folder` (`sharded_checkpoint`: `shards/`, and `policy/`'s config from rank 0); a rank that dies meanwhile
        raises `TrainerWorkerError`, and the folder never becomes a checkpoint."""
        self._call([(rank.save_sharded, (str(folder),)) for rank in self._ranks])
        check_shards_visible(folder)  # ranks on other nodes wrote to this process's filesystem

    def load_sharded(self, folder: Path) -> None:
        """Every rank loads its shards of a sharded checkpoint folder (written by any number of ranks)."""
        self._call([(rank.load_sharded, (str(folder),)) for rank in self._ranks])

    def _kill_ranks(self, keep_handles: bool = False) -> None:
        """Kill every rank; `keep_handles` (after a failure): keep the dead handles, so a later call reaches
        `_call` and raises the failure instead of tripping over a missing rank."""
        import ray  # lazy: ray loads only when Ray is used, not by importing this module

        for rank in getattr(self, "_ranks", []):
            ray.kill(rank, no_restart=True)
        if not keep_handles:
            self._ranks = []

    def refit_metrics(self) -> dict[str, float]:
        """The last `state_dict` gather: the bytes gathered (a tied tensor once), its seconds and buckets."""
        return dict(self._refit)

    def close(self) -> None:
        """Kill the ranks (no process stays behind); ends Ray when this trainer started it."""
        import ray  # lazy: ray loads only when Ray is used, not by importing this module

        self._kill_ranks()
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


class _CheckpointOptimizer:
    """`trainer.optimizer`: the full AdamW state in torch's own layout, parameters numbered in `named_parameters()`
    order, as the in-process trainer's optimizer saves it; so a checkpoint of one process resumes onto ranks."""

    def __init__(self, trainer: DistributedTrainer) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self._trainer
        full = t._call([(rank.optimizer_state, ()) for rank in t._ranks])[0]
        names = t._param_names
        (hyper,) = full["param_groups"]
        return {
            "state": {i: full["state"][name] for i, name in enumerate(names) if name in full["state"]},
            "param_groups": [{**hyper, "params": list(range(len(names)))}],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import ray  # lazy: ray loads only when Ray is used, not by importing this module

        t = self._trainer
        names = t._param_names
        (group,) = state["param_groups"]
        if len(group["params"]) != len(names):
            raise ConfigError(f"the checkpoint's optimizer state has {len(group['params'])} parameters, "
                              f"the model {len(names)}")
        full = {"state": {names[int(i)]: value for i, value in state["state"].items()},
                "param_groups": [{k: v for k, v in group.items() if k != "params"}]}
        ref = ray.put(full)
        t._call([(rank.load_optimizer_state, (ref,)) for rank in t._ranks])


def rank_spec(cfg: Any, model_path: str | Path, reference_path: str | Path | None, pad_token_id: int,
              adapter_dir: str | Path | None = None) -> RankSpec:
    """The `RankSpec` of a GRPO config (`cfg`: a GRPOConfig); `adapter_dir`: a LoRA checkpoint's `policy/`."""
    trainer = cfg.trainer
    wrap = WrapSettings(mixed_precision=trainer.mixed_precision, activation_checkpointing=trainer.activation_checkpointing,
                        cpu_offload=trainer.cpu_offload, replicate=trainer.sharding == "none")
    return RankSpec(
        model_path=str(model_path), reference_path=str(reference_path) if reference_path is not None else None,
        dtype=cfg.policy.dtype, device=str(cfg.policy.device), optimizer=cfg.optimizer,
        loss=cfg.loss.to_loss_config(cfg.policy.generation.max_new_tokens), temperature=cfg.policy.generation.temperature, pad_token_id=pad_token_id,
        wrap=wrap, lora=trainer.lora, adapter_dir=str(adapter_dir) if adapter_dir is not None else None,
        init_seed=cfg.grpo.seed, distillation=distillation_loss(getattr(cfg, "on_policy_distillation", None)),
    )


__all__ = ["DistributedTrainer", "TrainerWorkerError", "check_trainer_resources", "rank_spec"]
