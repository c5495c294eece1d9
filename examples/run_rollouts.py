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
from nemo_rl_ext.data.datasets import SHIPPED_ARITHMETIC, load_jsonl, qa_datums
from nemo_rl_ext.data.records import PromptGroupRecord
from nemo_rl_ext.environments import create_environment
from nemo_rl_ext.environments.calculator import CALCULATOR_SYSTEM_PROMPT
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.models.backends import build_generation
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
    policy_cfg = PolicyConfig(model_name=args.model, max_model_len=1024)
    generation = build_generation(policy_cfg)
    tokenizer = generation.tokenizer
    rows = load_jsonl(SHIPPED_ARITHMETIC, required=("question", "answer"))[: args.num_prompts]
    datums = qa_datums(tokenizer, rows, "tool_calculator", system_prompt=CALCULATOR_SYSTEM_PROMPT)
    manager = RolloutManager(
        tokenizer=tokenizer,
        task_to_env={"tool_calculator": create_environment("tool_calculator")},
        num_generations_per_prompt=args.num_generations,
        max_seq_len=1024,
        max_rollout_turns=args.max_turns,
        policy_generation=generation,
        generation_config=GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.7, seed=0),
    )
    records, metrics = await manager.run_rollouts(datums)
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
