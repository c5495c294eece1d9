"""Replica pool scaling and routing cost: `RoutedGeneration` over 1, 2 and 4 replicas on a local Ray.

    python bench/replica_pool.py            # simulated engine at 1/2/4 replicas, routing cost, tiny model at 1/2
    python bench/replica_pool.py --quick    # fewer requests

- Simulated accelerator (nemo_rl_ext/testing/sleep_engine.py): each replica decodes `--batch` requests at a time, one
  token per `--token-ms`; it uses almost no CPU, so 2 cores can show how the pool scales. Every request
  is sent at once; throughput = requests / wall seconds; the ratio is to 1 replica, the efficiency is
  ratio / replicas (target >= 0.9 at 4).
- Routing cost: sequential one-token requests to an instant engine (no sleep) through a 1-replica pool
  against the same engine called in-process; the difference of the medians is what the pool adds per
  request (one actor round trip and the routing; target <= 2 ms).
- The real tiny model (hf, one torch thread per replica) at 1 and 2 replicas, each replica reserving one
  CPU: on a 2-core machine shared with other work this says more about the machine than the pool.
All rows are measured in the same run, one after another.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line  # noqa: E402

from nemo_rl_ext.cluster import ClusterConfig, ReplicaResources, RoutedGeneration, init_ray  # noqa: E402
from nemo_rl_ext.models.generation import GenerationConfig  # noqa: E402
from nemo_rl_ext.testing import sleep_engine  # noqa: E402


def run_all(gen, prompts, config) -> float:
    """Send every prompt at once; wall seconds until all are back."""
    async def go():
        return await asyncio.gather(*(gen.generate_async(p, config) for p in prompts))

    start = time.perf_counter()
    outs = asyncio.run(go())
    elapsed = time.perf_counter() - start
    assert len(outs) == len(prompts)
    return elapsed


def simulated(replicas: int, args) -> float:
    factory = functools.partial(sleep_engine.make_sleep_engine, args.token_ms / 1000, args.batch)
    pool = RoutedGeneration(factory, tokenizer=None, max_model_len=4096, num_replicas=replicas,
                            resources=ReplicaResources(num_cpus=0.1))
    try:
        config = GenerationConfig(max_new_tokens=args.tokens)
        run_all(pool, [[i + 1] for i in range(8 * replicas)], config)  # warm-up
        return run_all(pool, [[i + 1] for i in range(args.requests)], config)
    finally:
        pool.shutdown()


def routing_cost(n: int) -> tuple[float, float]:
    """Median seconds per sequential request: in-process engine, and through a 1-replica pool."""
    config = GenerationConfig(max_new_tokens=1)
    local = sleep_engine.SleepGeneration(token_s=0.0)
    pool = RoutedGeneration(functools.partial(sleep_engine.make_sleep_engine, 0.0, 64), tokenizer=None,
                            max_model_len=4096, num_replicas=1, resources=ReplicaResources(num_cpus=0.1))

    async def timed(gen):
        times = []
        for i in range(n):
            start = time.perf_counter()
            await gen.generate_async([i + 1], config)
            times.append(time.perf_counter() - start)
        return statistics.median(times[n // 10:])

    try:
        local_s = asyncio.run(timed(local))
        pool_s = asyncio.run(timed(pool))
    finally:
        pool.shutdown()
    return local_s, pool_s


def tiny_model(replicas: int, model_dir: Path, args) -> tuple[float, int]:
    from nemo_rl_ext.models.generation.hf_backend import HfGeneration
    from nemo_rl_ext.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    factory = functools.partial(HfGeneration.from_pretrained, str(model_dir), max_model_len=256)
    pool = RoutedGeneration(factory, tokenizer=tokenizer, max_model_len=256, num_replicas=replicas,
                            resources=ReplicaResources(num_cpus=1))
    try:
        prompts = [tokenizer(f"question {i}: what is {i} + {i}?")["input_ids"] for i in range(args.tiny_requests)]
        config = GenerationConfig(max_new_tokens=args.tiny_tokens, temperature=1.0, seed=0)
        run_all(pool, prompts[:4], config)
        elapsed = run_all(pool, prompts, config)
        return elapsed, int(pool.metrics()["cluster/tokens"])
    finally:
        pool.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--token-ms", type=float, default=5.0, help="simulated milliseconds per decode step")
    parser.add_argument("--batch", type=int, default=4, help="requests one simulated replica decodes at once")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per simulated request")
    parser.add_argument("--requests", type=int, default=384, help="simulated requests per measurement")
    parser.add_argument("--tiny-requests", type=int, default=128)
    parser.add_argument("--tiny-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.quick:
        args.requests, args.tiny_requests = 96, 16
    print(machine_line(), flush=True)
    init_ray(ClusterConfig(local_num_cpus=2))
    import ray

    ray.cloudpickle.register_pickle_by_value(sleep_engine)
    rows = []
    base = None
    for n in (1, 2, 4):
        elapsed = simulated(n, args)
        rate = args.requests / elapsed
        base = base or rate
        rows.append((f"simulated ({args.token_ms:g} ms/token, batch {args.batch})", n, args.requests, elapsed,
                     f"{rate:,.1f} req/s", rate / base, rate / base / n))
        print(f"  simulated x{n}: {elapsed:.2f} s", flush=True)
    local_s, pool_s = routing_cost(200 if args.quick else 1000)
    with tempfile.TemporaryDirectory() as tmp:
        from nemo_rl_ext.models.tiny import build_tiny_model

        model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        tiny_base = None
        for n in (1, 2):
            elapsed, tokens = tiny_model(n, model_dir, args)
            rate = tokens / elapsed
            tiny_base = tiny_base or rate
            rows.append(("tiny Qwen2 (hf, 1 CPU per replica)", n, args.tiny_requests, elapsed,
                         f"{rate:,.0f} tok/s", rate / tiny_base, rate / tiny_base / n))
            print(f"  tiny x{n}: {elapsed:.2f} s", flush=True)
    ray.shutdown()
    header = ("engine", "replicas", "requests", "wall s", "throughput", "ratio to 1", "efficiency")
    widths = [max(len(str(h)), 10) for h in header]
    widths[0] = max(len(r[0]) for r in rows)
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        cells = [r[0], str(r[1]), str(r[2]), f"{r[3]:.2f}", r[4], f"{r[5]:.2f}", f"{r[6]:.2f}"]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)))
    print()
    print(f"routing cost per request: in-process {local_s * 1e3:.3f} ms, through the pool {pool_s * 1e3:.3f} ms, "
          f"added {(pool_s - local_s) * 1e3:.3f} ms (median of sequential one-token requests)")


if __name__ == "__main__":
    main()
