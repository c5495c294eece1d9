"""The eval driver: rows -> `RolloutManager` -> `PromptGroupRecord`s -> completions JSONL -> summary + report.

    result = run_eval(load_config("examples/configs/evals/eval.yaml", [], EvalConfig))
    result.summary["metrics"]["pass@1"]

The driver has no generation loop of its own: `build_rollout_setup` (the one place that looks at
`eval.rollout_mode`) builds the datums and the manager, and every group comes from `manager.run_rollout`.
Groups are written as they finish (see `store.py`); re-running with the same `save_path` rolls out only
the groups with missing samples, and the summary is always computed from the file, so a resumed run
reports exactly what an uninterrupted one does (rollouts are seeded per prompt, sample and turn from
`policy.generation.seed`; with `seed: null` a resumed group's samples are fresh draws instead).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from nemo_rl_ext.config import dump_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.metrics import PromptSamples, aggregate_eval_metrics
from nemo_rl_ext.evals.store import CompletionStore, EvalPaths, check_resumable, completion_line, dumps
from nemo_rl_ext.experience.records import DatumSpec, PromptGroupRecord
from nemo_rl_ext.experience.rollout_manager import RolloutManager, batch_metrics
from nemo_rl_ext.models.generation.interfaces import GenerationInterface


def default_system_prompt(environment: str | None) -> str | None:
    """The system prompt a native environment needs when `eval.system_prompt` is null."""
    if environment == "tool_calculator":
        from nemo_rl_ext.environments.calculator import CALCULATOR_SYSTEM_PROMPT

        return CALCULATOR_SYSTEM_PROMPT
    return None


def build_rollout_setup(
    cfg: EvalConfig, generation: GenerationInterface
) -> tuple[list[DatumSpec], RolloutManager]:
    """The datums and the RolloutManager for `cfg.eval.rollout_mode` (the only function that branches on it)."""
    from nemo_rl_ext.datasets import gym_datums, load_jsonl

    ev = cfg.eval
    tokenizer = generation.tokenizer
    common: dict[str, Any] = dict(
        tokenizer=tokenizer,
        num_generations_per_prompt=ev.num_tests_per_prompt,
        max_seq_len=ev.max_seq_len,
        policy_generation=generation,
        generation_config=cfg.policy.generation,
    )
    if ev.rollout_mode == "nemo_gym":
        rows = load_jsonl(ev.dataset_path, required=("responses_create_params", "agent_ref"))[
            : ev.num_prompts
        ]
        datums = gym_datums(rows)
        manager = RolloutManager(**common, task_to_env=None, use_nemo_gym=True, gym_config=cfg.gym)
        return datums, manager

    from nemo_rl_ext.datasets import qa_datums
    from nemo_rl_ext.environments import create_environment

    env_name = ev.resolved_environment
    assert env_name is not None
    system_prompt = ev.system_prompt if ev.system_prompt is not None else default_system_prompt(env_name)
    rows = load_jsonl(ev.dataset_path, required=("question", "answer"))[: ev.num_prompts]
    datums = qa_datums(tokenizer, rows, task_name=env_name, system_prompt=system_prompt or None)
    turns = 1 if ev.rollout_mode == "single_turn" else ev.max_rollout_turns
    manager = RolloutManager(
        **common, task_to_env={env_name: create_environment(env_name)}, max_rollout_turns=turns
    )
    return datums, manager


@dataclass(frozen=True)
class EvalResult:
    """What one `run_eval` call did and found."""

    paths: EvalPaths
    """The output files."""
    complete: bool
    """True when every (prompt, sample) is on disk (then `summary` is set and written)."""
    summary: dict[str, Any] | None
    """The summary (also in summary.json), or None when the run stopped early."""
    groups_generated: int
    """Groups rolled out by this call (resumed groups already complete are not counted)."""
    completions_written: int
    """Lines this call appended."""
    skipped_completions: int
    """(prompt, sample) pairs found on disk and not generated again."""
    wall_time_s: float
    """Wall time of this call."""
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    """The manager's metrics over this call's groups (empty when nothing was generated)."""


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
    from nemo_rl_ext.models.policy import build_generation

    start = time.perf_counter()
    paths = EvalPaths(Path(cfg.eval.save_path))
    paths.root.mkdir(parents=True, exist_ok=True)
    if paths.completions.exists() and paths.completions.stat().st_size > 0:
        check_resumable(paths.config, cfg.model_dump(mode="json"))
    paths.config.write_text(dump_config(cfg))
    store = CompletionStore(paths.completions)
    if store.torn_bytes:
        print(f"resume: cut a torn last line ({store.torn_bytes} bytes) from {paths.completions}")

    own_generation = generation is None
    gen = build_generation(cfg.policy) if generation is None else generation
    manager = None
    try:
        datums, manager = build_rollout_setup(cfg, gen)
        manager.preflight(datums)
        expected = {d.idx: manager.counts.for_agent(d.agent) for d in datums}
        todo = [d for d in datums if not set(range(expected[d.idx])) <= store.samples_of(d.idx)]
        skipped = sum(len(store.samples_of(d.idx) & set(range(expected[d.idx]))) for d in datums)
        if todo and paths.summary.exists():
            paths.summary.unlink()  # stale until the missing groups are on disk
        if skipped:
            print(
                f"resume: {skipped} completion(s) already in {paths.completions}; {len(todo)} group(s) to go"
            )
        records, written = await _roll_out(
            manager,
            todo,
            store,
            cfg.eval.save_token_ids,
            cfg.eval.max_concurrent_prompts,
            progress,
            stop_after_groups,
            f"eval {cfg.eval.rollout_mode}",
        )
    finally:
        if manager is not None:
            await manager.shutdown()  # the nemo_gym mode stops its policy server and Gym here
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
                    "skipped_completions": skipped,
                    "wall_time_s": wall,
                    "rollout_metrics": metrics,
                }
            )
            + b"\n"
        )
    missing = [idx for idx, n in expected.items() if not set(range(n)) <= store.samples_of(idx)]
    if missing and stop_after_groups is None:
        raise RuntimeError(
            f"the rollouts returned fewer completions than num_tests_per_prompt for prompts {missing[:20]}"
        )
    complete = not missing
    summary = None
    if complete:
        summary = summarize(cfg, datums, expected, store)
        paths.summary.write_bytes(dumps(summary, indent=True) + b"\n")
        from nemo_rl_ext.evals.report import write_report

        write_report(summary, paths)
    return EvalResult(paths, complete, summary, len(records), written, skipped, wall, metrics)


async def _roll_out(
    manager: RolloutManager,
    todo: Sequence[DatumSpec],
    store: CompletionStore,
    save_token_ids: bool,
    max_concurrent: int | None,
    progress: bool,
    stop_after_groups: int | None,
    desc: str,
) -> tuple[list[PromptGroupRecord], int]:
    """Roll out `todo` concurrently, appending each group's missing samples as soon as the group is done."""
    limit = asyncio.Semaphore(max_concurrent or max(len(todo), 1))

    async def one(datum: DatumSpec) -> PromptGroupRecord:
        async with limit:
            return await manager.run_rollout(datum)

    tasks = [asyncio.ensure_future(one(d)) for d in todo]
    records: list[PromptGroupRecord] = []
    written = 0
    bar = tqdm(total=len(todo), desc=desc, unit="prompt", disable=not progress)
    try:
        for next_done in asyncio.as_completed(tasks):
            record = await next_done
            have = store.samples_of(record.prompt_idx)
            written += store.append(
                completion_line(record, i, c, save_token_ids)
                for i, c in enumerate(record.completions)
                if i not in have
            )
            records.append(record)
            bar.update(1)
            if stop_after_groups is not None and len(records) >= stop_after_groups:
                break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        bar.close()
    return records, written


