"""An eval split into jobs (`eval.shard`, `eval.seeds`) run in this process: each job is the same store pipeline
(store_run.py) over its slice into its own store (shards.py), and the last job of the run to finish merges
(merge.py).

    result = await run_jobs_async(cfg)         # result.waiting_for: the jobs other invocations still run
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.merge import merge_run, unfinished_jobs
from nemo_rl_ext.evals.plan import job_configs, job_root
from nemo_rl_ext.evals.result import EvalResult
from nemo_rl_ext.evals.store import EvalPaths
from nemo_rl_ext.evals.store_run import generation_for, run_store_async
from nemo_rl_ext.evals.summary import EvalSummary
from nemo_rl_ext.models.generation.interfaces import GenerationInterface

__all__ = ["run_jobs_async"]


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
    start = time.perf_counter()
    jobs = job_configs(cfg)
    results: list[EvalResult] = []
    async with generation_for(jobs[0], generation) as gen:
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
    root = Path(cfg.eval.save_path)
    complete = len(results) == len(jobs) and all(r.complete for r in results)
    waiting = tuple(unfinished_jobs(root, cfg)) if complete else ()
    summary = merge_run(root).summary if complete and not waiting else None
    return _combined(root, results, complete, summary, waiting, time.perf_counter() - start)


def _combined(
    root: Path, results: Sequence[EvalResult], complete: bool, summary: EvalSummary | None,
    waiting: tuple[str, ...], wall: float,
) -> EvalResult:
    """The run's result from its jobs' results (their counts added up)."""
    return EvalResult(
        paths=EvalPaths(root),
        complete=complete,
        summary=summary,
        groups_generated=sum(r.groups_generated for r in results),
        completions_written=sum(r.completions_written for r in results),
        skipped_completions=sum(r.skipped_completions for r in results),
        wall_time_s=wall,
        rollout_metrics=results[-1].rollout_metrics if len(results) == 1 else {},
        errors_written=sum(r.errors_written for r in results),
        retried=sum(r.retried for r in results),
        waiting_for=waiting,
    )
