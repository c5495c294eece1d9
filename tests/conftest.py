"""Shared pytest fixtures. Heavy imports stay inside fixtures so collection stays fast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init Qwen2 model + ChatML tokenizer folder (seed 0), built once per session."""
    from nemo_rl_ext.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) loaded fp32 on CPU from `tiny_model_dir`; shared, so never train or mutate it."""
    from nemo_rl_ext.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_dir)


@pytest.fixture
def agents():
    """Fake NeMo Gym agent servers (`agent_alpha`, `agent_beta`) on 127.0.0.1: `nemo_rl_ext.testing.FakeAgents`."""
    from nemo_rl_ext.testing import FakeAgents

    with FakeAgents() as fake:
        yield fake


@pytest.fixture
def stand_in_vllm():
    """(StandInEngine, VllmGeneration wired to it): the vLLM backend's code paths without vLLM
    (`nemo_rl_ext.testing.vllm_engine`)."""
    from nemo_rl_ext.testing.vllm_engine import StandInEngine, vllm_on_stand_in

    engine = StandInEngine()
    with vllm_on_stand_in(engine) as gen:
        yield engine, gen