def summarize(
    cfg: EvalConfig, datums: Sequence[DatumSpec], expected: dict[int, int], store: CompletionStore
) -> dict[str, Any]:
    """The summary of the completions on disk for `datums` (a pure function of the file's lines)."""
    prompts, lines = [], []
    for d in datums:
        group = [store.lines[(d.idx, s)] for s in range(expected[d.idx])]
        lines.extend(group)
        prompts.append(
            PromptSamples(
                agent_name=group[0]["agent"],
                rewards=tuple(float(x["reward"]) for x in group),
                answers=tuple(
                    None if x["stop_reason"] == "error" or x["answer"] is None else str(x["answer"])
                    for x in group
                ),
            )
        )
    ks = cfg.eval.resolved_ks
    n = len(lines)
    stops = Counter(x["stop_reason"] for x in lines)
    return {
        "rollout_mode": cfg.eval.rollout_mode,
        "model": cfg.policy.model_name,
        "dataset_path": cfg.eval.dataset_path,
        "num_prompts": len(prompts),
        "num_completions": n,
        "ks": list(ks),
        "reward_threshold": cfg.eval.reward_threshold,
        "agents": sorted({p.agent_name for p in prompts}),
        "stop_reasons": dict(sorted(stops.items())),
        "num_errors": stops.get("error", 0),
        "truncation_rate": sum(bool(x["truncated"]) for x in lines) / n,
        "mean_turns": sum(int(x["num_turns"]) for x in lines) / n,
        "metrics": aggregate_eval_metrics(prompts, ks, cfg.eval.reward_threshold),
    }
