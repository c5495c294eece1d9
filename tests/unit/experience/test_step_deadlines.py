"""Every consumer (the eval, GRPO, the examples) rolls out under a FaultPolicy with a finite env step limit."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
from pathlib import Path

import pytest

from nemo_rl_ext.config import load_config
from nemo_rl_ext.environments import create_environment
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.store_setup import build_rollout_setup
from nemo_rl_ext.experience.build import build_rollouts
from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import rollout_generation_config
from nemo_rl_ext.testing import ScriptedGeneration

REPO = Path(__file__).resolve().parents[3]
EVAL_CONFIGS = REPO / "examples" / "configs" / "evals"


def NoGeneration(tokenizer) -> ScriptedGeneration:  # noqa: N802 - named for what it stands in for
    """Stands in for a backend: the builders only read its tokenizer (nothing is scripted to generate)."""
    return ScriptedGeneration(tokenizer, ())


def assert_finite_env_step_limit(manager: RolloutManager) -> None:
    limit = manager.fault_policy.env_step_timeout_s
    assert limit is not None and math.isfinite(limit) and limit > 0, limit


def test_the_default_fault_policy_limits_environment_steps() -> None:
    limit = FaultPolicy().env_step_timeout_s
    assert limit is not None and math.isfinite(limit)


@pytest.mark.parametrize("name", ["eval.yaml", "tool_eval.yaml", "nemo_gym_eval.yaml"])
def test_eval_managers_limit_environment_steps(tiny_model_and_tokenizer, monkeypatch, name: str) -> None:
    _, tok = tiny_model_and_tokenizer
    monkeypatch.chdir(REPO)  # the shipped configs name their datasets relative to the repository
    cfg = load_config(EVAL_CONFIGS / name, [], EvalConfig)
    _, manager = build_rollout_setup(cfg, NoGeneration(tok))
    assert_finite_env_step_limit(manager)


def test_grpo_manager_limits_environment_steps(tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    cfg = load_config(REPO / "examples" / "configs" / "grpo_smollm2.yaml", [], GRPOConfig)
    env = cfg.rollouts.env
    task_to_env = {env.resolved_name: create_environment(env.resolved_name, **env.kwargs)}
    _, manager = build_rollouts(
        cfg.rollouts, tok, NoGeneration(tok), generation_config=rollout_generation_config(cfg), task_to_env=task_to_env
    )
    assert_finite_env_step_limit(manager)


def test_run_rollouts_example_limits_environment_steps(tiny_model_and_tokenizer, monkeypatch) -> None:
    _, tok = tiny_model_and_tokenizer
    spec = importlib.util.spec_from_file_location("run_rollouts_example", REPO / "examples" / "run_rollouts.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    built: list[RolloutManager] = []

    class Stop(Exception):
        pass

    def recording(*args, **kwargs):
        _, manager = example_build_rollouts(*args, **kwargs)
        built.append(manager)
        raise Stop  # the manager is what this test checks; nothing needs to run

    example_build_rollouts = example.build_rollouts
    monkeypatch.setattr(example, "build_policy", lambda cfg: (tok, NoGeneration(tok)))
    monkeypatch.setattr(example, "build_rollouts", recording)
    args = argparse.Namespace(model="tiny", num_prompts=1, num_generations=1, max_turns=1, max_new_tokens=4)
    with pytest.raises(Stop):
        asyncio.run(example.main(args))
    assert len(built) == 1
    assert_finite_env_step_limit(built[0])
