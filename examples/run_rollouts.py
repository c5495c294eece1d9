"""Roll out a few shipped arithmetic prompts with SmolLM2 in the calculator tool environment.

    python examples/run_rollouts.py [--num-prompts 4] [--num-generations 2] [--max-turns 3]

Prints each PromptGroupRecord: the completions' turns, rewards and stop reasons, then the rollout
metrics. The model is small, so expect few correct answers: this shows the machinery, not the model.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.datasets import SHIPPED_ARITHMETIC, load_jsonl
from nemo_rl_ext.data.records import PromptGroupRecord
from nemo_rl_ext.experience.build import build_policy, build_rollouts
from nemo_rl_ext.experience.config import RolloutsConfig
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation import GenerationConfig


def print_group(record: PromptGroupRecord) -> None:
    question = record.prompt[-1].content
    print(f"\n=== prompt {record.prompt_idx} [{record.agent_name}] {question!r} "
          f"(ground truth {record.extra_env_info['ground_truth']})")
    for i, c in enumerate(record.completions):
        print(f"--- sample {i}: reward={c.reward:.1f} turns={c.num_turns} stop={c.stop_reason.value} "
              f"tokens={len(c.token_ids)} answer={c.env_extras.get('answer')!r}")
        for m in c.message_log[len(record.prompt):]:
            text = m.content.strip().replace("\n", " ")
            print(f"    {m.role:>9} ({len(m.token_ids):>3} ids): {text[:100]}")


async def main(args: argparse.Namespace) -> None:
    tokenizer, generation = build_policy(PolicyConfig(model_name=args.model, max_model_len=1024))
    rollouts = RolloutsConfig.model_validate({
        "num_generations_per_prompt": args.num_generations,
        "max_rollout_turns": args.max_turns,
        "max_seq_len": 1024,
        "env": {"name": "tool_calculator"},  # its registered system prompt teaches the calculator tool
    })
    rows = load_jsonl(SHIPPED_ARITHMETIC, required=("question", "answer"))[: args.num_prompts]
    sampling = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.7, seed=0)
    datums, manager = build_rollouts(rollouts, tokenizer, generation, rows, generation_config=sampling)
    try:
        records, metrics = await manager.run_rollouts(datums)
    finally:
        await manager.shutdown()
        generation.shutdown()
    for record in records:
        print_group(record)
    print("\nrollout metrics:")
    for key in sorted(metrics):
        print(f"  {key:<40} {metrics[key]:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help='"smollm2", "tiny" or a model folder')
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    try:
        asyncio.run(main(parser.parse_args()))
    except ConfigError as err:  # e.g. --model names no model folder: the message alone, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
