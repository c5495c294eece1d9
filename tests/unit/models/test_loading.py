"""models/loading.py: the transformers-version shims the trainers rely on."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM

from nemo_rl_ext.models.loading import enable_activation_checkpointing


def test_activation_checkpointing_turns_on_every_decoder_layer(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
    enable_activation_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


class _OlderTransformersModel:
    """A model of transformers 5.x before `activation_checkpointing_enable` (5.17, on the lent GPU image, has
    only `gradient_checkpointing_enable`)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None) -> None:
        self.calls.append(gradient_checkpointing_kwargs)


class _Wrapped:
    """A LoRA (peft) policy: the layers are on its base model."""

    def __init__(self, base) -> None:
        self.base = base

    def get_base_model(self):
        return self.base


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "peft-wrapped"])
def test_older_transformers_get_the_older_method_non_reentrant(wrapped):
    base = _OlderTransformersModel()
    enable_activation_checkpointing(_Wrapped(base) if wrapped else base)
    assert base.calls == [{"use_reentrant": False}]
