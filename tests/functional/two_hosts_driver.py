"""Run by test_two_hosts.py inside a network namespace (`ip netns exec`): a driver on one of two hosts of a real
Ray cluster, joined through the project's own config (`policy.cluster.address`, `init_ray`). It writes what it
found as JSON into the folder both hosts share and exits 0; a trainer rank lost exits 3 with the error's text.

Usage:
  two_hosts_driver.py pool ADDRESS SHARED       a pool of 2 replicas spread over the nodes; 40 requests, the worker
                                               host lost while they run (the test kills it when `SHARED/in_flight`
                                               appears, then writes `SHARED/lost`)
  two_hosts_driver.py eval SHARED OVERRIDE...   examples/configs/evals/eval.yaml with the overrides, on Ray workers
  two_hosts_driver.py grpo CONFIG SHARED OVERRIDE...   GRPO with the overrides
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120.0


def node_ips() -> dict[str, str]:
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}


def pool(address: str, shared: Path) -> dict:
    """2 simulated-engine replicas (spread), 40 requests, the worker host lost mid-run: every request answered."""
    import ray

    from nemo_rl_ext.cluster import ClusterConfig, ReplicaResources, RoutedGeneration, init_ray
    from nemo_rl_ext.models.generation import GenerationConfig
    from nemo_rl_ext.testing import sleep_engine

    started = init_ray(ClusterConfig(address=address))
    ray.cloudpickle.register_pickle_by_value(sleep_engine)
    factory = functools.partial(sleep_engine.make_sleep_engine, 0.02, 4)  # 40 requests of 50 tokens: ~5 s
    gen = RoutedGeneration(factory, tokenizer=None, max_model_len=4096, num_replicas=2,
                           resources=ReplicaResources(num_cpus=0.5), owns_ray=started)
    try:
        ips = node_ips()
        placed = [ips[info["node_id"]] for info in gen.replica_info]

        async def run():
            prompts = [[1000 + i] for i in range(40)]
            tasks = [asyncio.ensure_future(gen.generate_async(p, GenerationConfig(max_new_tokens=50))) for p in prompts]
            await asyncio.sleep(0.5)
            in_flight = [r.in_flight for r in gen._replicas]
            (shared / "in_flight").write_text(json.dumps(in_flight))
            deadline = time.monotonic() + WAIT_S
            while not (shared / "lost").exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            outs = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
            again = await asyncio.wait_for(asyncio.gather(
                *(gen.generate_async([i], GenerationConfig(max_new_tokens=2)) for i in range(8))), WAIT_S)
            return prompts, outs, in_flight, again

        prompts, outs, in_flight, again = asyncio.run(run())
        answered = sum(len(o.output_ids) == 50 and o.output_ids[1] == (p[0] + 1) % 1000
                       for p, o in zip(prompts, outs, strict=True))
        metrics = gen.metrics()
        live = [ips.get(info["node_id"]) for info in ray.get([r.actor.ready.remote() for r in gen._replicas
                                                                if not r.removed], timeout=WAIT_S)]
        return {"placed": placed, "in_flight_at_loss": in_flight, "answered": answered, "requests": len(prompts),
                "retries": metrics["cluster/retries"], "restarts": metrics["cluster/restarts"],
                "answered_after": len(again), "live_replicas_on": live}
    finally:
        gen.shutdown()


def record_node(folder: Path, deadline_s: float = WAIT_S):
    """An eval worker hook (pickled by value): after its first prompt is on disk, a worker writes its node's address
    to `folder/<worker>` and waits (at most `deadline_s`) until the other worker has written one too."""

    def on_written(worker: str, group: int, prompt: int) -> None:
        import ray

        mine = folder / worker
        if mine.exists():
            return
        mine.write_text(ray.util.get_node_ip_address())
        end = time.monotonic() + deadline_s
        while len(list(folder.iterdir())) < 2 and time.monotonic() < end:
            time.sleep(0.05)

    return on_written


def evaluate(shared: Path, overrides: list[str]) -> dict:
    """The eval config with `overrides` on `eval.ray_workers` Ray workers (the cluster of `policy.cluster.address`)."""
    from nemo_rl_ext.config import load_config
    from nemo_rl_ext.evals.config import EvalConfig
    from nemo_rl_ext.evals.ray_lease_queue import run_ray_eval

    cfg = load_config(REPO / "examples/configs/evals/eval.yaml", overrides, EvalConfig)
    met = shared / "worker_nodes"
    met.mkdir(exist_ok=True)
    result = run_ray_eval(cfg, progress=False, on_written=record_node(met))
    return {"complete": result.complete, "groups_generated": result.groups_generated,
            "worker_nodes": {p.name: p.read_text() for p in met.iterdir()}}


def grpo(config: Path, overrides: list[str]) -> tuple[dict, int]:
    """GRPO with `overrides`: where the trainer's ranks ran, or the error that stopped it (exit 3)."""
    from nemo_rl_ext.config import load_config
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.loop import GRPO
    from nemo_rl_ext.training.distributed_trainer import TrainerWorkerError

    cfg = load_config(config, overrides, GRPOConfig)
    workers: list[dict] = []
    try:
        with GRPO(cfg) as run:
            workers = list(getattr(run.trainer, "workers", []))
            start = run.step
            run.run()
            return {"workers": workers, "resumed_from": start, "step": run.step}, 0
    except TrainerWorkerError as err:
        return {"workers": workers, "error": str(err), "raised_at": time.time()}, 3


def main(argv: list[str]) -> int:
    command, rest = argv[0], argv[1:]
    code = 0
    if command == "pool":
        shared = Path(rest[1])
        result = pool(rest[0], shared)
    elif command == "eval":
        shared = Path(rest[0])
        result = evaluate(shared, rest[1:])
    else:
        shared = Path(rest[1])
        result, code = grpo(Path(rest[0]), rest[2:])
    (shared / f"{command}.json").write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
