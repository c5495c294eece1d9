"""The update's settings in the `on_policy_distillation` section: impossible combinations are one config error
naming every problem, before any model loads."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.objectives.distillation import DistillationLoss, distillation_loss


@pytest.mark.parametrize("kl_type", ["forward", "mixed"])
def test_forward_and_mixed_need_the_teachers_top_k(kl_type):
    with pytest.raises(ValidationError, match=f"kl_type {kl_type} is computed over the teacher's top-k"):
        DistillationSettings(enabled=True, kl_type=kl_type, top_k=0, default_teacher_alias="tiny")
    assert DistillationSettings(enabled=True, kl_type=kl_type, top_k=4, default_teacher_alias="tiny").top_k == 4


def test_a_missing_teacher_and_a_missing_top_k_are_named_together():
    with pytest.raises(ValidationError) as info:
        DistillationSettings(enabled=True, kl_type="forward", top_k=0)
    assert "set top_k > 0" in str(info.value) and "needs a teacher" in str(info.value)


def test_enabled_settings_become_the_update_and_disabled_ones_nothing():
    settings = DistillationSettings(enabled=True, kl_type="mixed", mixed_kl_weight=0.25, top_k=8, reward_weight=0.5,
                                    default_teacher_alias="tiny")
    assert distillation_loss(settings) == DistillationLoss("mixed", 0.25, 0.5)
    assert distillation_loss(DistillationSettings()) is None


def test_grpo_config_names_both_problems_at_once():
    overrides = ["on_policy_distillation.enabled=true", "on_policy_distillation.kl_type=forward",
                 "on_policy_distillation.default_teacher_alias=tiny",
                 "grpo.dynamic_sampling.enabled=true"]
    with pytest.raises(ConfigError) as info:
        load_config("examples/configs/grpo_smollm2.yaml", overrides, GRPOConfig)
    text = str(info.value)
    assert "2 problem(s)" in text and "set top_k > 0" in text
    assert "grpo.dynamic_sampling.enabled: must be false with on_policy_distillation" in text
    cfg = load_config("examples/configs/grpo_smollm2.yaml", ["on_policy_distillation.enabled=true",
                                                              "on_policy_distillation.default_teacher_alias=tiny"],
                      GRPOConfig)
    assert distillation_loss(cfg.on_policy_distillation) == DistillationLoss("reverse", 0.5, 0.0)
