"""The eval's planning step: which configs run into which stores, and what a store still needs (resume).

    jobs = job_configs(cfg)                    # eval.shard / eval.seeds: one config per (seed, shard) job
    groups = group_configs(cfg)                # a Ray eval: one config per seed, its prompts leased
    plan = plan_store(opened)                  # a store: the groups still to roll out, what is on disk

A store's plan comes from its lines alone: a prompt with a sample that has no line, or only error lines, is
rolled out again; the others are skipped. The Ray path plans its queue from every worker store (ray_stores.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.shards import ShardRecord, ShardSpec, store_root
from nemo_rl_ext.evals.store_setup import OpenStore

__all__ = ["StorePlan", "group_configs", "job_config", "job_configs", "job_root", "plan_store", "shard_record"]


def _with_seed(cfg: EvalConfig, seed: int) -> EvalConfig:
    """`cfg` with `policy.generation.seed` set to `seed`."""
    gen = cfg.policy.generation.model_copy(update={"seed": seed})
    return cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"generation": gen})})


def job_config(cfg: EvalConfig, seed_index: int | None, shard: ShardSpec) -> EvalConfig:
    """The config of one job: `eval.shard`, and with `eval.seeds` its `seed_index` and that seed as
    `policy.generation.seed` (what the job's config.yaml records and its resume compares)."""
    job = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"shard": shard.text, "seed_index": seed_index})})
    if seed_index is not None and cfg.eval.seeds is not None:
        job = _with_seed(job, cfg.eval.seeds[seed_index])
    return job


def job_configs(cfg: EvalConfig) -> list[EvalConfig]:
    """The jobs one invocation runs: the selected seed (`eval.seed_index`) or every seed, each as shard
    `eval.shard` (default 0/1)."""
    shard = cfg.eval.shard_spec or ShardSpec(0, 1)
    seeds = cfg.eval.seeds
    if seeds is None:
        return [job_config(cfg, None, shard)]
    indices = [cfg.eval.seed_index] if cfg.eval.seed_index is not None else range(len(seeds))
    return [job_config(cfg, i, shard) for i in indices]


def job_root(cfg: EvalConfig) -> Path:
    """The store of a job config (`job_config`)."""
    seeds, index, shard = cfg.eval.seeds, cfg.eval.seed_index, cfg.eval.shard_spec
    assert shard is not None, "not a job config"
    return store_root(Path(cfg.eval.save_path), None if seeds is None or index is None else seeds[index], shard)


def group_configs(cfg: EvalConfig) -> list[tuple[int | None, EvalConfig]]:
    """(seed, config) of each group a Ray eval's queue covers: the run, or one per `eval.seeds` (that seed as
    `policy.generation.seed`, the identity the merge checks)."""
    if cfg.eval.seeds is None:
        return [(None, cfg)]
    return [(seed, _with_seed(cfg, seed)) for seed in cfg.eval.seeds]


def shard_record(cfg: EvalConfig, num_rows: int, expected: dict[int, int], finished: bool) -> ShardRecord:
    """The shard.json of a job's store."""
    return ShardRecord(
        shard=cfg.eval.shard,
        seed=cfg.policy.generation.seed if cfg.eval.seeds is not None else None,
        num_prompts=num_rows,
        samples=expected,
        finished=finished,
    )


@dataclass(frozen=True)
class StorePlan:
    """What an opened store still needs (`plan_store`)."""

    todo: list[DatumSpec]
    """The prompts with a sample that has no result yet (no line, or only error lines), in dataset order."""
    skipped: int
    """(prompt, sample) pairs whose result is on disk: not rolled out again."""
    retried: int
    """(prompt, sample) pairs whose latest line is an error: rolled out again."""

    def resume_note(self, where: Path) -> str | None:
        """What a resume says (None when the store held nothing)."""
        if not (self.skipped or self.retried):
            return None
        return (f"resume: {self.skipped} completion(s) already in {where}, {self.retried} error sample(s) to retry; "
                f"{len(self.todo)} group(s) to go")


def plan_store(opened: OpenStore) -> StorePlan:
    """The plan of an opened store, from the lines it holds."""
    store, expected = opened.store, opened.expected
    done = {d.idx: len(store.done(d.idx, expected[d.idx])) for d in opened.datums}
    return StorePlan(
        todo=[d for d in opened.datums if done[d.idx] < expected[d.idx]],
        skipped=sum(done.values()),
        retried=sum(len(store.failed(d.idx, expected[d.idx])) for d in opened.datums),
    )
