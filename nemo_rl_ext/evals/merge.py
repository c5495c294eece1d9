"""The merge of a sharded (and/or seeded) eval: every job's store -> one sorted completions.jsonl per group,
then summary.json and report.md computed from those merged completions only.

    result = merge_run(Path("results/evals/eval"))      # run_eval.py merge DIR; the last job calls it too

A group is the run (no `eval.seeds`) or one seed; its stores are `<group>/shards/*/` (shards.py). The merge
refuses, in one ConfigError listing every problem: a missing static shard, a store that has not finished, a
store whose config differs from the others (apart from `merge_checks.MERGE_MAY_DIFFER`) or whose dataset rows differ, a
store without its config.yaml or dataset_fingerprint.json (which those checks need), and a (prompt, sample)
pair held by two stores with different lines. The union is keyed by (prompt_idx, sample_idx): each store
contributes its result for a pair (else its latest error line), so a prompt's samples may come from several
stores (a Ray worker that retries a prompt's error samples appends only those); a pair held by several stores
must have byte-identical results (an error line gives way to a result). Each merged line's latency comes from
the timings.jsonl of the store the line is taken from. The merged
completions.jsonl is sorted by (prompt_idx, sample_idx), so any split of the prompts over any number of
stores merges to the same bytes when sampling is seeded (`policy.generation.seed`).

With `eval.seeds`, each seed's merged folder (`seeds/<seed>/`) has its own summary (the ks up to one seed's
sample count), and the run folder gets the pooled summary, as NeMo-Skills reports seeds: each prompt's samples
pooled over the seeds (seed j's sample s is pooled sample j * n + s), so pass@k / maj@k go up to k = n x seeds,
plus `seeds/<seed>/pass@1` and their mean and standard deviation, `seeds/pass@1/mean` and `seeds/pass@1/std`.
Gym's own `/aggregate_metrics` needs a live Gym, so a merged summary has no `gym_metrics` (each nemo_gym
store keeps its own gym_aggregate_metrics.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nemo_rl_ext.config import ConfigError, dump_config, raise_problems
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.merge_checks import MAX_LISTED, JobStore, find_stores, read_store, run_problems
from nemo_rl_ext.evals.report import warn_prompt_length, write_report
from nemo_rl_ext.evals.shards import ShardRecord, ShardSpec, group_root, store_root
from nemo_rl_ext.evals.store import CompletionStore, EvalPaths, dumps
from nemo_rl_ext.evals.summary import EvalSummary, summarize
from nemo_rl_ext.evals.timings import TIMINGS_FILE, read_timings

MERGE_FILE = "merge.json"
"""What a group's merge read: the stores and the line count (also marks a folder the merge owns)."""

LOCK_FILE = ".merge.lock"
"""Taken (flock) by a merge in the run folder, so that jobs finishing at once merge one after the other."""

LOCK_TIMEOUT_S = 600.0
"""How long a merge waits for another merge of the same folder to finish."""

@dataclass(frozen=True)
class MergeResult:
    """What `merge_run` wrote."""

    root: Path
    """The run folder."""
    summary: EvalSummary
    """The run's summary (pooled over the seeds with `eval.seeds`), also in `<root>/summary.json`."""
    seed_summaries: Mapping[int, EvalSummary]
    """With `eval.seeds`: each seed's summary (in `<root>/seeds/<seed>/summary.json`); empty otherwise."""
    stores: tuple[str, ...]
    """The stores merged, relative to the run folder."""


# ---- the union of one group -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MergedLine:
    """One line of a group's merged completions.jsonl, as read from the store it is taken from."""

    line: CompletionLine
    """The line."""
    raw: bytes
    """Its bytes in that store (without the newline): copied as they are."""
    source: JobStore
    """The store it is taken from (its timings.jsonl has the line's latency)."""


