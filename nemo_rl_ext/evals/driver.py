"""The eval's entry point: `run_eval` picks how a config runs, each the same pipeline
plan -> roll out -> store -> summarise -> report.

    result = run_eval(load_config("examples/configs/evals/eval.yaml", [], EvalConfig))
    result.summary["metrics"]["pass@1"]

- a run in this process (store_run.py): its rows (store_setup.py) and what its store still needs (plan.py), rolled
  out (rollout.py) through the `RolloutManager` that `experience.build.build_rollouts` makes of the `rollouts`
  section, as GRPO's are, each group appended to completions.jsonl as it finishes (store.py), then summarised
  from the file (summary.py) and reported (report.py);
- `eval.shard` or `eval.seeds` (jobs.py): each job is that same pipeline over its slice of the datums (dataset
  indices kept) into its own store (shards.py), and the last job to finish merges (merge.py), which summarises
  and reports;
- `eval.ray_workers` (ray_lease_queue.py): Ray workers (ray_worker.py) lease the prompts from a shared queue
  (prompt_queue.py) and roll each out through the same roll-out step into their own stores; this process merges.

Nothing here branches on the rollout mode: what differs (nemo_gym's rows sent and Gym's own aggregate) the manager
answers for. Re-running with the same `save_path` rolls out only the groups with missing or errored samples, and
the summary is always computed from the file, so a resumed run reports exactly what an uninterrupted one does
(rollouts are seeded per prompt, sample and turn from `policy.generation.seed`; with `seed: null` a resumed
group's samples are fresh draws instead).

Error completions (a dead server, a failed generation, an environment that raised) are recorded but are
not answers: the metrics use the other samples, the summary counts them (`num_errors`, `status`), and a
re-run rolls them out again. `summary["status"]` is "errors_left" when more than `eval.max_error_rate` of
the samples ended as errors (the CLI then exits 3).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.jobs import run_jobs_async
from nemo_rl_ext.evals.ray_lease_queue import run_ray_eval
from nemo_rl_ext.evals.result import EvalResult
from nemo_rl_ext.evals.store_run import run_store_async
from nemo_rl_ext.models.generation.interfaces import GenerationInterface

__all__ = ["EvalResult", "run_eval", "run_eval_async"]


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
    With `eval.ray_workers` the run goes to Ray workers that build their own engines (ray_lease_queue.py).
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


def _on_ray(
    cfg: EvalConfig, generation: GenerationInterface | None, progress: bool, stop_after_groups: int | None
) -> EvalResult:
    """`run_eval` with `eval.ray_workers`: each worker builds its own engine, so none may be handed in."""
    if generation is not None or stop_after_groups is not None:
        raise ValueError("with eval.ray_workers each Ray worker builds its own engine from `policy`: pass no "
                         "generation (and no stop_after_groups); see evals/ray_lease_queue.run_ray_eval")
    return run_ray_eval(cfg, progress=progress)
