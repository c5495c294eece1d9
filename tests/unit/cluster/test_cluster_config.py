"""The `cluster` config section: defaults, and every problem reported in one error."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_rl_ext.models.config import ClusterConfig


def test_defaults_start_a_local_ray_with_one_replica():
    cfg = ClusterConfig()
    assert cfg.address is None and cfg.num_replicas == 1
    assert cfg.replica.num_cpus == 1.0 and cfg.replica.num_gpus == 0.0
    assert ClusterConfig(address="ray://head:10001").address == "ray://head:10001"
    assert ClusterConfig(address="auto").address == "auto"


def test_every_problem_is_named_at_once():
    with pytest.raises(ValidationError) as err:
        ClusterConfig.model_validate(
            {"address": "http://x", "num_replicas": 0, "replica": {"num_cpus": -1, "num_gpu": 1}, "extra": 1}
        )
    locs = {".".join(map(str, e["loc"])) for e in err.value.errors()}
    assert locs == {"address", "num_replicas", "replica.num_cpus", "replica.num_gpu", "extra"}
    assert "http://x" in str(err.value)




def test_a_replica_asks_the_backend_registry_for_its_engine_arguments():
    """Which engine arguments a Ray replica adds is the backend's registry entry's call, not cluster code's."""
    from nemo_rl_ext.cluster.replica import policy_backend_factory
    from nemo_rl_ext.models.backends import _BACKENDS, register_backend
    from nemo_rl_ext.models.config import PolicyConfig

    def engine_args(cfg):
        return policy_backend_factory(cfg).args[1]

    assert engine_args(PolicyConfig(backend="hf")) is None
    assert engine_args(PolicyConfig(backend="vllm")) is None  # one GPU: vLLM's own executor
    sharded = PolicyConfig(backend="vllm", vllm={"tensor_parallel_size": 2})
    assert engine_args(sharded) == {"distributed_executor_backend": "ray"}

    @register_backend("replica_args_probe", loads_model_folder=True,
                      replica_engine_kwargs=lambda cfg: {"shards": cfg.max_model_len // 256})
    def probe(cfg, model, tokenizer, engine_kwargs):
        raise AssertionError("not built here")

    try:
        assert engine_args(PolicyConfig(backend="replica_args_probe", max_model_len=1024)) == {"shards": 4}
    finally:
        del _BACKENDS["replica_args_probe"]
