"""One store's eval in this process, as a pipeline: plan -> roll out -> store -> summarise -> report.

    result = await run_store_async(cfg, Path(cfg.eval.save_path))

1. plan: `store_setup.check_store` (a changed config or dataset fails before the engine is built), then
   `store_setup.open_store` (datums, manager, the shard's own prompts) and `plan.plan_store` (what the lines on
   disk leave to do);
2. roll out: `rollout.roll_out`, appending each group to the store as it finishes; in nemo_gym mode Gym's own
   aggregate is asked for while Gym is up (`gym_eval.aggregate_metrics`);
3. store: the run's line in runs.jsonl (`runs.RunRecord`), a shard job's shard.json;
4. summarise: `summary.summarize` over the lines on disk (the Gym aggregate and log folder added);
5. report: summary.json, report.md and its plots (`report.write_report`).

A shard job's store (`eval.shard` set) holds only the prompts the shard owns and gets no summary: the merge of
every job's store summarises (merge.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

from nemo_rl_ext.evals import gym_eval
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.plan import StorePlan, plan_store, shard_record
from nemo_rl_ext.evals.report import warn_prompt_length, write_report
from nemo_rl_ext.evals.result import EvalResult
from nemo_rl_ext.evals.rollout import RolledOut, roll_out
from nemo_rl_ext.evals.runs import RunRecord, append_line
from nemo_rl_ext.evals.store import dumps
from nemo_rl_ext.evals.store_setup import OpenStore, check_store, open_store
from nemo_rl_ext.evals.summary import EvalSummary, summarize
from nemo_rl_ext.experience.build import build_policy
from nemo_rl_ext.experience.rollout_manager import batch_metrics
from nemo_rl_ext.models.generation.interfaces import GenerationInterface

__all__ = ["generation_for", "run_store_async"]


@contextlib.asynccontextmanager
async def generation_for(cfg: EvalConfig, generation: GenerationInterface | None) -> AsyncIterator[GenerationInterface]:
    """`generation`, or `cfg.policy`'s engine built here and shut down on exit."""
    if generation is not None:
        yield generation
        return
    built = build_policy(cfg.policy)[1]
    try:
        yield built
    finally:
        built.shutdown()


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
    checked = check_store(cfg, root)  # before the engine is built: a changed config or dataset fails fast
    async with generation_for(cfg, generation) as gen:
        opened = await open_store(checked, gen, shard=cfg.eval.shard_spec)
        try:
            plan = _plan(cfg, opened)
            rolled = await roll_out(
                opened.manager, plan.todo, expected=opened.expected, store=opened.store,
                save_token_ids=cfg.eval.save_token_ids, max_concurrent_prompts=cfg.eval.max_concurrent_prompts,
                progress=progress, stop_after_groups=stop_after_groups, desc=f"eval {cfg.rollouts.mode_name}",
            )
            await _gym_aggregate(opened, rolled)
        finally:
            await opened.manager.shutdown()  # the policy server and Gym (nemo_gym), or the environment it built
    wall = time.perf_counter() - start
    metrics = _store_run(opened, plan, rolled, wall)
    complete = _complete(opened, plan, rolled, stopped_early=stop_after_groups is not None)
    summary = None
    if cfg.eval.shard_spec is not None:  # a job's store: the summary comes from the merge of every job's store
        shard_record(cfg, len(checked.rows), opened.expected, finished=complete).write(opened.paths.root)
    elif complete:
        summary = _summarize(cfg, opened)
        _report(summary, opened)
    return EvalResult(
        paths=opened.paths, complete=complete, summary=summary, groups_generated=len(rolled.records),
        completions_written=rolled.written, skipped_completions=plan.skipped, wall_time_s=wall,
        rollout_metrics=metrics, errors_written=rolled.errors, retried=plan.retried,
    )


def _plan(cfg: EvalConfig, opened: OpenStore) -> StorePlan:
    """Plan the store (what its lines leave to do); a job's store says which prompts it owns before any is
    rolled out, and a summary from before the missing groups is removed."""
    paths = opened.paths
    if cfg.eval.shard_spec is not None:
        shard_record(cfg, len(opened.checked.rows), opened.expected, finished=False).write(paths.root)
    plan = plan_store(opened)
    if plan.todo:
        for stale in (paths.summary, paths.root / gym_eval.AGGREGATE_FILE):
            stale.unlink(missing_ok=True)  # stale until the missing groups are on disk
    if (note := plan.resume_note(paths.completions)) is not None:
        print(note)
    return plan


async def _gym_aggregate(opened: OpenStore, rolled: RolledOut) -> None:
    """nemo_gym, while Gym is up: its own per-agent aggregate of a store with every sample on disk."""
    store, expected = opened.store, opened.expected
    if all(store.line(d.idx, s) is not None for d in opened.datums for s in range(expected[d.idx])):
        await gym_eval.aggregate_metrics(
            opened.manager, opened.datums, expected, store, opened.paths.root, reuse=not rolled.records
        )


def _store_run(opened: OpenStore, plan: StorePlan, rolled: RolledOut, wall: float) -> dict[str, float]:
    """Append this call's line to the store's runs.jsonl; returns the manager's metrics over its groups."""
    metrics = batch_metrics(rolled.records, wall) if rolled.records else {}
    record = RunRecord(len(rolled.records), rolled.written, rolled.errors, plan.retried, plan.skipped, wall, metrics)
    append_line(opened.paths.runs, record.to_json())
    return metrics


def _complete(opened: OpenStore, plan: StorePlan, rolled: RolledOut, *, stopped_early: bool) -> bool:
    """True when every (prompt, sample) has a line; a manager that returned fewer samples than asked for is a
    bug (RuntimeError), unless the run was stopped early on purpose (tests)."""
    store = opened.store
    missing = [idx for idx, n in opened.expected.items() if any(store.line(idx, s) is None for s in range(n))]
    if missing and not stopped_early:
        raise RuntimeError(
            f"the rollouts returned fewer completions than num_generations_per_prompt for prompts {missing[:20]}"
        )
    return not missing and len(rolled.records) == len(plan.todo)


def _summarize(cfg: EvalConfig, opened: OpenStore) -> EvalSummary:
    """The summary of a complete store's lines, with Gym's own aggregate (nemo_gym mode; its per-task
    group_level_metrics stay in gym_aggregate_metrics.json) and where the Gym servers' logs are."""
    paths, gym_logs = opened.paths, opened.gym_logs
    summary = summarize(cfg, opened.datums, opened.expected, opened.store)
    gym_metrics = gym_eval.summary_metrics(paths.root)  # None but in nemo_gym mode
    if gym_metrics is not None:
        summary = dataclasses.replace(summary, gym_metrics=gym_metrics)
    if gym_logs is not None:  # in the eval folder unless configured
        where = gym_logs.relative_to(paths.root) if gym_logs.is_relative_to(paths.root) else gym_logs
        summary = dataclasses.replace(summary, gym_logs=str(where))
    return summary


def _report(summary: EvalSummary, opened: OpenStore) -> None:
    """summary.json, report.md and its plots; the prompt-length warning, once."""
    paths = opened.paths
    paths.summary.write_bytes(dumps(summary.to_json(), indent=True) + b"\n")
    write_report(summary, paths)
    warn_prompt_length(summary)
