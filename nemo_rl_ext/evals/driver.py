"""The eval driver: rows -> `RolloutManager` -> `PromptGroupRecord`s -> completions JSONL -> summary + report.

    result = run_eval(load_config("examples/configs/evals/eval.yaml", [], EvalConfig))
    result.summary["metrics"]["pass@1"]

The driver has no generation loop of its own: `store_setup.open_store` (`experience.build.build_rollouts` on
the `rollouts` section) builds the datums and the manager, and every group comes from
`manager.stream_rollouts`, as GRPO's do. Nothing here branches on the rollout mode: what differs (nemo_gym's rows
sent and Gym's own aggregate) the manager answers for.
Groups are written as they finish (see `store.py`); re-running with the same `save_path` rolls out only
the groups with missing or errored samples, and the summary is always computed from the file, so a
resumed run reports exactly what an uninterrupted one does (rollouts are seeded per prompt, sample and
turn from `policy.generation.seed`; with `seed: null` a resumed group's samples are fresh draws instead).

Error completions (a dead server, a failed generation, an environment that raised) are recorded but are
not answers: the metrics use the other samples, the summary counts them (`num_errors`, `status`), and a
re-run rolls them out again. `summary["status"]` is "errors_left" when more than `eval.max_error_rate` of
the samples ended as errors (the CLI then exits 3).

With `eval.shard` or `eval.seeds` the run is split into jobs (shards.py): each job is this same loop over its
slice of the datums (dataset indices kept) into its own store, and the last job to finish merges (merge.py).
With `eval.ray_workers` Ray workers pull the prompts from a shared queue instead, each into its own store, and
this process merges (ray_shards.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from nemo_rl_ext.data.records import DatumSpec, PromptGroupRecord
from nemo_rl_ext.evals import gym_eval
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.runs import RunRecord, append_line
from nemo_rl_ext.evals.shards import ShardRecord, ShardSpec, store_root
from nemo_rl_ext.evals.store import CompletionStore, EvalPaths, dumps
from nemo_rl_ext.evals.store_setup import build_rollout_setup, check_store, load_rows, open_store
from nemo_rl_ext.evals.summary import EvalSummary, summarize
from nemo_rl_ext.evals.timings import append_timings
from nemo_rl_ext.experience.build import build_policy
from nemo_rl_ext.experience.rollout_manager import RolloutManager, batch_metrics
from nemo_rl_ext.models.generation.interfaces import GenerationInterface

__all__ = ["EvalResult", "build_rollout_setup", "load_rows", "run_eval", "run_eval_async"]


@dataclass(frozen=True)
class EvalResult:
    """What one `run_eval` call did and found."""

    paths: EvalPaths
    """The output files."""
    complete: bool
    """True when every (prompt, sample) has a result or an error line (then `summary` is set and written)."""
    summary: EvalSummary | None
    """The summary (also in summary.json), or None when the run stopped early."""
    groups_generated: int
    """Groups rolled out by this call (resumed groups already complete are not counted)."""
    completions_written: int
    """Lines this call appended (error lines included)."""
    skipped_completions: int
    """(prompt, sample) pairs whose result was found on disk and not generated again."""
    wall_time_s: float
    """Wall time of this call."""
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    """The manager's metrics over this call's groups (empty when nothing was generated)."""
    errors_written: int = 0
    """Error lines this call appended (infrastructure failures recorded, to be retried)."""
    retried: int = 0
    """(prompt, sample) pairs whose latest line was an error when this call started (rolled out again)."""
    waiting_for: tuple[str, ...] = ()
    """Jobs of a sharded or seeded run: the stores not finished yet (so nothing was merged); empty otherwise."""

    @property
    def errors_left(self) -> bool:
        """True when the run finished with more errors than `eval.max_error_rate` allows."""
        return self.summary is not None and self.summary.status == "errors_left"


def run_eval(
    cfg: EvalConfig,
    *,
    generation: GenerationInterface | None = None,
    progress: bool = True,
    stop_after_groups: int | None = None,
) -> EvalResult:
    """Run (or resume) the eval of `cfg`; writes config, completions, summary and report to `eval.save_path`.

    `generation`: a backend to use (not shut down here); None builds `cfg.policy`'s. `stop_after_groups`
    (tests): stop once this many groups are written, as if the run had been killed there.
    With `eval.ray_workers` the run goes to Ray workers that build their own engines (ray_shards.py).
    """
    if cfg.eval.on_ray:
        return _on_ray(cfg, generation, progress, stop_after_groups)
    return asyncio.run(
        run_eval_async(cfg, generation=generation, progress=progress, stop_after_groups=stop_after_groups)
    )


async def run_eval_async(
    cfg: EvalConfig,
    *,
    generation: GenerationInterface | None = None,
    progress: bool = True,
    stop_after_groups: int | None = None,
) -> EvalResult:
    """`run_eval` inside a running event loop."""
    if cfg.eval.on_ray:
        return await asyncio.to_thread(_on_ray, cfg, generation, progress, stop_after_groups)
    if cfg.eval.is_job:
        return await run_jobs_async(
            cfg, generation=generation, progress=progress, stop_after_groups=stop_after_groups
        )
    return await run_store_async(
        cfg, Path(cfg.eval.save_path), generation=generation, progress=progress, stop_after_groups=stop_after_groups
    )


async def run_store_async(
    cfg: EvalConfig,
    root: Path,
    *,
    generation: GenerationInterface | None = None,
    progress: bool = True,
    stop_after_groups: int | None = None,
) -> EvalResult:
    """Run (or resume) the eval of `cfg` into the store `root`: the whole run's folder, or one job's
    (`cfg.eval.shard` set: only the prompts the shard owns, a shard.json beside them, no summary)."""
    start = time.perf_counter()
    shard = cfg.eval.shard_spec
    checked = check_store(cfg, root)  # before the engine is built: a changed config or dataset fails fast
    paths, store = checked.paths, checked.store
    own_generation = generation is None
    gen = build_policy(cfg.policy)[1] if generation is None else generation
    manager = None
    try:
        opened = await open_store(checked, gen, shard=shard)
        datums, expected, manager, gym_logs = opened.datums, opened.expected, opened.manager, opened.gym_logs
        if shard is not None:
            shard_record(cfg, len(checked.rows), expected, finished=False).write(paths.root)
        todo = [d for d in datums if len(store.done(d.idx, expected[d.idx])) < expected[d.idx]]
        skipped = sum(len(store.done(d.idx, expected[d.idx])) for d in datums)
        retried = sum(len(store.failed(d.idx, expected[d.idx])) for d in datums)
        if todo:
            for stale in (paths.summary, paths.root / gym_eval.AGGREGATE_FILE):
                stale.unlink(missing_ok=True)  # stale until the missing groups are on disk
        if skipped or retried:
            print(
                f"resume: {skipped} completion(s) already in {paths.completions}, {retried} error sample(s) "
                f"to retry; {len(todo)} group(s) to go"
            )
        records, written, errors_written = await _roll_out(
            manager,
            todo,
            expected,
            store,
            cfg.eval.save_token_ids,
            cfg.eval.max_concurrent_prompts,
            progress,
            stop_after_groups,
            f"eval {cfg.rollouts.mode_name}",
        )
        if all(store.line(d.idx, s) is not None for d in datums for s in range(expected[d.idx])):
            await gym_eval.aggregate_metrics(  # nemo_gym, while Gym is up: its own per-agent aggregate
                manager, datums, expected, store, paths.root, reuse=not records
            )
    finally:
        try:
            if manager is not None:  # the policy server and Gym (nemo_gym), or the environment it built
                await manager.shutdown()
        finally:
            if own_generation:
                gen.shutdown()
    wall = time.perf_counter() - start
    metrics = batch_metrics(records, wall) if records else {}
    append_line(paths.runs, RunRecord(len(records), written, errors_written, retried, skipped, wall, metrics).to_json())
    missing = [idx for idx, n in expected.items() if any(store.line(idx, s) is None for s in range(n))]
    if missing and stop_after_groups is None:
        raise RuntimeError(
            f"the rollouts returned fewer completions than num_generations_per_prompt for prompts {missing[:20]}"
        )
    complete = not missing and len(records) == len(todo)
    summary = None
    if shard is not None:  # a job's store: the summary comes from the merge of every job's store
        shard_record(cfg, len(checked.rows), expected, finished=complete).write(paths.root)
    elif complete:
        summary = summarize(cfg, datums, expected, store)
        gym_metrics = gym_eval.summary_metrics(paths.root)  # None but in nemo_gym mode
        if gym_metrics is not None:  # group_level_metrics (per task) stay in gym_aggregate_metrics.json
            summary = dataclasses.replace(summary, gym_metrics=gym_metrics)
        if gym_logs is not None:  # where the Gym servers' logs are (in the eval folder unless configured)
            where = gym_logs.relative_to(paths.root) if gym_logs.is_relative_to(paths.root) else gym_logs
            summary = dataclasses.replace(summary, gym_logs=str(where))
        paths.summary.write_bytes(dumps(summary.to_json(), indent=True) + b"\n")
        from nemo_rl_ext.evals.report import warn_prompt_length, write_report

        write_report(summary, paths)
        warn_prompt_length(summary)
    return EvalResult(
        paths, complete, summary, len(records), written, skipped, wall, metrics, errors_written, retried
    )


def _on_ray(
    cfg: EvalConfig, generation: GenerationInterface | None, progress: bool, stop_after_groups: int | None
) -> EvalResult:
    """`run_eval` with `eval.ray_workers`: each worker builds its own engine, so none may be handed in."""
    if generation is not None or stop_after_groups is not None:
        raise ValueError("with eval.ray_workers each Ray worker builds its own engine from `policy`: pass no "
                         "generation (and no stop_after_groups); see evals/ray_shards.run_ray_eval")
    from nemo_rl_ext.evals.ray_shards import run_ray_eval

    return run_ray_eval(cfg, progress=progress)


def job_config(cfg: EvalConfig, seed_index: int | None, shard: ShardSpec) -> EvalConfig:
    """The config of one job: `eval.shard`, and with `eval.seeds` its `seed_index` and that seed as
    `policy.generation.seed` (what the job's config.yaml records and its resume compares)."""
    ev = {"shard": shard.text, "seed_index": seed_index}
    policy = cfg.policy
    if seed_index is not None and cfg.eval.seeds is not None:
        gen = policy.generation.model_copy(update={"seed": cfg.eval.seeds[seed_index]})
        policy = policy.model_copy(update={"generation": gen})
    return cfg.model_copy(update={"eval": cfg.eval.model_copy(update=ev), "policy": policy})


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


async def run_jobs_async(
    cfg: EvalConfig,
    *,
    generation: GenerationInterface | None = None,
    progress: bool = True,
    stop_after_groups: int | None = None,
) -> EvalResult:
    """Run the jobs `cfg` selects one after another on one backend, then merge when every job of the run
    has finished (under a lock: jobs finishing at once merge one after the other, to the same files).

    The result's `summary` is the merged one (None while other jobs are still running: `waiting_for`)."""
    from nemo_rl_ext.evals.merge import merge_run, unfinished_jobs

    start = time.perf_counter()
    jobs = job_configs(cfg)
    own_generation = generation is None
    gen = build_policy(jobs[0].policy)[1] if generation is None else generation
    results = []
    try:
        for job in jobs:
            if len(jobs) > 1:
                print(f"job {job_root(job).relative_to(cfg.eval.save_path)}")
            results.append(
                await run_store_async(
                    job, job_root(job), generation=gen, progress=progress, stop_after_groups=stop_after_groups
                )
            )
            if not results[-1].complete:
                break
    finally:
        if own_generation:
            gen.shutdown()
    root = Path(cfg.eval.save_path)
    complete = len(results) == len(jobs) and all(r.complete for r in results)
    waiting = tuple(unfinished_jobs(root, cfg)) if complete else ()
    summary = merge_run(root).summary if complete and not waiting else None
    return EvalResult(
        paths=EvalPaths(root),
        complete=complete,
        summary=summary,
        groups_generated=sum(r.groups_generated for r in results),
        completions_written=sum(r.completions_written for r in results),
        skipped_completions=sum(r.skipped_completions for r in results),
        wall_time_s=time.perf_counter() - start,
        rollout_metrics=results[-1].rollout_metrics if len(results) == 1 else {},
        errors_written=sum(r.errors_written for r in results),
        retried=sum(r.retried for r in results),
        waiting_for=waiting,
    )


def shard_record(cfg: EvalConfig, num_rows: int, expected: dict[int, int], finished: bool) -> ShardRecord:
    """The shard.json of a job's store."""
    return ShardRecord(
        shard=cfg.eval.shard,
        seed=cfg.policy.generation.seed if cfg.eval.seeds is not None else None,
        num_prompts=num_rows,
        samples=expected,
        finished=finished,
    )


async def _roll_out(
    manager: RolloutManager,
    todo: Sequence[DatumSpec],
    expected: dict[int, int],
    store: CompletionStore,
    save_token_ids: bool,
    max_concurrent: int | None,
    progress: bool,
    stop_after_groups: int | None,
    desc: str,
    skip: Mapping[int, Collection[int]] | None = None,
) -> tuple[list[PromptGroupRecord], int, int]:
    """Roll out `todo` through `manager.stream_rollouts`, appending each group's samples that have no result
    yet (missing or errored before) as soon as the group is done; returns the records, lines written, error
    lines written. `skip`: prompt -> samples not to append (results another store holds)."""
    records: list[PromptGroupRecord] = []
    written = errors = 0
    bar = tqdm(total=len(todo), desc=desc, unit="prompt", disable=not progress)
    stream = manager.stream_rollouts(todo, max_concurrent_prompts=max_concurrent)
    try:
        async with contextlib.aclosing(stream):
            async for record in stream:
                have = store.done(record.prompt_idx, expected[record.prompt_idx])
                have |= set((skip or {}).get(record.prompt_idx, ()))
                lines = [
                    CompletionLine.from_completion(record, i, c, save_token_ids)
                    for i, c in enumerate(record.completions)
                    if i not in have
                ]
                written += store.append(lines)
                append_timings(store.path.parent, record, skip=have)  # timings.jsonl: not in the lines
                errors += sum(x.is_error for x in lines)
                records.append(record)
                bar.update(1)
                if stop_after_groups is not None and len(records) >= stop_after_groups:
                    break
    finally:
        bar.close()
    return records, written, errors
