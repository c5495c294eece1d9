"""Train a policy with GRPO from a YAML config, with `key.sub=value` overrides.

    python examples/run_grpo.py --config examples/configs/grpo_smollm2.yaml [grpo.max_num_steps=5 ...]
    python examples/run_grpo.py --config ... resume=true        # continue from the latest checkpoint
    python examples/run_grpo.py --config ... resume=restart     # start over, deleting output_dir's checkpoints
    python examples/run_grpo.py export RUN_DIR [--step N] [--out DIR] [--force]   # a Hugging Face folder

Prints one line per step (reward, loss, grad norm, timings); metrics go to <output_dir>/metrics.jsonl.
A resume refuses a changed config (except the keys of nemo_rl_ext.grpo.config.RESUME_MAY_CHANGE, e.g.
grpo.max_num_steps) and skips a damaged checkpoint for the previous whole one; it never overwrites an earlier
run it cannot continue (step folders without a complete checkpoint: refused unless resume=restart). User errors
(config, input files, resume) and Gym servers that do not start (their name and log file) print one message
and exit 2; a trainer rank that dies or fails (trainer.workers > 1), an infrastructure failure, prints one `error:`
line (the rank, its pid and node, the last complete checkpoint, the command that resumes) last and exits 3. NeMo Gym servers the run launches log to <output_dir>/gym/.

`export` writes a checkpoint of the run in RUN_DIR (its output_dir; default: the newest whole checkpoint) as a
Hugging Face folder that transformers and `run_eval.py policy.model_name=DIR` load (default --out:
RUN_DIR/export/step_N; --adapter-only is for LoRA runs); see nemo_rl_ext/training/export.py and docs/training.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.gym.errors import GymLaunchError
from nemo_rl_ext.lifecycle import freeze_startup_heap, stop_on_signals
from nemo_rl_ext.plugins import add_import_argument, load_plugins


def export_main(argv: list[str]) -> int:
    """`run_grpo.py export RUN_DIR`: write a checkpoint of the run as a Hugging Face model folder."""
    parser = argparse.ArgumentParser(prog="run_grpo.py export", description="Export a GRPO run's checkpoint as a "
                                     "Hugging Face model folder (safetensors, config, tokenizer, chat template).")
    parser.add_argument("run_dir", help="the run's output_dir")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the newest whole checkpoint)")
    parser.add_argument("--out", help="the folder to write (default: RUN_DIR/export/step_N)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    parser.add_argument("--adapter-only", action="store_true", help="LoRA runs: the peft adapter folder alone")
    args = parser.parse_args(argv)
    from nemo_rl_ext.training.export import export_checkpoint

    try:
        result = export_checkpoint(args.run_dir, step=args.step, out=args.out, force=args.force,
                                   adapter_only=args.adapter_only)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported step {result.step} ({result.checkpoint}) to {result.out}: {len(result.files)} files, "
          f"{result.total_bytes / 2**20:.1f} MiB")
    return 0


def _script() -> str:
    """This script's path as the user would type it here: relative to the working directory when inside it."""
    path = Path(__file__).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see examples/configs/grpo_*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    add_import_argument(parser)
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the flags
    import transformers  # here, not at the top: `export` does without transformers and the trainer

    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.failures import infrastructure_error_line
    from nemo_rl_ext.grpo.loop import GRPO
    from nemo_rl_ext.training.distributed_trainer import TrainerWorkerError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()  # per-load weight bars would bury the step lines
    start = time.perf_counter()
    try:
        load_plugins(args.imports)  # before the config: the names they register validate in it
        cfg = load_config(args.config, args.overrides, GRPOConfig)
        freeze_startup_heap()  # the imports' objects leave the collector's scans (lifecycle.freeze_startup_heap)
        with GRPO(cfg) as grpo:  # checks inputs, checkpoint and resume config before any model loads
            first_step = grpo.step
            history = grpo.run()
    except ConfigError as exc:  # a user error (config, inputs, resume): its message alone, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except GymLaunchError as exc:  # a Gym server that did not start: its name, error and log file, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainerWorkerError as exc:  # infrastructure: one line with the rank, its node, the checkpoint, the resume
        sys.stdout.flush()  # Ray's own lines (stdout) come before the error line, not after it
        print("error: " + infrastructure_error_line(exc, cfg.output_dir, _script(), args.config, args.overrides,
                                                    args.imports), file=sys.stderr)
        return 3
    rewards = [h["rollout/reward/mean"] for h in history]
    print(f"\n{len(history)} step(s) in {time.perf_counter() - start:.1f} s; outputs in {cfg.output_dir}")
    if rewards:
        print("reward per step: " + " ".join(f"{first_step + i + 1}:{r:.3f}" for i, r in enumerate(rewards)))
    return 0


if __name__ == "__main__":
    with stop_on_signals(resume_hint="Re-run with resume=true to continue from the latest checkpoint."):
        sys.exit(main())
