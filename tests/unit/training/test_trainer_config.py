"""The `trainer:` section: its names and defaults, and features not built yet refused by name, never ignored."""

from __future__ import annotations

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.training.config import UNBUILT, TrainerSettings

SHIPPED = "examples/configs/grpo_smollm2.yaml"


def test_the_shipped_config_spells_out_every_trainer_setting_at_its_default():
    cfg = load_config(SHIPPED, [], GRPOConfig)
    assert cfg.trainer == TrainerSettings()
    assert (cfg.trainer.workers, cfg.trainer.sharding, cfg.trainer.lora) == (1, "fsdp2", None)


def test_a_setting_whose_feature_is_not_built_is_refused_by_name(monkeypatch):
    """Every setting is built today; the mechanism stays for the next one (`UNBUILT` names it)."""
    monkeypatch.setitem(UNBUILT, "activation_checkpointing", (False, "activation checkpointing"))
    with pytest.raises(ConfigError, match=r"trainer.activation_checkpointing: activation checkpointing is not built "
                                          r"yet: only False is accepted"):
        load_config(SHIPPED, ["trainer.activation_checkpointing=true"], GRPOConfig)


def test_every_trainer_problem_is_reported_in_one_error():
    with pytest.raises(ConfigError) as err:
        load_config(SHIPPED, ["trainer.sharding=zero", "trainer.workers=0", "trainer.worker.num_cpus=-1"], GRPOConfig)
    text = str(err.value)
    for key in ("trainer.sharding", "trainer.workers", "trainer.worker.num_cpus"):
        assert key in text
