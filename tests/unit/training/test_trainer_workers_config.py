"""`trainer.workers > 1`: what the config accepts, what it refuses by name, and the resource check made before
any model loads (the ranks themselves: tests/functional/test_trainer_workers.py)."""

from __future__ import annotations

import os
import sys

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.training.config import TrainerSettings
from nemo_rl_ext.training.distributed_trainer import check_trainer_resources

SHIPPED = "examples/configs/grpo_smollm2.yaml"


def test_two_fsdp2_workers_are_accepted():
    cfg = load_config(SHIPPED, ["trainer.workers=2", "trainer.worker.num_cpus=0.5"], GRPOConfig)
    assert (cfg.trainer.workers, cfg.trainer.sharding, cfg.trainer.worker.num_cpus) == (2, "fsdp2", 0.5)


def test_every_memory_saver_is_accepted_with_workers():
    cfg = load_config(SHIPPED, ["trainer.workers=2", "trainer.sharding=none", "trainer.mixed_precision=bf16",
                                "trainer.activation_checkpointing=true", "trainer.lora.r=8"], GRPOConfig)
    trainer = cfg.trainer
    assert (trainer.sharding, trainer.mixed_precision, trainer.activation_checkpointing, trainer.lora.r) == (
        "none", "bf16", True, 8)


def test_cpu_offload_needs_gpu_ranks_and_is_refused_on_the_cpu_or_in_process():
    with pytest.raises(ConfigError, match=r"trainer.cpu_offload: needs a GPU policy .* nothing to offload"):
        load_config(SHIPPED, ["trainer.workers=2", "trainer.cpu_offload=true"], GRPOConfig)  # policy.device cpu
    with pytest.raises(ConfigError, match=r"trainer.cpu_offload: is FSDP2's CPU offload: it needs trainer.workers > 1"):
        load_config(SHIPPED, ["policy.device=cuda", "trainer.cpu_offload=true"], GRPOConfig)
    cfg = load_config(SHIPPED, ["policy.device=cuda", "trainer.workers=2", "trainer.cpu_offload=true",
                                "trainer.worker.num_gpus=1"], GRPOConfig)
    assert cfg.trainer.cpu_offload


def test_more_ranks_than_the_cluster_holds_is_one_error_naming_every_short_resource():
    settings = TrainerSettings(workers=4, worker={"num_cpus": 1, "num_gpus": 1})
    with pytest.raises(ConfigError) as err:
        check_trainer_resources(settings, {"CPU": 2.0, "GPU": 1.0})
    text = str(err.value)
    assert "trainer.workers=4 x trainer.worker.num_cpus=1 needs 4 CPUs, the Ray cluster has 2" in text
    assert "trainer.workers=4 x trainer.worker.num_gpus=1 needs 4 GPUs, the Ray cluster has 1" in text


def test_ranks_that_fit_pass_the_resource_check():
    check_trainer_resources(TrainerSettings(workers=4, worker={"num_cpus": 0.5}), {"CPU": 2.0})
    check_trainer_resources(TrainerSettings(workers=2, worker={"num_cpus": 1, "num_gpus": 1}), {"CPU": 8, "GPU": 2})


def test_the_generation_pool_on_the_same_ray_counts_too():
    from nemo_rl_ext.cluster import ClusterConfig

    pool = ClusterConfig(num_replicas=2, replica={"num_cpus": 1})
    with pytest.raises(ConfigError, match=r"trainer.workers=2 x trainer.worker.num_cpus=1 \+ policy.cluster."
                                          r"num_replicas=2 x policy.cluster.replica.num_cpus=1 needs 4 CPUs, the Ray "
                                          r"cluster has 3"):
        check_trainer_resources(TrainerSettings(workers=2), {"CPU": 3.0}, pool)
    check_trainer_resources(TrainerSettings(workers=2), {"CPU": 4.0}, pool)


@pytest.mark.skipif(sys.platform != "linux", reason="Linux names its loopback interface lo")
def test_a_rank_gives_gloo_the_interface_of_its_node_address_and_keeps_one_the_user_set(monkeypatch):
    """Gloo's default is the host name's address, 127.0.0.1 where that fails: ranks on other nodes cannot connect
    (tests/functional/test_two_hosts.py runs ranks on two hosts)."""
    from nemo_rl_ext.training.fsdp_workers import use_gloo_interface_of

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    use_gloo_interface_of("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    use_gloo_interface_of("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
