"""The merge's reading and checking of a run's stores: each store as the merge reads it (`JobStore`), and why a
set of stores can't be merged (`run_problems`: missing or unfinished shards, differing configs or dataset rows).
The merge itself is merge.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
from omegaconf import OmegaConf

from nemo_rl_ext.config import ConfigError, config_changes
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.shards import ShardRecord, ShardSpec, store_root
from nemo_rl_ext.evals.store import RESUME_MAY_CHANGE, CompletionStore

__all__ = ["MAX_LISTED", "MERGE_MAY_DIFFER", "JobStore", "find_stores", "read_store", "run_problems"]

MERGE_MAY_DIFFER = (RESUME_MAY_CHANGE - {"eval.num_prompts"}) | {
    "eval.shard",
    "eval.seed_index",
    "eval.save_path",
    "policy.generation.seed",
}
"""Config keys in which the stores of one run may differ (the job's identity, and what changes no completion)."""

MAX_LISTED = 20
"""Pairs listed by name in one problem (all are counted)."""


@dataclass(frozen=True)
class JobStore:
    """One store found in the run folder, as the merge reads it."""

    root: Path
    """The store's folder."""
    name: str
    """The folder relative to the run folder (how problems name it)."""
    seed: int | None
    """The seed of its group (`seeds/<seed>/`), None in a run without seeds."""
    cfg: EvalConfig | None
    """Its config.yaml, validated (None: missing or unreadable)."""
    record: ShardRecord | None
    """Its shard.json (None: missing or unreadable, i.e. it has not started rolling out)."""
    row_digests: tuple[str, ...] | None
    """Its dataset_fingerprint.json's per-row hashes (None: missing or unreadable)."""
    store: CompletionStore | None
    """Its completions (read-only, with the line bytes); None when the file is missing or unreadable."""


# ---- finding and reading the stores --------------------------------------------------------------------


def find_stores(root: Path) -> list[tuple[int | None, Path]]:
    """(seed, folder) of every store in the run folder: `shards/*/` and `seeds/<seed>/shards/*/`."""
    found: list[tuple[int | None, Path]] = [(None, p) for p in sorted((root / "shards").glob("*")) if p.is_dir()]
    seed_dirs = [p for p in (root / "seeds").glob("*") if p.is_dir() and p.name.isdigit()]
    for seed_dir in sorted(seed_dirs, key=lambda p: int(p.name)):
        found += [(int(seed_dir.name), p) for p in sorted((seed_dir / "shards").glob("*")) if p.is_dir()]
    return found


def read_store(run_root: Path, seed: int | None, root: Path) -> tuple[JobStore, list[str]]:
    """The store in `root` and what is unreadable or missing in it (a store that has started rolling out, i.e.
    has a shard.json, must have its config.yaml and dataset_fingerprint.json: without them the merge could not
    check that it ran the same config on the same rows)."""
    name = str(root.relative_to(run_root))
    problems: list[str] = []
    record = ShardRecord.read(root)
    cfg = None
    config = root / "config.yaml"
    if config.exists():
        try:
            cfg = EvalConfig.model_validate(OmegaConf.to_container(OmegaConf.load(config), resolve=True))
        except Exception as exc:  # a hand-edited or foreign file: named, not a traceback
            problems.append(f"{name}/config.yaml: unreadable ({type(exc).__name__}: {str(exc)[:300]})")
    elif record is not None:
        problems.append(f"{name}: no config.yaml (so its config can't be compared with the other stores'; "
                        "restore the file, or re-run its job into a new store)")
    digests = None
    fingerprint = root / "dataset_fingerprint.json"
    if fingerprint.exists():
        try:
            digests = tuple(orjson.loads(fingerprint.read_bytes())["row_sha256"])
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            problems.append(f"{name}/dataset_fingerprint.json: unreadable ({type(exc).__name__}: {exc})")
    elif record is not None:
        problems.append(f"{name}: no dataset_fingerprint.json (so its dataset rows can't be compared with the "
                        "other stores'; restore the file, or re-run its job into a new store)")
    store = None
    try:
        store = CompletionStore(root / "completions.jsonl", repair=False, keep_bytes=True)
    except ConfigError as exc:
        problems.append(str(exc))
    return JobStore(root, name, seed, cfg, record, digests, store), problems


def _rerun_hint(job: JobStore) -> str:
    """The overrides that run this store's job again."""
    cfg = job.cfg
    if cfg is None or cfg.eval.shard is None:
        return "re-run its job"
    hint = f"eval.shard={cfg.eval.shard}"
    if cfg.eval.seed_index is not None:
        hint += f" eval.seed_index={cfg.eval.seed_index}"
    return f"re-run it with {hint}"


def run_problems(run_root: Path, jobs: Sequence[JobStore]) -> list[str]:
    """Why `jobs` can't be merged: missing or unfinished shards, differing configs or dataset rows."""
    with_cfg = [j for j in jobs if j.cfg is not None]
    if not with_cfg:
        return [f"{run_root}: no store has a readable config.yaml; nothing to merge"]
    ref = with_cfg[0]
    return [
        *_config_problems(ref, with_cfg),
        *_missing_shards(run_root, ref, jobs),
        *_unfinished_shards(ref, jobs),
        *_row_problems(ref, jobs),
    ]


def _config_problems(ref: JobStore, with_cfg: Sequence[JobStore]) -> list[str]:
    """Stores whose config differs from `ref`'s (but for `MERGE_MAY_DIFFER`), or whose seed or shard is not
    the one their folder says."""
    assert ref.cfg is not None
    problems: list[str] = []
    ref_dump = ref.cfg.model_dump(mode="json")
    for job in with_cfg[1:]:
        assert job.cfg is not None
        changed = config_changes(ref_dump, job.cfg.model_dump(mode="json"), MERGE_MAY_DIFFER, ref.cfg.key_as_written)
        if changed:
            problems.append(f"config of {job.name} differs from {ref.name}: " + "; ".join(changed))
    for job in with_cfg:
        assert job.cfg is not None
        own_seed = None if job.cfg.eval.seeds is None else job.cfg.policy.generation.seed
        if job.seed != own_seed:
            problems.append(f"{job.name}: holds the job of seed {own_seed}, not of its folder's seed {job.seed}")
        spec = ShardSpec.from_name(job.root.name)
        if spec is not None and job.cfg.eval.shard != spec.text:
            problems.append(f"{job.name}: holds shard {job.cfg.eval.shard}, not the {spec.text} of its folder name")
    return problems


def _missing_shards(run_root: Path, ref: JobStore, jobs: Sequence[JobStore]) -> list[str]:
    """The static shards of `ref`'s run (every seed) that have no store."""
    assert ref.cfg is not None
    seeds = ref.cfg.eval.seeds
    shard = ref.cfg.eval.shard_spec  # None: stores filled by a dynamic assignment (no static shard to miss)
    problems: list[str] = []
    present = {(j.seed, j.root.name) for j in jobs}
    for seed in seeds if seeds is not None else (None,):
        for i in range(shard.count if shard is not None else 0):
            spec = ShardSpec(i, shard.count if shard is not None else 1)
            if (seed, spec.name) not in present:
                hint = f"eval.shard={spec.text}" + (f" eval.seed_index={seeds.index(seed)}" if seeds else "")
                name = store_root(run_root, seed, spec).relative_to(run_root)
                problems.append(f"missing shard: {name} (not started; run it with {hint})")
    return problems


def _unfinished_shards(ref: JobStore, jobs: Sequence[JobStore]) -> list[str]:
    """Stores of another shard count than `ref`'s run, and stores that have not started or not finished."""
    assert ref.cfg is not None
    shard = ref.cfg.eval.shard_spec
    problems: list[str] = []
    for job in jobs:
        spec = ShardSpec.from_name(job.root.name)
        if spec is not None and shard is not None and spec.count != shard.count:
            problems.append(f"{job.name}: a shard of {spec.count}, but this run has {shard.count} shards")
        elif job.record is None:
            problems.append(f"incomplete shard: {job.name} (no shard.json: it has not started rolling out; "
                            f"{_rerun_hint(job)})")
        elif not job.record.finished:
            done = sum(
                job.store is not None and len(job.store.done(p, n)) + len(job.store.failed(p, n)) == n
                for p, n in job.record.samples.items()
            )
            problems.append(f"incomplete shard: {job.name} ({done} of {len(job.record.samples)} prompts have every "
                            f"sample; {_rerun_hint(job)})")
    return problems


def _row_problems(ref: JobStore, jobs: Sequence[JobStore]) -> list[str]:
    """Stores that evaluate another number of prompts than `ref`, or other dataset rows than the first store
    with a fingerprint."""
    problems: list[str] = []
    num_prompts = {j.name: j.record.num_prompts for j in jobs if j.record is not None}
    ref_rows = ref.record.num_prompts if ref.record is not None else None
    for name, n in num_prompts.items():
        if ref_rows is not None and n != ref_rows:
            problems.append(f"{name} evaluates {n} prompts, {ref.name} {ref_rows}")
    rows_ref = next((j for j in jobs if j.row_digests is not None), None)  # a store without one is named above
    if rows_ref is not None and rows_ref.row_digests is not None and ref_rows is not None:
        for job in jobs:
            if job.row_digests is None or job is rows_ref:
                continue
            pairs = zip(rows_ref.row_digests[:ref_rows], job.row_digests, strict=False)
            changed = [i for i, (a, b) in enumerate(pairs) if a != b]
            if changed:
                problems.append(f"dataset fingerprint of {job.name} differs from {rows_ref.name}: "
                                f"{len(changed)} row(s) differ (rows {changed[:MAX_LISTED]})")
    return problems
