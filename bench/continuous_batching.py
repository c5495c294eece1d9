"""Continuous against static batching in the hf engine, on a multi-turn, long-tailed workload.

    python bench/continuous_batching.py                   # tiny random Qwen2: 32 rollouts x 3 turns
    python bench/continuous_batching.py --model smollm2   # SmolLM2-135M-Instruct, same workload
    python bench/continuous_batching.py --quick           # smoke run

The workload: `--rollouts` rollouts of `--turns` turns each, all started at once; each turn sends the
rollout's context so far (a chat prompt, then every earlier output plus a few observation tokens) and waits
for its result before the next turn. Generation budgets are long-tailed: most turns get `--short` tokens,
a `--tail` fraction of them (drawn with a fixed seed, at least one per turn index) `--long-factor` times as
many. EOS is masked so every row generates exactly its budget: both sides do the same work. The uniform
control gives every turn the same budget (the long-tailed workload's mean, rounded), so it measures the
cost of continuous batching's extra prefills and cache merges where it cannot win anything.

Contenders: `HfGeneration(scheduler="continuous")` and `HfGeneration(scheduler="static")` (a batch admits
no one until all its rows finished, and hands results over when it ends: the engine before continuous
batching) over the same model, run alternately over `--rounds` rounds (who goes first rotates). Reported:
tokens/s and mean rollout wall time (medians over rounds, ratio continuous / static per round), and the
time-to-first-result of the short first-turn requests (sent together with the long ones), p50 and p95 over
every such request of every round.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import QUESTIONS, engine_bench_parser, machine_line, main_args, median, print_table, spread  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = engine_bench_parser(__doc__.splitlines()[0], "smoke run: fewer rollouts and rounds")
    parser.add_argument("--rollouts", type=int, default=None, help="concurrent rollouts (default 32; quick 8)")
    parser.add_argument("--turns", type=int, default=3, help="turns per rollout (default 3)")
    parser.add_argument("--short", type=int, default=8, help="the common generation budget (default 8)")
    parser.add_argument("--long-factor", type=int, default=16, help="the tail's budget multiple (default 16)")
    parser.add_argument("--tail", type=float, default=0.1, help="fraction of turns in the tail (default 0.1)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; smollm2 3; quick 2)")
    args = parser.parse_args()
    args.rollouts = args.rollouts or (8 if args.quick else 32)
    args.rounds = args.rounds or (2 if args.quick else 3 if args.model == "smollm2" else 5)
    return args


ARGS = main_args(__name__, parse_args)  # before torch is imported

import asyncio  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

from nemo_rl_ext.models.generation.hf_backend import HfGeneration  # noqa: E402
from nemo_rl_ext.models.generation.interfaces import GenerationConfig  # noqa: E402

OBSERVATION = "\nobservation: ok, go on.\n"


@dataclass
class RoundResult:
    """One contender's run of one workload."""

    tokens: int
    wall_s: float
    rollout_s: list[float]
    short_first_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def budgets(rollouts: int, turns: int, short: int, factor: int, tail: float, seed: int = 0) -> list[list[int]]:
    """budget[rollout][turn]: `short`, or `short * factor` for a `tail` fraction (at least one per turn)."""
    rng = random.Random(seed)
    table = [[short] * turns for _ in range(rollouts)]
    for turn in range(turns):
        n_long = max(1, round(tail * rollouts))
        for r in rng.sample(range(rollouts), n_long):
            table[r][turn] = short * factor
    return table


