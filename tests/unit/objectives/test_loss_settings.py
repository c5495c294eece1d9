"""The loss settings have one home: `LossSettings` declares them, and `ClippedPGLossConfig` (what the loss
function takes) is built from its fields and checked by the same rules, with the same messages."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from nemo_rl_ext.grpo.config import LossSettings
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig


def test_the_dataclass_is_the_settings_fields_and_defaults() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(ClippedPGLossConfig)}
    assert fields == {name: info.default for name, info in LossSettings.model_fields.items()}
    loss = LossSettings(clip_high=0.28, kl_coef=0.0).to_loss_config()
    assert isinstance(loss, ClippedPGLossConfig) and (loss.clip_high, loss.kl_coef) == (0.28, 0.0)
    assert pickle.loads(pickle.dumps(loss)) == loss  # it travels to Ray trainer workers
    with pytest.raises(dataclasses.FrozenInstanceError):
        loss.kl_coef = 1.0


@pytest.mark.parametrize(("key", "value", "message"), [
    ("clip_low", 1.5, "invalid ClippedPGLossConfig: clip_low must be in [0, 1), got 1.5"),
    ("clip_c", 0.5, "invalid ClippedPGLossConfig: clip_c must be > 1 (or None), got 0.5"),
    ("kl_coef", float("inf"), "invalid ClippedPGLossConfig: kl_coef must be finite, got inf"),
])
def test_both_spellings_refuse_a_broken_rule_with_one_message(key: str, value: float, message: str) -> None:
    with pytest.raises(ValueError) as direct:
        ClippedPGLossConfig(**{key: value})
    assert str(direct.value) == message
    with pytest.raises(ValueError) as settings:
        LossSettings(**{key: value})
    assert message in str(settings.value)
