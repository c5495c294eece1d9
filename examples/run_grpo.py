"""Train a policy with GRPO from a YAML config, with `key.sub=value` overrides.

    python examples/run_grpo.py --config examples/configs/grpo_smollm2.yaml [grpo.max_num_steps=5 ...]
    python examples/run_grpo.py --config ... resume=true        # continue from the latest checkpoint
    python examples/run_grpo.py --config ... resume=restart     # start over, deleting output_dir's checkpoints

Prints one line per step (reward, loss, grad norm, timings); metrics go to <output_dir>/metrics.jsonl.
A resume refuses a changed config (except the keys of grpo_config.RESUME_MAY_CHANGE, e.g.
grpo.max_num_steps) and skips a damaged checkpoint for the previous whole one; it never overwrites an earlier
run it cannot continue (step folders without a complete checkpoint: refused unless resume=restart). User errors
(config, input files, resume) and Gym servers that do not start (their name and log file) print one message
and exit 2. NeMo Gym servers the run launches log to <output_dir>/gym/.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import transformers

from nemo_rl_ext.algorithms.grpo import GRPO
from nemo_rl_ext.algorithms.grpo_config import GRPOConfig
from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.gym.launcher import GymLaunchError
from nemo_rl_ext.lifecycle import stop_on_signals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (see examples/configs/grpo_*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after the flags
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()  # per-load weight bars would bury the step lines
    start = time.perf_counter()
    try:
        cfg = load_config(args.config, args.overrides, GRPOConfig)
        with GRPO(cfg) as grpo:  # checks inputs, checkpoint and resume config before any model loads
            first_step = grpo.step
            history = grpo.run()
    except ConfigError as exc:  # a user error (config, inputs, resume): its message alone, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except GymLaunchError as exc:  # a Gym server that did not start: its name, error and log file, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rewards = [h["rollout/reward/mean"] for h in history]
    print(f"\n{len(history)} step(s) in {time.perf_counter() - start:.1f} s; outputs in {cfg.output_dir}")
    if rewards:
        print("reward per step: " + " ".join(f"{first_step + i + 1}:{r:.3f}" for i, r in enumerate(rewards)))
    return 0


if __name__ == "__main__":
    with stop_on_signals(resume_hint="Re-run with resume=true to continue from the latest checkpoint."):
        sys.exit(main())