def union_lines(
    jobs: Sequence[JobStore], num_prompts: int, group: str = ""
) -> tuple[list[MergedLine], dict[int, int], list[str]]:
    """The group's lines sorted by (prompt_idx, sample_idx), each prompt's sample count, and the problems: a
    pair whose results differ between two stores (both files named), counts that disagree, prompts of the
    selection that no store covers, pairs no store has a line of. A prompt's samples may come from several
    stores (a retry appends only the samples no store has a result of)."""
    expected: dict[int, int] = {}
    problems: list[str] = []
    for job in jobs:
        for p, n in (job.record.samples.items() if job.record is not None else ()):
            if expected.setdefault(p, n) != n:
                problems.append(f"prompt {p}: {job.name}/shard.json wants {n} samples, another store {expected[p]}")
    chosen: dict[tuple[int, int], tuple[CompletionLine, bytes, JobStore]] = {}
    conflicts: list[str] = []
    for job in jobs:
        if job.store is None:
            continue
        for key in job.store.keys():
            line, raw = job.store.line(*key), job.store.line_bytes[key]
            assert line is not None
            if key not in chosen or (chosen[key][0].is_error and not line.is_error):
                chosen[key] = (line, raw, job)
            elif not line.is_error and raw != chosen[key][1]:
                other = chosen[key][2]
                conflicts.append(
                    f"prompt {key[0]} sample {key[1]}: {other.root / 'completions.jsonl'} and "
                    f"{job.root / 'completions.jsonl'} hold different lines (a duplicate must be byte-identical)"
                )
    problems += conflicts[:MAX_LISTED] + ([f"... and {len(conflicts) - MAX_LISTED} more differing pairs"]
                                          if len(conflicts) > MAX_LISTED else [])
    uncovered = [p for p in range(num_prompts) if p not in expected]
    if uncovered:
        problems.append(f"{group}prompt(s) {uncovered[:MAX_LISTED]} ({len(uncovered)}) are in no store's shard.json")
    lacking = [(p, s) for p, n in sorted(expected.items()) for s in range(n) if (p, s) not in chosen]
    if lacking:
        problems.append(
            f"{group}{len(lacking)} (prompt, sample) pair(s) have no line in any store: {lacking[:MAX_LISTED]}"
        )
    lines = [MergedLine(*chosen[k]) for k in sorted(chosen) if k[0] in expected and k[1] < expected[k[0]]]
    return lines, expected, problems


# ---- writing ------------------------------------------------------------------------------------------------


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _merged_timings(lines: Sequence[MergedLine]) -> dict[tuple[int, int], float]:
    """The latency of each merged line, from the timings.jsonl of the store the line is taken from (a wall-clock
    time is a measurement, so stores need not agree; a line without an entry there has none)."""
    by_store: dict[Path, Mapping[tuple[int, int], float]] = {}
    merged: dict[tuple[int, int], float] = {}
    for m in lines:
        root = m.source.root
        if root not in by_store:
            by_store[root] = read_timings(root)
        pair = (m.line.prompt_idx, m.line.sample_idx)
        if pair in by_store[root]:
            merged[pair] = by_store[root][pair]
    return merged


def _datums(expected: Mapping[int, int]) -> list[DatumSpec]:
    """Placeholder datums for `summarize`, which reads only their `idx` (the merge loads no tokenizer)."""
    return [DatumSpec(idx=p, message_log=(), task_name="") for p in sorted(expected)]


def _without_job(cfg: EvalConfig) -> EvalConfig:
    """The config a group's merged folder records: the job's, without `eval.shard`."""
    return cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"shard": None})})


