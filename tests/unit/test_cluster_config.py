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


