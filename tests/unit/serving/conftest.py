"""The engine behind each server test module: the tiny model on the hf backend, with the module's own
context length (`MAX_MODEL_LEN` in the module), one engine per module, shut down after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nemo_rl_ext.models.generation.hf_backend import HfGeneration


@pytest.fixture(scope="module")
def backend(request, tiny_model_and_tokenizer) -> Iterator[HfGeneration]:
    model, tokenizer = tiny_model_and_tokenizer
    gen = HfGeneration(model, tokenizer, max_model_len=request.module.MAX_MODEL_LEN)
    yield gen
    gen.shutdown()
