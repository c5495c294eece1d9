"""Asynchronous GRPO against synchronous GRPO: training steps per second, with the lag histogram.

    python bench/async_grpo.py              # simulated engine (30 steps each), then the real tiny model
    python bench/async_grpo.py --quick      # fewer steps
    python bench/async_grpo.py --no-real    # the simulated rows only
    python bench/async_grpo.py --smoke      # a few simulated steps in about a second (the test suite's check)

- Simulated (the claim): the sleep-per-token engine (nemo_rl_ext/testing/sleep_engine.py, a batch step costs
  the same whatever it holds, as on an accelerator, and a weight update waits for the requests in flight as
  the real engines' do) with long-tail lengths: 10 % of requests generate 16x more tokens (`--tokens` vs
  16 x `--tokens`, `LongTail`, chosen by a hash of the prompt and seed, so every contender sees the same
  lengths). A step is `--prompts` groups of `--samples`, one turn each; the trainer step is simulated by
  `--train-s` of sleep on a worker thread, then `update_weights` on that thread (as GRPO refits). The
  synchronous row rolls out a step's prompts with `RolloutManager.run_rollouts`, trains, refits (the
  synchronous loop); the asynchronous rows run `AsyncCollector` (the collector `grpo.async` uses) at
  max_lag 1 and 2, with refits in `finish` mode (the refit waits for the longest request in flight) and in
  `abort` mode (requests stop at their next token and continue on the new weights).
  Steps/s = steps / wall seconds from the first rollout to the last refit.
- Real tiny model (honesty): the whole GRPO run (`GRPO.run`) on the say-"yes" task of
  tests/functional/test_grpo.py, sync and async (max_lag 1 and 2), generation and training sharing this
  machine's cores: on 2 CPU cores both compete for the same cores, so overlap gains little.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line  # noqa: E402

from nemo_rl_ext.data.records import DatumSpec, Message  # noqa: E402
from nemo_rl_ext.experience.rollout_manager import RolloutManager  # noqa: E402
from nemo_rl_ext.grpo.async_collector import AsyncCollector  # noqa: E402
from nemo_rl_ext.grpo.config import AsyncSettings  # noqa: E402
from nemo_rl_ext.grpo.prompt_stream import PromptStream  # noqa: E402
from nemo_rl_ext.grpo.step_seeds import SaltedGeneration  # noqa: E402
from nemo_rl_ext.models.generation.interfaces import GenerationConfig  # noqa: E402
from nemo_rl_ext.objectives.staleness import lag_histogram  # noqa: E402
from nemo_rl_ext.testing import LongTail, ScriptedEnvironment, SleepGeneration  # noqa: E402

SIMULATED = (("sync", 0, "finish", 0), ("async", 1, "finish", 0), ("async", 1, "abort", 0), ("async", 2, "finish", 0),
             ("async", 2, "abort", 0), ("async", 2, "abort", 4))
"""(loop, max_lag, in_flight, oversample) of each simulated contender."""


def simulated_setup(args: argparse.Namespace):
    from nemo_rl_ext.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    engine = SleepGeneration(token_s=args.token_ms / 1000, max_batch_size=4096, tag=1, tokenizer=tokenizer,
                             length=LongTail(args.tokens, 16 * args.tokens))
    generation = SaltedGeneration(engine)
    env = ScriptedEnvironment(reward=lambda s: float(len(s.reply) % 3))
    manager = RolloutManager(tokenizer, {"t": env}, args.samples, 4096, policy_generation=generation,
                             generation_config=GenerationConfig(max_new_tokens=16 * args.tokens, seed=7))
    datums = [DatumSpec(i, (Message("user", f"q{i}", (10 + i % 500, 11 + i % 7)),), "t") for i in range(512)]
    return engine, generation, manager, PromptStream(datums, seed=0)


async def run_sync(args: argparse.Namespace) -> dict:
    engine, generation, manager, stream = simulated_setup(args)
    executor = ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()
    refit_s = 0.0
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        generation.salt = (1, step, 0)
        await manager.run_rollouts(stream.next(args.prompts), progress=False)
        await loop.run_in_executor(executor, time.sleep, args.train_s)
        refit = time.perf_counter()
        await loop.run_in_executor(executor, engine.update_weights, {})
        refit_s += time.perf_counter() - refit
    wall = time.perf_counter() - start
    executor.shutdown()
    return {"steps_s": args.steps / wall, "hist": {0: args.steps * args.prompts}, "dropped": 0, "surplus": 0,
            "idle": None, "wait": None, "refit": refit_s / args.steps}


async def run_async(args: argparse.Namespace, max_lag: int, in_flight: str, oversample: int) -> dict:
    engine, generation, manager, stream = simulated_setup(args)
    settings = AsyncSettings(enabled=True, max_lag=max_lag, in_flight=in_flight, oversample=oversample)
    collector = AsyncCollector(manager, stream, settings, per_step=args.prompts, version=0, offset=0,
                               salt_prefix=1)
    executor = ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()
    metrics = []
    refit_s = 0.0
    start = time.perf_counter()
    collector.start()
    try:
        for step in range(1, args.steps + 1):
            taken = await collector.take(final=step == args.steps)
            await collector.guard(loop.run_in_executor(executor, time.sleep, args.train_s))
            refit = time.perf_counter()
            await collector.guard(loop.run_in_executor(executor, lambda: engine.update_weights({}, in_flight=in_flight)))
            refit_s += time.perf_counter() - refit
            collector.set_version(step)
            metrics.append(taken.metrics)
    finally:
        wall = time.perf_counter() - start
        await collector.aclose()
        executor.shutdown()
    total = {key: sum(m[key] for m in metrics) for key in
             ("async/groups/dropped_stale", "async/groups/cancelled_stale", "async/groups/oversampled_discarded",
              "async/generation_idle_s", "async/trainer_wait_s")}
    return {"steps_s": args.steps / wall, "hist": lag_histogram(metrics),
            "dropped": int(total["async/groups/dropped_stale"] + total["async/groups/cancelled_stale"]),
            "surplus": int(total["async/groups/oversampled_discarded"]), "idle": total["async/generation_idle_s"],
            "wait": total["async/trainer_wait_s"] / args.steps, "refit": refit_s / args.steps}


def real_rows(args: argparse.Namespace) -> list[tuple[str, float, float, dict]]:
    import yaml

    from nemo_rl_ext.config import load_config
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.loop import GRPO
    from nemo_rl_ext.grpo.metrics_logger import read_metrics
    from nemo_rl_ext.models.tiny import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="async_grpo_bench_"))
    model = build_tiny_model(root / "model", seed=0, initializer_range=0.05)
    words = ("apple", "river", "blue", "seven", "cat", "hello", "tree", "water")
    data = root / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n" for w in words))
    cfg = {
        "policy": {"model_name": str(model), "max_model_len": 256,
                   "generation": {"max_new_tokens": 8, "temperature": 1.0, "stop_strings": ["yes"]}},
        "rollouts": {"env": {"name": "string_match", "kwargs": {"mode": "similarity"}},
                     "num_generations_per_prompt": 16, "max_seq_len": 128},
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 4, "max_num_steps": args.real_steps, "seed": 42},
        "optimizer": {"lr": 3.0e-3, "micro_batch_size": 16, "max_grad_norm": 1.0},
        # the loss the rows in docs/async-grpo.md were measured with (before the defaults became NeMo-RL's: KL 0.01, IS off)
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = []
    contenders = [("sync", [])] + [
        (f"async max_lag={lag} {mode}", ["grpo.async.enabled=true", f"grpo.async.max_lag={lag}",
                                         f"grpo.async.in_flight={mode}"])
        for lag in (1, 2) for mode in ("finish", "abort")
    ]
    for name, overrides in contenders:
        out = root / name.replace(" ", "_").replace("=", "")
        with GRPO(load_config(path, [f"output_dir={out}", *overrides], GRPOConfig)) as grpo:
            start = time.perf_counter()
            grpo.run()
            wall = time.perf_counter() - start
        metrics = read_metrics(out / "metrics.jsonl")
        hist = lag_histogram(metrics) or {0: 4 * args.real_steps}
        reward = sum(m["rollout/reward/mean"] for m in metrics[-5:]) / 5
        rows.append((name, args.real_steps / wall, reward, hist))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30, help="simulated steps per contender")
    parser.add_argument("--prompts", type=int, default=8, help="groups per step")
    parser.add_argument("--samples", type=int, default=8, help="samples per group")
    parser.add_argument("--tokens", type=int, default=16, help="tokens of a short request (a long one: 16x)")
    parser.add_argument("--token-ms", type=float, default=2.0, help="simulated ms per decode step")
    parser.add_argument("--train-s", type=float, default=0.25, help="simulated trainer step, seconds")
    parser.add_argument("--real-steps", type=int, default=20, help="steps of the real tiny-model runs")
    parser.add_argument("--quick", action="store_true", help="10 simulated and 8 real steps")
    parser.add_argument("--no-real", action="store_true", help="skip the real tiny model")
    parser.add_argument("--smoke", action="store_true", help="3 fast simulated steps, no real model (a check)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.real_steps = 10, 8
    if args.smoke:
        args.steps, args.token_ms, args.train_s, args.tokens, args.no_real = 3, 0.2, 0.02, 4, True
    import torch

    torch.set_num_threads(1)
    print(machine_line())
    print(f"simulated: {args.prompts} groups x {args.samples} samples per step, {args.tokens} tokens "
          f"(10 % of requests: {16 * args.tokens}) at {args.token_ms} ms/token, trainer step {args.train_s} s, "
          f"{args.steps} steps\n")
    print("| contender | steps/s | vs sync | lag histogram (groups) | stale (dropped + cancelled) | "
          "over-sampled, discarded | trainer wait s/step | refit s/step | generation idle s |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    base = None
    for loop, max_lag, in_flight, oversample in SIMULATED:
        if loop == "sync":
            result, label = asyncio.run(run_sync(args)), "sync"
        else:
            result = asyncio.run(run_async(args, max_lag, in_flight, oversample))
            label = f"async max_lag={max_lag} {in_flight}" + (f" oversample={oversample}" if oversample else "")
        base = base or result["steps_s"]
        hist = " ".join(f"{k}: {v}" for k, v in result["hist"].items())
        wait = "-" if result["wait"] is None else f"{result['wait']:.3f}"
        idle = "-" if result["idle"] is None else f"{result['idle']:.2f}"
        print(f"| {label} | {result['steps_s']:.2f} | {result['steps_s'] / base:.2f} | {hist} | {result['dropped']} "
              f"| {result['surplus']} | {wait} | {result['refit']:.3f} | {idle} |", flush=True)
    if not args.no_real:
        print(f"\nreal tiny model (say-yes task, 4 prompts x 16 samples, {args.real_steps} steps, hf engine, "
              "1 torch thread):\n")
        print("| contender | steps/s | vs sync | reward (last 5 steps) | lag histogram (groups) |")
        print("| --- | ---: | ---: | ---: | --- |")
        rows = real_rows(args)
        base = rows[0][1]
        for name, rate, reward, hist in rows:
            print(f"| {name} | {rate:.2f} | {rate / base:.2f} | {reward:.3f} | "
                  f"{' '.join(f'{k}: {v}' for k, v in hist.items())} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
