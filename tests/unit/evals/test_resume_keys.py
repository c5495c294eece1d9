"""Keys that only say where things are may change on resume (a copied eval folder, Gym servers on other ports,
logs elsewhere); a key that changes completions may not, and every such key is named."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError, dump_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.store import EvalPaths
from nemo_rl_ext.evals.store_setup import check_store_config

LAUNCH = {"launch": {"gym_venv": "/nonexistent/venv", "config_paths": ["x.yaml"], "head_server_port": 11000,
                     "work_dir": "gym"}, "policy_port": 8000}
URLS = {"agent_urls": {"agent_alpha": "http://127.0.0.1:9"}, "policy_port": 8000, "serve_policy": False}


def gym_eval(tmp_path: Path, gym: dict | None = None, **changes) -> EvalConfig:
    """A nemo_gym eval config whose Gym servers are launched (or `gym`); `changes` are dotted keys -> values."""
    data = {
        "eval": {"dataset_path": str(tmp_path / "rows.jsonl"), "save_path": str(tmp_path / "out")},
        "policy": {"generation": {"top_k": None, "temperature": 1.0, "seed": 5, "max_new_tokens": 9}},
        "rollouts": {"mode": "nemo_gym", "num_generations_per_prompt": 2, "gym": copy.deepcopy(gym or LAUNCH)},
    }
    for key, value in changes.items():
        *parents, last = key.split(".")
        at = data
        for part in parents:
            at = at.setdefault(part, {})
        at[last] = value
    return EvalConfig.model_validate(data)


def saved_folder(tmp_path: Path, gym: dict | None = None) -> EvalPaths:
    paths = EvalPaths(tmp_path / "out")
    paths.root.mkdir()
    paths.config.write_text(dump_config(gym_eval(tmp_path, gym)))
    paths.completions.write_text('{"prompt_idx": 0}\n')
    return paths


def test_location_keys_may_change_on_resume(tmp_path):
    paths = saved_folder(tmp_path)
    moved = gym_eval(tmp_path, **{
        "eval.save_path": str(tmp_path / "copy"),
        "rollouts.gym.policy_port": 8123,
        "rollouts.gym.policy_host": "127.0.0.2",
        "rollouts.gym.launch.head_server_port": 12000,
        "rollouts.gym.launch.work_dir": str(tmp_path / "elsewhere"),
        "rollouts.gym.launch.startup_timeout_s": 999.0,
        "eval.metrics": ["maj", "cons@k"],
    })
    assert check_store_config(moved, paths) is True  # resuming, nothing refused


def test_agent_urls_may_change_on_resume(tmp_path):
    paths = saved_folder(tmp_path, URLS)
    moved = gym_eval(tmp_path, URLS, **{"rollouts.gym.agent_urls": {"agent_alpha": "http://127.0.0.1:10"}})
    assert check_store_config(moved, paths) is True


def test_keys_that_change_completions_are_refused_and_each_is_named(tmp_path):
    paths = saved_folder(tmp_path)
    changed = gym_eval(tmp_path, **{"policy.generation.temperature": 0.5,
                                    "rollouts.num_generations_per_prompt": 3, "rollouts.gym.policy_port": 8123})
    with pytest.raises(ConfigError) as err:
        check_store_config(changed, paths)
    text = str(err.value)
    assert "temperature: 1.0 -> 0.5" in text and "num_generations_per_prompt" in text
    assert "policy_port" not in text  # a location change is not listed among the refused ones
