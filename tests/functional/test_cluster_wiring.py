"""`policy.cluster` end to end on the session's Ray: the eval driver and GRPO generate through a pool of two
replicas (`cluster.build_policy_generation`), the nemo_gym mode fronts the pool with one policy server URL,
and an abort-mode refit of the pool returns partial outputs under the old version."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
from pathlib import Path

import orjson
import pytest

import nemo_rl_ext.cluster as cluster
from nemo_rl_ext.cluster import RoutedGeneration
from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.models.generation.hf_backend import HfGeneration

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)
POOL = {"num_replicas": 2, "replica": {"num_cpus": 0.5}}
"""Two replicas of half a CPU each: they fit the session's 2-CPU Ray beside other tests' actors."""


@pytest.fixture
def pools(monkeypatch):
    """Every generation `build_policy_generation` builds during the test (the driver shuts it down itself)."""
    built = []
    real = cluster.build_policy_generation

    def spy(*args, **kwargs):
        gen = real(*args, **kwargs)
        built.append(gen)
        return gen

    monkeypatch.setattr(cluster, "build_policy_generation", spy)
    return built


def served(pool: RoutedGeneration) -> list[float]:
    m = pool.metrics()
    return [m[f"cluster/replica/{i}/requests"] for i in range(2)]


def check_session_ray_kept(ray, pool: RoutedGeneration, within_s: float = 60.0) -> None:
    """The pool's shutdown killed its actors but left the session's Ray (started by the fixture) running.
    `ray.kill` takes effect asynchronously: a call sent right after it may still be served (seen once on a
    loaded machine), so each replica must stop answering within `within_s`."""
    assert ray.is_initialized()
    deadline = time.monotonic() + within_s
    for replica in pool._replicas:
        while True:
            try:
                ray.get(replica.actor.ready.remote(), timeout=within_s)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, f"a replica still answers {within_s:g} s after the pool's shutdown"
            time.sleep(0.2)


def test_the_eval_driver_generates_on_a_two_replica_pool(local_ray, tiny_model_dir, tmp_path, pools):
    cfg = EvalConfig.model_validate({
        "eval": {"dataset_path": str(REPO / "examples/data/arithmetic.jsonl"),
                 "save_path": str(tmp_path / "eval"), "num_prompts": 6, "ks": [1, 2]},
        "rollouts": {"mode": "native", "max_rollout_turns": 1, "num_generations_per_prompt": 2, "max_seq_len": 256,
                     "env": {"name": "math"}},
        "policy": {"model_name": str(tiny_model_dir), "max_model_len": 512, "cluster": POOL,
                   "generation": {"max_new_tokens": 8, "temperature": 1.0, "seed": 0}},
    })
    result = run_eval(cfg, progress=False)
    assert result.complete and result.groups_generated == 6 and result.errors_written == 0
    (pool,) = pools
    assert isinstance(pool, RoutedGeneration)
    counts = served(pool)
    assert sum(counts) == 12 and min(counts) >= 1, counts  # both replicas served
    lines = [json.loads(x) for x in (tmp_path / "eval" / "completions.jsonl").read_text().splitlines()]
    assert sorted((x["prompt_idx"], x["sample_idx"]) for x in lines) == [(p, s) for p in range(6) for s in range(2)]
    assert all(x["stop_reason"] != "error" and x["message_log"][-1]["role"] == "assistant" for x in lines)
    assert result.summary["status"] != "errors_left"
    check_session_ray_kept(local_ray, pool)


def grpo_config(model_dir: Path, tmp_path: Path) -> GRPOConfig:
    data = tmp_path / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n"
                            for w in ("apple", "river", "blue", "seven")))
    return GRPOConfig.model_validate({
        "policy": {"model_name": str(model_dir), "max_model_len": 256, "cluster": POOL,
                   "generation": {"max_new_tokens": 8, "temperature": 1.0, "stop_strings": ["yes"]}},
        "rollouts": {"num_generations_per_prompt": 4, "max_seq_len": 128,
                     "env": {"name": "string_match", "kwargs": {"mode": "similarity"}}},
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 2, "max_num_steps": 2, "seed": 42},
        "optimizer": {"lr": 3.0e-3, "micro_batch_size": 8},
        # the loss before the defaults became NeMo-RL's (KL 0.01, IS off)
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
        "output_dir": str(tmp_path / "run"),
    })


def test_grpo_trains_on_a_two_replica_pool_and_refits_both(local_ray, tiny_model_dir, tmp_path):
    cfg = grpo_config(tiny_model_dir, tmp_path)
    with GRPO(cfg) as grpo:
        pool = grpo.generation.inner
        assert isinstance(pool, RoutedGeneration)
        history = grpo.run()
        assert pool.weight_version == 2  # one refit per step
        versions = local_ray.get([r.actor.weight_version.remote() for r in pool._replicas], timeout=60)
        assert versions == [2, 2]  # the refit reached both replicas
        counts = served(pool)
    assert [m["step"] for m in history] == [1, 2]
    assert sum(counts) == 16 and min(counts) >= 1, counts
    for m in history:
        assert m["train/optimizer_steps"] > 0
        assert m["cluster/weight_version"] == m["step"]
        # the replicas' logprobs are the trainer's: the pool starts from (and is refit to) its weights
        assert abs(m["train/gen_kl/mean"]) < 1e-4, m["train/gen_kl/mean"]
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["cluster/requests"] for m in logged] == [8.0, 16.0]
    check_session_ray_kept(local_ray, pool)


@pytest.mark.gym
@pytest.mark.timeout(900)
def test_a_nemo_gym_eval_sees_one_policy_url_in_front_of_the_pool(local_ray, gym_venv, tiny_model_dir, tmp_path,
                                                                  pools):
    cfg = load_config(
        REPO / "examples" / "configs" / "evals" / "nemo_gym_eval.yaml",
        [
            f"eval.save_path={tmp_path / 'eval'}",
            f"eval.dataset_path={REPO / 'examples' / 'data' / 'gym_arithmetic.jsonl'}",
            "eval.num_prompts=4",
            "rollouts.num_generations_per_prompt=2",
            "eval.ks=[1,2]",
            f"policy.model_name={tiny_model_dir}",
            "policy.generation.max_new_tokens=8",
            "policy.cluster.num_replicas=2",
            "policy.cluster.replica.num_cpus=0.5",
            f"rollouts.gym.launch.gym_venv={gym_venv}",
            f"rollouts.gym.launch.config_paths=[{REPO / 'examples' / 'configs' / 'gym' / 'arithmetic_agents.yaml'}]",
        ],
        EvalConfig,
    )
    result = run_eval(cfg, progress=False)
    assert result.complete and result.errors_written == 0
    (pool,) = pools
    counts = served(pool)
    assert sum(counts) == 8 and min(counts) >= 1, counts  # Gym's 8 calls, through one URL, on both replicas
    lines = [orjson.loads(x) for x in (tmp_path / "eval" / "completions.jsonl").read_bytes().splitlines()]
    assert len(lines) == 8
    assert all(x["stop_reason"] != "error" and x["reward"] in (0.0, 1.0) for x in lines)
    check_session_ray_kept(local_ray, pool)


def endless_hf(path: str) -> HfGeneration:
    """The hf backend of the tiny model, with no EOS: every row runs to its budget (pickled by value)."""
    gen = HfGeneration.from_pretrained(path, max_model_len=4096)
    gen._eos_ids = frozenset({-1})
    return gen


def test_an_abort_refit_of_the_pool_returns_partial_outputs_under_the_old_version(
    local_ray, tiny_model_dir, tiny_model_and_tokenizer
):
    model, tokenizer = tiny_model_and_tokenizer
    local_ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    factory = functools.partial(endless_hf, str(tiny_model_dir))
    pool = RoutedGeneration(factory, tokenizer=tokenizer, max_model_len=4096, num_replicas=2,
                            resources=cluster.ReplicaResources(num_cpus=0.5))
    try:
        long = GenerationConfig(max_new_tokens=3000, temperature=1.0, seed=1)

        async def run():
            prompts = [[10 + i, 20, 30] for i in range(4)]
            tasks = [asyncio.ensure_future(pool.generate_async(p, long)) for p in prompts]
            await asyncio.sleep(1.5)  # every request is decoding
            await asyncio.to_thread(pool.update_weights, model.state_dict(), in_flight="abort")
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            after = await pool.generate_async(prompts[0], GenerationConfig(max_new_tokens=4, temperature=0.0))
            return outs, after

        outs, after = asyncio.run(run())
        assert pool.weight_version == 1
        for out in outs:
            assert out.finish_reason is FinishReason.ABORTED
            assert 0 < len(out.output_ids) < 3000 and len(out.logprobs) == len(out.output_ids)  # partial tokens kept
            assert out.weight_version == 0  # generated under the old weights
        assert after.weight_version == 1
        assert min(served(pool)) >= 2  # both replicas had requests in flight when the update aborted them
    finally:
        pool.shutdown()
    assert local_ray.is_initialized()


def test_cluster_config_errors_come_with_the_rest_of_the_config_in_one_message(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["policy.cluster.num_replicas=0", "policy.cluster.adress=auto",
                           "policy.max_model_len=1"], GRPOConfig)
    text = str(err.value)
    for key in ("policy.cluster.num_replicas", "policy.cluster.adress", "policy.max_model_len"):
        assert key in text, text
    assert "Traceback" not in text
    assert PolicyConfig().cluster is None  # no cluster: the in-process engine, as before
