"""Evaluate a policy: pass@k, maj@k, mean@k and mean reward, overall and per agent.

    python examples/run_eval.py --config examples/configs/evals/eval.yaml [key.sub=value ...]
    python examples/run_eval.py merge RUN_FOLDER

Evaluation as a job array: `eval.shard=I/N` (0-based) evaluates the prompts with index % N == I into
`<save_path>/shards/<I>-of-<N>/`; `eval.seeds=[s1,s2,...]` runs a job per seed (`eval.seed_index=J` picks one,
else every seed runs in turn) into `<save_path>/seeds/<s>/shards/...`. The last job to finish merges (or
`merge RUN_FOLDER`): a sorted completions.jsonl per group, summary.json and report.md from it alone.
On Ray: `eval.ray_workers=N` starts N Ray workers (each its own engine, Ray from `policy.cluster`) that pull
prompts from a shared queue into `<save_path>/shards/worker-<k>/`; a dead worker's prompts go back to the queue
(`<save_path>/ray_workers.jsonl` records it), and this process merges when the queue is done.

Rollout modes (`rollouts.mode`): native (the environment loop in this process; `rollouts.max_rollout_turns: 1`
for single turn), nemo_gym (Gym agents), or one a plugin registers; summary.json's `rollout_mode` names them
single_turn, multi_turn, nemo_gym (or the plugin's name). Plugins: `--import MODULE` (repeatable) and installed
packages' `nemo_rl_ext.plugins` entry points register environments, backends, metrics and rollout modes before
the config is read (docs/extending.md). Outputs in `eval.save_path`: config.yaml, completions.jsonl,
summary.json, runs.jsonl, pass_at_k.png, report.md, dataset_fingerprint.json, timings.jsonl, difficulty.jsonl,
reward_profile.png; in nemo_gym mode also gym_rows.jsonl and gym_aggregate_metrics.json, and with
rollouts.gym.launch the Gym servers' logs in gym/ (summary.json's `gym_logs`). Re-running with the same save_path (or a copy of the folder) resumes: finished (prompt, sample) pairs
are skipped, error samples (infrastructure failures) are retried, and the summary equals that of an
uninterrupted run.

Exit status: 0 done (a job of a sharded / seeded run: its slice is done, the merge waits for the others);
1 stopped before every sample was rolled out (re-run to resume); 2 a user error (config, dataset, output folder,
a Gym server that did not start; dataset rows that NeMo Gym refused as malformed, named; for `merge`: a missing
or unfinished shard, differing configs or rows, non-identical duplicates; a refused resume leaves the folder as
it was); 3 done, but more samples ended as errors than eval.max_error_rate allows (re-run to retry them).
"""

from __future__ import annotations

import argparse
import sys

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig, check_inputs
from nemo_rl_ext.gym.errors import GymLaunchError
from nemo_rl_ext.lifecycle import freeze_startup_heap, stop_on_signals
from nemo_rl_ext.plugins import add_import_argument, load_plugins


def merge_main(argv: list[str]) -> int:
    """`run_eval.py merge RUN_FOLDER`: merge the job stores of a sharded / seeded run."""
    parser = argparse.ArgumentParser(prog="run_eval.py merge", description="Merge the shards (and seeds) of a run.")
    parser.add_argument("run_folder", help="the run's eval.save_path")
    args = parser.parse_args(argv)
    from nemo_rl_ext.evals.merge import merge_run
    from nemo_rl_ext.evals.report import format_metric_table

    try:
        result = merge_run(args.run_folder)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"merged {len(result.stores)} store(s) of {result.root}\n\n{format_metric_table(result.summary)}\n")
    print(f"outputs in {result.root}/: summary.json, report.md, pass_at_k.png" + (
        ", seeds/<seed>/completions.jsonl" if result.seed_summaries else ", completions.jsonl"))
    return exit_status(result.summary, "re-run their shards")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="YAML config (examples/configs/evals/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. eval.num_prompts=8")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_import_argument(parser)
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the flags
    try:
        load_plugins(args.imports)  # before the config: the names they register validate in it
        cfg = load_config(args.config, args.overrides, EvalConfig)
        check_inputs(cfg)  # missing files and counts: found before the model loads

        from nemo_rl_ext.evals.driver import run_eval

        freeze_startup_heap()  # the imports' objects leave the collector's scans (lifecycle.freeze_startup_heap)

        result = run_eval(cfg, progress=not args.no_progress)
    except ConfigError as err:  # a user error (config, inputs, resume): its message alone, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
    except GymLaunchError as err:  # a Gym server that did not start: its name, error and log file, no traceback
        print(f"error: {err}", file=sys.stderr)
        return 2

    from nemo_rl_ext.evals.report import format_metric_table

    print(
        f"\n{result.groups_generated} group(s) rolled out, {result.completions_written} completion(s) written, "
        f"{result.skipped_completions} already on disk; {result.wall_time_s:.1f} s"
    )
    if result.summary is None and result.complete and result.waiting_for:
        print(
            f"this job is done; the merge runs when the last job finishes (or: run_eval.py merge "
            f"{result.paths.root}). Not finished yet: {', '.join(result.waiting_for)}"
        )
        return 0
    if result.summary is None:
        print(f"incomplete: re-run with the same eval.save_path (and eval.shard) to resume ({result.paths.root})")
        return 1
    print(f"\n{format_metric_table(result.summary)}\n")
    from nemo_rl_ext.evals.profile import DIFFICULTY_FILE, PROFILE_PLOT

    completions = "seeds/<seed>/completions.jsonl" if cfg.eval.seeds is not None else result.paths.completions.name
    print(
        f"outputs in {result.paths.root}/: {result.paths.summary.name}, {completions}, "
        f"{result.paths.report.name}, {result.paths.plot.name}, {PROFILE_PLOT}, {DIFFICULTY_FILE}"
    )
    if result.summary.gym_logs is not None:
        print(f"NeMo Gym server logs in {result.paths.root / result.summary.gym_logs}/")
    return exit_status(result.summary, "see above")


def exit_status(summary, retry: str) -> int:
    """2 when rows were refused as malformed (data errors: fix the rows and re-run), else 3 when more samples ended as
    infrastructure errors than eval.max_error_rate allows (`retry` says how to retry them), else 0."""
    from nemo_rl_ext.evals.report import data_error_note

    if summary.num_data_errors:
        print(f"error: {data_error_note(summary)}", file=sys.stderr)
        return 2
    if summary.status == "errors_left":
        print(f"error: {summary.num_errors} error sample(s) left; {retry}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    with stop_on_signals():  # SIGTERM: an orderly stop (Gym servers, policy server), resumable outputs
        sys.exit(main())
