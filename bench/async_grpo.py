"""Asynchronous GRPO against synchronous GRPO: training steps per second, with the lag histogram.

    python bench/async_grpo.py              # simulated engine (30 steps each), then the real tiny model
    python bench/async_grpo.py --quick      # fewer steps
    python bench/async_grpo.py --no-real    # the simulated rows only

- Simulated (the claim): the sleep-per-token engine (nemo_rl_ext/testing/sleep_engine.py, a batch step costs
  the same whatever it holds, as on an accelerator) with long-tail lengths: 10 % of requests generate 16x
  more tokens (`--tokens` vs 16 x `--tokens`, chosen by a hash of the prompt and seed, so every contender
  sees the same lengths). A step is `--prompts` groups of `--samples`, one turn each; the trainer step is
  simulated by `--train-s` of sleep on a worker thread, then `update_weights`. The synchronous row rolls out
  a step's prompts with `RolloutManager.run_rollouts`, trains, refits (today's loop); the asynchronous rows
  run `AsyncCollector` (the collector `grpo.async` uses) at max_lag 1 and 2, with refits in `finish` mode.
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
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line  # noqa: E402

from nemo_rl_ext.algorithms.async_collector import AsyncCollector  # noqa: E402
from nemo_rl_ext.algorithms.grpo_config import AsyncSettings  # noqa: E402
from nemo_rl_ext.algorithms.prompt_stream import PromptStream  # noqa: E402
from nemo_rl_ext.algorithms.staleness import lag_histogram  # noqa: E402
from nemo_rl_ext.algorithms.step_seeds import SaltedGeneration  # noqa: E402
from nemo_rl_ext.data.records import DatumSpec, Message  # noqa: E402
from nemo_rl_ext.experience.rollout_manager import RolloutManager  # noqa: E402
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationOutput  # noqa: E402
from nemo_rl_ext.testing import ScriptedEnvironment, SleepGeneration  # noqa: E402


class LongTailSleep(SleepGeneration):
    """The sleep engine with long-tail lengths: one request in ten generates `long` tokens, the rest `short`."""

    def __init__(self, short: int, long: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.short, self.long = short, long

    async def generate_async(self, prompt_token_ids: Sequence[int], config: GenerationConfig) -> GenerationOutput:
        key = zlib.crc32(json.dumps([list(prompt_token_ids), config.seed]).encode())
        n = self.long if key % 10 == 0 else self.short
        return await super().generate_async(prompt_token_ids, config.model_copy(update={"max_new_tokens": n}))


def simulated_setup(args: argparse.Namespace):
    from nemo_rl_ext.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    engine = LongTailSleep(args.tokens, 16 * args.tokens, token_s=args.token_ms / 1000, max_batch_size=4096,
                           tag=1, tokenizer=tokenizer)
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
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        generation.salt = (1, step, 0)
        await manager.run_rollouts(stream.next(args.prompts), progress=False)
        await loop.run_in_executor(executor, time.sleep, args.train_s)
        engine.update_weights({})
    wall = time.perf_counter() - start
    executor.shutdown()
    return {"steps_s": args.steps / wall, "wall": wall, "hist": {0: args.steps * args.prompts}, "dropped": 0}


async def run_async(args: argparse.Namespace, max_lag: int, oversample: int) -> dict:
    engine, generation, manager, stream = simulated_setup(args)
    settings = AsyncSettings(enabled=True, max_lag=max_lag, oversample=oversample)
    collector = AsyncCollector(manager, stream, settings, per_step=args.prompts, version=0, offset=0,
                               salt_prefix=1)
    executor = ThreadPoolExecutor(1)
    loop = asyncio.get_running_loop()
    metrics = []
    start = time.perf_counter()
    collector.start()
    try:
        for step in range(1, args.steps + 1):
            taken = await collector.take()
            await collector.guard(loop.run_in_executor(executor, time.sleep, args.train_s))
            await collector.guard(loop.run_in_executor(executor, engine.update_weights, {}))
            collector.set_version(step)
            metrics.append(taken.metrics)
    finally:
        wall = time.perf_counter() - start
        await collector.aclose()
        executor.shutdown()
    dropped = sum(m["async/groups/discarded"] for m in metrics)
    idle = sum(m["async/generation_idle_s"] for m in metrics)
    return {"steps_s": args.steps / wall, "wall": wall, "hist": lag_histogram(metrics), "dropped": int(dropped),
            "idle": idle}


def real_rows(args: argparse.Namespace) -> list[tuple[str, float, float, dict]]:
    import yaml

    from nemo_rl_ext.algorithms.grpo import GRPO
    from nemo_rl_ext.algorithms.grpo_config import GRPOConfig
    from nemo_rl_ext.algorithms.metrics_logger import read_metrics
    from nemo_rl_ext.config import load_config
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
        "logger": {"progress": False, "tensorboard": False, "print_steps": False},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rows = []
    for name, overrides in (("sync", []), ("async max_lag=1", ["grpo.async.enabled=true", "grpo.async.max_lag=1"]),
                            ("async max_lag=2", ["grpo.async.enabled=true", "grpo.async.max_lag=2"])):
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
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.real_steps = 10, 8
    import torch

    torch.set_num_threads(1)
    print(machine_line())
    print(f"simulated: {args.prompts} groups x {args.samples} samples per step, {args.tokens} tokens "
          f"(10 % of requests: {16 * args.tokens}) at {args.token_ms} ms/token, trainer step {args.train_s} s, "
          f"{args.steps} steps\n")
    print("| contender | steps/s | vs sync | lag histogram (groups) | groups discarded | generation idle s |")
    print("| --- | ---: | ---: | --- | ---: | ---: |")
    sync = asyncio.run(run_sync(args))
    print(f"| sync | {sync['steps_s']:.2f} | 1.00 | 0: {sync['hist'][0]} | 0 | - |")
    for max_lag, oversample in ((1, 0), (2, 0), (2, args.prompts // 2)):
        result = asyncio.run(run_async(args, max_lag, oversample))
        hist = " ".join(f"{k}: {v}" for k, v in result["hist"].items())
        label = f"async max_lag={max_lag}" + (f" oversample={oversample}" if oversample else "")
        print(f"| {label} | {result['steps_s']:.2f} | {result['steps_s'] / sync['steps_s']:.2f} | {hist} | "
              f"{result['dropped']} | {result['idle']:.2f} |")
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