async def run_workload(gen: HfGeneration, prompts: list[list[int]], table: list[list[int]],
                       obs_ids: list[int]) -> RoundResult:
    """Every rollout at once; each turn waits for its result, then sends context + output + observation."""
    shortest = min(min(row) for row in table)
    short_first: list[float] = []
    start = time.perf_counter()

    async def rollout(i: int) -> tuple[int, float]:
        context, tokens = list(prompts[i]), 0
        for turn, budget in enumerate(table[i]):
            config = GenerationConfig(max_new_tokens=budget, temperature=1.0, seed=i * 101 + turn)
            out = await gen.generate_async(context, config)
            assert len(out.output_ids) == budget, (len(out.output_ids), budget)
            if turn == 0 and budget == shortest:
                short_first.append(time.perf_counter() - start)
            tokens += budget
            context += list(out.output_ids) + obs_ids
        return tokens, time.perf_counter() - start

    results = await asyncio.gather(*(rollout(i) for i in range(len(prompts))))
    wall = time.perf_counter() - start
    return RoundResult(sum(t for t, _ in results), wall, [s for _, s in results], short_first)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    args = ARGS
    torch.set_num_threads(args.threads)
    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.models.policy import resolve_model_path

    path = resolve_model_path(PolicyConfig(model_name=args.model))
    model, tokenizer = load_model_and_tokenizer(path, dtype=torch.float32, device="cpu")
    n_params = sum(p.numel() for p in model.parameters())
    long_tail = budgets(args.rollouts, args.turns, args.short, args.long_factor, args.tail)
    mean_budget = round(sum(map(sum, long_tail)) / (args.rollouts * args.turns))
    uniform = [[mean_budget] * args.turns for _ in range(args.rollouts)]
    prompts = []
    for i in range(args.rollouts):
        text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                             add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    obs_ids = tokenizer(OBSERVATION, add_special_tokens=False)["input_ids"]
    room = max(len(p) for p in prompts) + args.turns * (args.short * args.long_factor + len(obs_ids)) + 8
    print(machine_line("device cpu"))
    print(f"model {args.model} ({n_params / 1e6:.1f}M params, fp32); {args.rollouts} rollouts x {args.turns} turns; "
          f"budgets {args.short} tokens, {args.tail:.0%} of turns {args.short * args.long_factor} "
          f"(mean {mean_budget}); uniform control {mean_budget} tokens per turn; {args.rounds} rounds")

    engines = {name: HfGeneration(model, tokenizer, max_model_len=room, max_batch_size=max(64, args.rollouts),
                                  scheduler=name, num_threads=args.threads)
               for name in ("continuous", "static")}
    for gen in engines.values():
        gen._eos_ids = frozenset({-1})  # every row generates exactly its budget
    workloads = {"long-tail": long_tail, "uniform": uniform}
    loop = asyncio.new_event_loop()
    results: dict[tuple[str, str], list[RoundResult]] = {(w, e): [] for w in workloads for e in engines}
    order = [(w, e) for w in workloads for e in engines]
    for key in order:  # warm-up
        loop.run_until_complete(run_workload(engines[key[1]], prompts, workloads[key[0]], obs_ids))
    for r in range(args.rounds):
        shift = r % len(order)
        for w, e in order[shift:] + order[:shift]:
            results[(w, e)].append(loop.run_until_complete(run_workload(engines[e], prompts, workloads[w], obs_ids)))
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
            f"{w}/{e} {results[(w, e)][-1].tokens_per_s:,.0f} tok/s" for w, e in order), flush=True)
    for gen in engines.values():
        gen.shutdown()
    loop.close()

    table = []
    for w in workloads:
        static = results[(w, "static")]
        for e in engines:
            runs = results[(w, e)]
            ratios = [a.tokens_per_s / b.tokens_per_s for a, b in zip(runs, static, strict=True)]
            wall_ratios = [statistics.mean(b.rollout_s) / statistics.mean(a.rollout_s)
                           for a, b in zip(runs, static, strict=True)]
            firsts = [s for run in runs for s in run.short_first_s]
            table.append([w, e, f"{runs[0].tokens:,}", f"{median([x.tokens_per_s for x in runs]):,.0f}",
                          f"{median([statistics.mean(x.rollout_s) for x in runs]):.2f}",
                          f"{percentile(firsts, 50):.2f}", f"{percentile(firsts, 95):.2f}",
                          f"{median(wall_ratios):.2f}", f"{median(ratios):.2f} ({spread(ratios)})"])
    print_table(["workload", "scheduler", "tokens", "tokens/s", "rollout wall s (mean)",
                 "short 1st result p50 s", "p95 s", "rollout-time speedup", "tokens/s vs static (min-max)"],
                table, title=f"Continuous vs static batching, {args.model} (medians of {args.rounds} rounds; "
                             "targets: long-tail >= 2x, uniform >= 0.95)")


if __name__ == "__main__":
    main()
