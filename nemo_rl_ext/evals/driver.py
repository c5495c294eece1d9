"""The eval driver: rows -> `RolloutManager` -> `PromptGroupRecord`s -> completions JSONL -> summary + report.

    result = run_eval(load_config("examples/configs/evals/eval.yaml", [], EvalConfig))
    result.summary["metrics"]["pass@1"]

The driver has no generation loop of its own: `build_rollout_setup` (the one place that looks at
`eval.rollout_mode`) builds the datums and the manager, and every group comes from `manager.run_rollout`.
Groups are written as they finish (see `store.py`); re-running with the same `save_path` rolls out only
the groups with missing or errored samples, and the summary is always computed from the file, so a
resumed run reports exactly what an uninterrupted one does (rollouts are seeded per prompt, sample and
turn from `policy.generation.seed`; with `seed: null` a resumed group's samples are fresh draws instead).

Error completions (a dead server, a failed generation, an environment that raised) are recorded but are
not answers: the metrics use the other samples, the summary counts them (`num_errors`, `status`), and a
re-run rolls them out again. `summary["status"]` is "errors_left" when more than `eval.max_error_rate` of
the samples ended as errors (the CLI then exits 3).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from nemo_rl_ext.config import dump_config
from nemo_rl_ext.data.records import DatumSpec, PromptGroupRecord
from nemo_rl_ext.evals.config import EvalConfig, dataset_file
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.store import (
    CompletionStore,
    EvalPaths,
    check_dataset,
    check_resumable,
    dumps,
    row_digests,
)
from nemo_rl_ext.evals.summary import EvalSummary, summarize
from nemo_rl_ext.experience.rollout_manager import RolloutManager, batch_metrics
from nemo_rl_ext.models.generation.interfaces import GenerationInterface


def default_system_prompt(environment: str | None) -> str | None:
    """The system prompt a native environment needs when `eval.system_prompt` is null."""
    if environment == "tool_calculator":
        from nemo_rl_ext.environments.calculator import CALCULATOR_SYSTEM_PROMPT

        return CALCULATOR_SYSTEM_PROMPT
    return None


def load_rows(cfg: EvalConfig) -> list[dict[str, Any]]:
    """The dataset rows the eval evaluates: the first `eval.num_prompts` rows of `eval.dataset_path`."""
    from nemo_rl_ext.data.datasets import load_jsonl

    ev = cfg.eval
    # a Gym row's agent may come from gym.agent_name: gym_datums names the rows that have none
    required = ("responses_create_params",) if ev.rollout_mode == "nemo_gym" else ("question", "answer")
    return load_jsonl(dataset_file(cfg), required=required)[: ev.num_prompts]


def build_rollout_setup(
    cfg: EvalConfig, generation: GenerationInterface, rows: Sequence[dict[str, Any]] | None = None
) -> tuple[list[DatumSpec], RolloutManager]:
    """The datums and the RolloutManager for `cfg.eval.rollout_mode` (the only function that branches on it).

    `rows`: the rows to evaluate (default: `load_rows(cfg)`)."""
    from nemo_rl_ext.data.datasets import gym_datums

    ev = cfg.eval
    rows = load_rows(cfg) if rows is None else rows
    tokenizer = generation.tokenizer
    common: dict[str, Any] = dict(
        tokenizer=tokenizer,
        num_generations_per_prompt=ev.num_tests_per_prompt,
        max_seq_len=ev.max_seq_len,
        policy_generation=generation,
        generation_config=cfg.policy.generation,
    )
    if ev.rollout_mode == "nemo_gym":
        assert cfg.gym is not None
        datums = gym_datums(
            rows, agent_name=cfg.gym.agent_name, responses_create_params=cfg.gym.responses_create_params
        )
        manager = RolloutManager(**common, task_to_env=None, use_nemo_gym=True, gym_config=cfg.gym)
        return datums, manager

    from nemo_rl_ext.cluster import build_environment
    from nemo_rl_ext.data.datasets import qa_datums

    env_name = ev.resolved_environment
    assert env_name is not None
    system_prompt = ev.system_prompt if ev.system_prompt is not None else default_system_prompt(env_name)
    datums = qa_datums(tokenizer, rows, task_name=env_name, system_prompt=system_prompt or None)
    turns = 1 if ev.rollout_mode == "single_turn" else ev.max_rollout_turns
    env = build_environment(
        env_name, remote=ev.remote_environment, step_timeout_s=ev.environment_step_timeout_s,
        cluster=cfg.policy.cluster,
    )
    manager = RolloutManager(**common, task_to_env={env_name: env}, max_rollout_turns=turns)
    return datums, manager


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
    """
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
    from nemo_rl_ext.cluster import build_policy_generation

    start = time.perf_counter()
    paths = EvalPaths(Path(cfg.eval.save_path))
    paths.root.mkdir(parents=True, exist_ok=True)
    store = CompletionStore(paths.completions)  # ConfigError on a garbage line
    if store.torn_bytes:
        print(f"resume: cut a torn last line ({store.torn_bytes} bytes) from {paths.completions}")
    resuming = paths.completions.exists() and paths.completions.stat().st_size > 0
    if resuming:
        check_resumable(paths.config, cfg.model_dump(mode="json"))
    rows = load_rows(cfg)
    check_dataset(paths.dataset, cfg.eval.dataset_path, row_digests(rows), resuming)
    paths.config.write_text(dump_config(cfg))

    own_generation = generation is None
    gen = build_policy_generation(cfg.policy) if generation is None else generation
    manager = None
    try:
        datums, manager = build_rollout_setup(cfg, gen, rows)
        manager.preflight(datums)
        expected = {d.idx: manager.counts.for_agent(d.agent) for d in datums}
        todo = [d for d in datums if len(store.done(d.idx, expected[d.idx])) < expected[d.idx]]
        skipped = sum(len(store.done(d.idx, expected[d.idx])) for d in datums)
        retried = sum(len(store.failed(d.idx, expected[d.idx])) for d in datums)
        gym = cfg.eval.rollout_mode == "nemo_gym"
        if gym:  # the rows Gym gets, on disk before the first is sent (a resume sends these again)
            from nemo_rl_ext.evals import gym_eval

            gym_eval.materialize_rows(manager.impl, datums, expected, paths.root, resuming)
        if todo:
            for stale in (paths.summary, paths.root / "gym_aggregate_metrics.json"):
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
            f"eval {cfg.eval.rollout_mode}",
        )
        if gym and all(store.line(d.idx, s) is not None for d in datums for s in range(expected[d.idx])):
            await gym_eval.aggregate_metrics(  # while Gym is up: its own per-agent aggregate of the results
                manager.impl, datums, expected, store, paths.root, reuse=not records
            )
    finally:
        try:
            if manager is not None:
                await manager.shutdown()  # the nemo_gym mode stops its policy server and Gym here
                for env in (getattr(manager.impl, "task_to_env", None) or {}).values():  # build_rollout_setup's
                    env.shutdown()  # a remote one: its actor (and a Ray only it started)
        finally:
            if own_generation:
                gen.shutdown()
    wall = time.perf_counter() - start
    metrics = batch_metrics(records, wall) if records else {}
    with open(paths.runs, "ab") as f:
        f.write(
            dumps(
                {
                    "groups_generated": len(records),
                    "completions_written": written,
                    "errors_written": errors_written,
                    "retried": retried,
                    "skipped_completions": skipped,
                    "wall_time_s": wall,
                    "rollout_metrics": metrics,
                }
            )
            + b"\n"
        )
    missing = [idx for idx, n in expected.items() if any(store.line(idx, s) is None for s in range(n))]
    if missing and stop_after_groups is None:
        raise RuntimeError(
            f"the rollouts returned fewer completions than num_tests_per_prompt for prompts {missing[:20]}"
        )
    complete = not missing and len(records) == len(todo)
    summary = None
    if complete:
        summary = summarize(cfg, datums, expected, store)
        if cfg.eval.rollout_mode == "nemo_gym":
            from nemo_rl_ext.evals.gym_eval import load_aggregate

            gym_metrics = load_aggregate(paths.root) or {}
            summary = dataclasses.replace(  # group_level_metrics (per task) stay in gym_aggregate_metrics.json
                summary,
                gym_metrics={
                    agent: {k: v for k, v in entry.items() if k in ("agent_metrics", "key_metrics", "error")}
                    for agent, entry in gym_metrics.items()
                },
            )
        paths.summary.write_bytes(dumps(summary.to_json(), indent=True) + b"\n")
        from nemo_rl_ext.evals.report import write_report

        write_report(summary, paths)
    return EvalResult(
        paths, complete, summary, len(records), written, skipped, wall, metrics, errors_written, retried
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
) -> tuple[list[PromptGroupRecord], int, int]:
    """Roll out `todo` concurrently, appending each group's samples that have no result yet (missing or
    errored before) as soon as the group is done; returns the records, lines written, error lines written."""
    limit = asyncio.Semaphore(max_concurrent or max(len(todo), 1))

    async def one(datum: DatumSpec) -> PromptGroupRecord:
        async with limit:
            return await manager.run_rollout(datum)

    tasks = [asyncio.ensure_future(one(d)) for d in todo]
    records: list[PromptGroupRecord] = []
    written = errors = 0
    bar = tqdm(total=len(todo), desc=desc, unit="prompt", disable=not progress)
    try:
        for next_done in asyncio.as_completed(tasks):
            record = await next_done
            have = store.done(record.prompt_idx, expected[record.prompt_idx])
            lines = [
                CompletionLine.from_completion(record, i, c, save_token_ids)
                for i, c in enumerate(record.completions)
                if i not in have
            ]
            written += store.append(lines)
            errors += sum(x.is_error for x in lines)
            records.append(record)
            bar.update(1)
            if stop_after_groups is not None and len(records) >= stop_after_groups:
                break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
    return records, written, errors