def write_group(
    folder: Path, cfg: EvalConfig, jobs: Sequence[JobStore], lines: Sequence[MergedLine],
    expected: Mapping[int, int], fingerprint: Path,
) -> EvalSummary:
    """Write a group's merged completions.jsonl (sorted), config.yaml, dataset_fingerprint.json, summary.json,
    report.md and plot; the summary is computed from the merged lines alone."""
    paths = EvalPaths(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(paths.completions, b"".join(m.raw + b"\n" for m in lines))
    _write_atomic(paths.config, dump_config(_without_job(cfg)).encode())
    if fingerprint.exists():
        _write_atomic(paths.dataset, fingerprint.read_bytes())
    store = CompletionStore(paths.completions, repair=False)  # read back: the summary is the file's
    timings = _merged_timings(lines)
    _write_atomic(folder / TIMINGS_FILE, b"".join(
        dumps({"prompt_idx": p, "sample_idx": s, "latency_s": v}) + b"\n" for (p, s), v in sorted(timings.items())
    ))
    summary = summarize(cfg, _datums(expected), expected, store, timings=timings)
    _write_atomic(paths.summary, dumps(summary.to_json(), indent=True) + b"\n")
    write_report(summary, paths)
    record = {"stores": [j.name for j in jobs], "num_prompts": len(expected), "num_completions": len(lines)}
    _write_atomic(folder / MERGE_FILE, dumps(record, indent=True) + b"\n")
    return summary


def pooled_config(cfg: EvalConfig, num_seeds: int) -> EvalConfig:
    """The config whose sample counts are `num_seeds` times a seed's: the pooled summary's ks and counts."""
    counts = cfg.rollouts.num_generations_per_prompt
    pooled = {k: v * num_seeds for k, v in counts.items()} if isinstance(counts, Mapping) else counts * num_seeds
    rollouts = cfg.rollouts.model_copy(update={"num_generations_per_prompt": pooled})
    return cfg.model_copy(update={"rollouts": rollouts})


def write_pooled(
    run_root: Path, cfg: EvalConfig, seeds: Sequence[int], per_seed: Mapping[int, EvalSummary],
    expected: Mapping[int, int],
) -> EvalSummary:
    """The run folder's summary with seeds: each prompt's samples pooled over the seeds' merged files."""
    pooled: list[CompletionLine] = []
    pooled_timings: dict[tuple[int, int], float] = {}
    for j, seed in enumerate(seeds):
        store = CompletionStore(EvalPaths(group_root(run_root, seed)).completions, repair=False)
        seed_timings = read_timings(group_root(run_root, seed))
        for p, s in store.keys():
            line = store.line(p, s)
            assert line is not None
            pooled.append(dataclasses.replace(line, sample_idx=j * expected[p] + s))
            if (p, s) in seed_timings:
                pooled_timings[(p, j * expected[p] + s)] = seed_timings[(p, s)]
    pcfg = pooled_config(cfg, len(seeds))
    pexpected = {p: n * len(seeds) for p, n in expected.items()}
    summary = summarize(pcfg, _datums(pexpected), pexpected, CompletionStore.of_lines(pooled), timings=pooled_timings)
    pass1 = {s: per_seed[s].metrics["pass@1"] for s in seeds if "pass@1" in per_seed[s].metrics}
    extra: dict[str, float] = {"seeds/num_seeds": float(len(seeds))}
    extra.update({f"seeds/{s}/pass@1": v for s, v in pass1.items()})
    if pass1:
        extra["seeds/pass@1/mean"] = statistics.mean(pass1.values())
        extra["seeds/pass@1/std"] = statistics.pstdev(pass1.values())
    summary = dataclasses.replace(summary, metrics={**summary.metrics, **extra})
    paths = EvalPaths(run_root)
    cfg_out = _without_job(cfg)
    cfg_out = cfg_out.model_copy(update={"eval": cfg_out.eval.model_copy(update={"seed_index": None})})
    _write_atomic(paths.config, dump_config(cfg_out).encode())
    _write_atomic(paths.summary, dumps(summary.to_json(), indent=True) + b"\n")
    write_report(summary, paths)
    table = ["", "## Seeds", "", "| seed | pass@1 | folder |", "|---|---|---|"]
    table += [f"| {s} | {pass1[s]:.3f} | seeds/{s}/ |" if s in pass1 else f"| {s} | - | seeds/{s}/ |" for s in seeds]
    if pass1:
        table.append(f"| mean ± std | {extra['seeds/pass@1/mean']:.3f} ± {extra['seeds/pass@1/std']:.3f} | |")
    with open(paths.report, "a") as f:
        f.write("\n".join(table) + "\n")
    return summary


# ---- the merge -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def merge_lock(run_root: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive flock on `<run_root>/.merge.lock` (waits up to `timeout_s` for another merge)."""
    run_root.mkdir(parents=True, exist_ok=True)
    with open(run_root / LOCK_FILE, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{run_root / LOCK_FILE}: another merge held it for {timeout_s:.0f} s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def merge_run(run_root: Path | str) -> MergeResult:
    """Merge every store of the run folder (module docstring); ConfigError listing every problem."""
    run_root = Path(run_root)
    if not run_root.is_dir():
        raise ConfigError(f"{run_root}: no such folder")
    with merge_lock(run_root):
        found = find_stores(run_root)
        if not found:
            raise ConfigError(
                f"{run_root}: no shard stores (expected {run_root}/shards/<I>-of-<N>/ or "
                f"{run_root}/seeds/<seed>/shards/<I>-of-<N>/, written by run_eval.py with eval.shard or eval.seeds)"
            )
        problems: list[str] = []
        jobs = []
        for seed, root in found:
            job, unreadable = read_store(run_root, seed, root)
            jobs.append(job)
            problems += unreadable
        problems += run_problems(run_root, jobs)
        top = EvalPaths(run_root)
        if top.summary.exists() and not (run_root / MERGE_FILE).exists():
            problems.append(f"{run_root} holds the outputs of an unsharded run; the merge would replace them "
                            "(use another eval.save_path for the sharded run)")
        raise_problems(problems, f"the stores in {run_root}")
        ref = next(j for j in jobs if j.cfg is not None)
        assert ref.cfg is not None and ref.record is not None
        seeds = ref.cfg.eval.seeds
        groups = list(seeds) if seeds is not None else [None]
        unions = {}
        for seed in groups:
            members = [j for j in jobs if j.seed == seed]
            label = "" if seed is None else f"seeds/{seed}: "
            unions[seed] = (members, *union_lines(members, ref.record.num_prompts, label))
            problems += unions[seed][3]
        raise_problems(problems, f"the stores in {run_root}")
        summaries: dict[int, EvalSummary] = {}
        summary = None
        for seed, (members, lines, expected, _) in unions.items():
            group_cfg = next(j.cfg for j in members if j.cfg is not None)
            assert group_cfg is not None
            summary = write_group(
                group_root(run_root, seed), group_cfg, members, lines, expected, members[0].root / "dataset_fingerprint.json"
            )
            if seed is not None:
                summaries[seed] = summary
        if seeds is not None:
            expected = unions[seeds[0]][2]
            summary = write_pooled(run_root, ref.cfg, seeds, summaries, expected)
            _write_atomic(run_root / MERGE_FILE, dumps({"seeds": list(seeds)}, indent=True) + b"\n")
        assert summary is not None
        warn_prompt_length(summary)
        return MergeResult(run_root, summary, summaries, tuple(j.name for j in jobs))


def unfinished_jobs(run_root: Path, cfg: EvalConfig) -> list[str]:
    """The stores of `cfg`'s run (every seed, every shard) whose shard.json does not say finished."""
    shard = cfg.eval.shard_spec or ShardSpec(0, 1)
    out = []
    for seed in cfg.eval.seeds if cfg.eval.seeds is not None else (None,):
        for i in range(shard.count):
            root = store_root(run_root, seed, ShardSpec(i, shard.count))
            record = ShardRecord.read(root)
            if record is None or not record.finished:
                out.append(str(root.relative_to(run_root)))
    return out

