"""Run by test_ray_multinode.py in a subprocess: a simulated two-node Ray cluster (`ray.cluster_utils.Cluster`)
on 127.0.0.1, a pool of two simulated-engine replicas spread over the nodes, one node removed mid-run.

Usage: ray_two_nodes.py TEMP_DIR. Prints one JSON line of findings (prefixed "RESULT ") and exits 0; any
failed check raises. The environment must hold RAY_USAGE_STATS_ENABLED=0 and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys

import ray
from ray.cluster_utils import Cluster

from nemo_rl_ext.cluster import ClusterConfig, ReplicaResources, RoutedGeneration, init_ray
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.testing import sleep_engine

NODE = {"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 1024 * 1024}


def main(temp_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 0, "temp_dir": temp_dir})
    pool = None
    try:
        nodes = [cluster.add_node(**NODE) for _ in range(2)]
        cluster.wait_for_nodes()
        started = init_ray(ClusterConfig(address=cluster.address))
        ray.cloudpickle.register_pickle_by_value(sleep_engine)
        addresses = sorted({n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]})
        alive = sum(n["Alive"] for n in ray.nodes())
        factory = functools.partial(sleep_engine.make_sleep_engine, 0.01, 4)
        pool = RoutedGeneration(factory, tokenizer=None, max_model_len=4096, num_replicas=2,
                                resources=ReplicaResources(num_cpus=0.5), owns_ray=started)
        worker_ids = {n.node_id for n in nodes}
        placed = [info["node_id"] for info in pool.replica_info]
        assert set(placed) == worker_ids, (placed, worker_ids)  # one replica on each worker node
        victim_index = 1
        victim_node = next(n for n in nodes if n.node_id == placed[victim_index])
        survivor = next(n for n in nodes if n is not victim_node)

        async def run():
            prompts = [[1000 + i] for i in range(40)]
            tasks = [asyncio.ensure_future(pool.generate_async(p, GenerationConfig(max_new_tokens=30)))
                     for p in prompts]
            await asyncio.sleep(0.5)  # both replicas are decoding
            in_flight = [r.in_flight for r in pool._replicas]
            await asyncio.to_thread(cluster.remove_node, victim_node, False)  # the node is lost, not drained
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return prompts, outs, in_flight

        prompts, outs, in_flight = asyncio.run(run())
        assert all(n > 0 for n in in_flight), in_flight
        assert len(outs) == 40
        for prompt, out in zip(prompts, outs, strict=True):  # every request answered, each by its own prompt
            assert len(out.output_ids) == 30 and out.output_ids[1] == (prompt[0] + 1) % 1000
        after_loss = pool.metrics()
        restarted, replaced_on_lost_node = None, 0
        while restarted is None:
            replica = pool._replicas[victim_index]
            incarnation = replica.incarnation
            try:
                restarted = ray.get(replica.actor.ready.remote(), timeout=120)
            except ray.exceptions.ActorDiedError as exc:
                # The pool restarts a replica the moment a request fails, before Ray has declared the lost
                # node dead (missed heartbeats, seconds later), so Ray may still place the replacement there
                # (seen once, in a full suite on a loaded machine). It dies unstarted; a request failing on it
                # restarts it again, as this does. Only that case is let through, once.
                assert victim_node.node_id in str(exc) and not replaced_on_lost_node, str(exc)
                replaced_on_lost_node += 1
                pool._replica_failed(replica, incarnation, exc)

        async def serve_again():
            calls = (pool.generate_async([i], GenerationConfig(max_new_tokens=2)) for i in range(8))
            return await asyncio.wait_for(asyncio.gather(*calls), 120)

        again = asyncio.run(serve_again())
        final = pool.metrics()
        result = {
            "addresses": addresses,
            "alive_nodes_at_start": alive,
            "placed_on_distinct_workers": len(set(placed)) == 2,
            "in_flight_at_loss": in_flight,
            "answers": len(outs),
            "retries": after_loss["cluster/retries"],
            "restarts": after_loss["cluster/restarts"],
            "replaced_on_lost_node": replaced_on_lost_node,
            "restarts_in_all": final["cluster/restarts"],
            "restarted_on_survivor": restarted["node_id"] == survivor.node_id,
            "served_after_recovery": [final[f"cluster/replica/{i}/requests"]
                                      - after_loss[f"cluster/replica/{i}/requests"] for i in (0, 1)],
            "tags_after_recovery": len({o.output_ids[0] for o in again}),
            "replicas_live": final["cluster/replicas_live"],
        }
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        if pool is not None:
            pool.shutdown()  # kills the actors and, having joined this cluster, disconnects from it
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
