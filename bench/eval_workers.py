"""An eval on 1 vs 2 Ray workers (shared prompt queue), and 2 fixed shards, on the simulated engine.

    python bench/eval_workers.py            # 128 prompts x 4 samples, uniform and long-tail lengths
    python bench/eval_workers.py --quick    # 32 prompts

- Engine: nemo_rl_ext/testing/sleep_engine.py's `SleepGeneration` (one decode step per `--token-ms`, `--batch`
  requests at a time), one per worker, built in the worker's process; it uses almost no CPU, so 2 cores can host
  two. The tiny model's tokenizer renders the prompts and decodes the ids; the math environment grades them.
- Lengths: "uniform" gives every prompt `--tokens` tokens; "long tail" gives each prompt (all its samples) a
  Pareto length (`--tokens` x Pareto(alpha 1.2), capped at 16 x `--tokens`), drawn from a hash of its prompt ids,
  so a few prompts are much longer than the rest, as hard problems are.
- Contenders, each run in full (Ray workers started, engines built, merge written) on the same local Ray:
  1 Ray worker; 2 Ray workers pulling prompts from the queue (`eval.ray_workers`); 2 fixed shards (`eval.shard`
  0/2 and 1/2, the prompts with index % 2 == I) run at once as two Ray tasks, each with its own engine. Every
  contender keeps `--in-flight` prompts in flight per engine (`eval.max_concurrent_prompts`).
- "wall s": from the start of the run to the merged summary.json (Ray workers started, engines built, merge);
  "rollout s": the slowest engine's time from opening its store to its last group (runs.jsonl), i.e. without
  starting processes; "per engine s": each engine's. Speed-ups are to 1 Ray worker.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line  # noqa: E402

from nemo_rl_ext.cluster import ClusterConfig, init_ray  # noqa: E402
from nemo_rl_ext.config import load_config  # noqa: E402
from nemo_rl_ext.evals.config import EvalConfig  # noqa: E402
from nemo_rl_ext.models.generation import GenerationConfig  # noqa: E402
from nemo_rl_ext.testing.sleep_engine import SleepGeneration  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def tail_length(tokens: int, tail: bool, prompt_token_ids: Sequence[int], config: GenerationConfig) -> int:
    """A prompt's length (all its samples): `tokens`, or a Pareto draw from the prompt's ids (`tail`)."""
    if not tail:
        return tokens
    rng = random.Random(zlib.crc32(bytes(str(list(prompt_token_ids)), "ascii")))
    return min(16 * tokens, int(tokens * rng.paretovariate(1.2)))


def make_engine(tokenizer_dir: str, token_s: float, batch: int, tokens: int, tail: bool) -> SleepGeneration:
    """The factory each worker calls in its own process: the sleep engine with `tail_length` lengths."""
    from transformers import AutoTokenizer

    return SleepGeneration(token_s=token_s, max_batch_size=batch, tag=0,
                           tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
                           length=functools.partial(tail_length, tokens, tail))


def fixed_shard(cfg: EvalConfig, factory) -> bool:  # noqa: ANN001
    """One static shard with its own engine (a Ray task); True when it merged (it finished last)."""
    from nemo_rl_ext.evals.driver import run_eval

    gen = factory()
    try:
        return run_eval(cfg, generation=gen, progress=False).summary is not None
    finally:
        gen.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 prompts (a smoke run)")
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--token-ms", type=float, default=5.0, help="simulated milliseconds per decode step")
    parser.add_argument("--batch", type=int, default=8, help="requests one simulated engine decodes at once")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per sample (the tail's scale)")
    parser.add_argument("--in-flight", type=int, default=2, help="prompts in flight per engine")
    args = parser.parse_args()
    if args.quick:
        args.prompts = 32
    print(machine_line(), flush=True)
    init_ray(ClusterConfig(local_num_cpus=2))
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    from nemo_rl_ext.evals.ray_lease_queue import run_ray_eval
    from nemo_rl_ext.models.tiny import build_tiny_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        data = Path(tmp) / "data.jsonl"
        rng = random.Random(0)
        with open(data, "w") as f:
            for i in range(args.prompts):
                a, b = rng.randrange(100), rng.randrange(100)
                f.write(json.dumps({"id": f"q{i}", "question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")

        def config(save: str, *extra: str) -> EvalConfig:
            return load_config(REPO / "examples/configs/evals/eval.yaml", [
                f"policy.model_name={model_dir}", f"eval.dataset_path={data}", f"eval.save_path={Path(tmp) / save}",
                f"eval.num_prompts={args.prompts}", f"rollouts.num_generations_per_prompt={args.samples}",
                "eval.ks=[1]", f"eval.max_concurrent_prompts={args.in_flight}",
                f"policy.generation.max_new_tokens={16 * args.tokens}", "policy.max_model_len=4096",
                "rollouts.max_seq_len=4096", "policy.cluster={replica: {num_cpus: 0.5}}", *extra], EvalConfig)

        for tail in (False, True):
            label = "long tail" if tail else "uniform"
            factory = functools.partial(make_engine, str(model_dir), args.token_ms / 1000, args.batch, args.tokens,
                                        tail)
            base = None
            for name, workers in (("1 Ray worker", 1), ("2 Ray workers (queue)", 2), ("2 fixed shards", 0)):
                save = f"{label.replace(' ', '_')}-{workers}"
                start = time.perf_counter()
                if workers:
                    result = run_ray_eval(config(save, f"eval.ray_workers={workers}"), engine_factory=factory,
                                          progress=False)
                    assert result.summary is not None
                else:
                    task = ray.remote(num_cpus=0.5)(fixed_shard)
                    merged = ray.get([task.remote(config(save, f"eval.shard={i}/2"), factory) for i in range(2)])
                    assert any(merged)
                elapsed = time.perf_counter() - start
                summary = json.loads((Path(tmp) / save / "summary.json").read_text())
                assert summary["num_completions"] == args.prompts * args.samples
                # each engine's rollout time (store opened to last group written, runs.jsonl): without the Ray
                # worker's start and the engine's build; the slowest engine sets the pace
                stores = sorted((Path(tmp) / save / "shards").iterdir())
                walls = [json.loads((s / "runs.jsonl").read_text().splitlines()[-1])["wall_time_s"] for s in stores]
                rollout = max(walls)
                base = base or (elapsed, rollout)
                rows.append((label, name, elapsed, base[0] / elapsed, rollout, base[1] / rollout,
                             " / ".join(f"{w:.1f}" for w in walls)))
                print(f"  {label}, {name}: {elapsed:.2f} s, per engine {rows[-1][-1]} s", flush=True)
    ray.shutdown()
    header = ("lengths", "contender", "wall s", "speed-up", "rollout s", "speed-up", "per engine s")
    widths = [max(len(h), 9) for h in header]
    widths[1] = max(len(r[1]) for r in rows)
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        cells = [r[0], r[1], f"{r[2]:.1f}", f"{r[3]:.2f}", f"{r[4]:.1f}", f"{r[5]:.2f}", r[6]]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))
    print(f"\n{args.prompts} prompts x {args.samples} samples, {args.token_ms:g} ms/token, batch {args.batch}, "
          f"{args.in_flight} prompts in flight per engine, {args.tokens} tokens (uniform) / Pareto tail")


if __name__ == "__main__":
    main()
