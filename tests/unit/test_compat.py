"""The older config spellings live in `nemo_rl_ext.compat`: each still loads to today's settings (see
test_config_spellings.py) and warns once per key written, naming the old key and the new one; today's
spelling warns about nothing."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.grpo.config import GRPOConfig

REPO = Path(__file__).resolve().parents[2]
OLDER = Path(__file__).resolve().parent / "older_spelling"
MOVE = re.compile(r"^config key ([^\s;]+) is an older spelling of ([^\s;]+)[ ;]")


def moves_warned(path: Path | None, overrides: list[str], schema: type) -> list[tuple[str, str]]:
    """(old, new) of every DeprecationWarning that loading the config gave, in order."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(path, overrides, schema)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert all(MOVE.match(m) for m in deprecations), deprecations
    return [MOVE.match(m).groups() for m in deprecations]


def test_the_eval_spelling_warns_for_each_key_written_and_only_those() -> None:
    moves = moves_warned(OLDER / "tool_eval.yaml", ["eval.environment_step_timeout_s=7"], EvalConfig)
    assert sorted(moves) == sorted([
        ("eval.rollout_mode", "rollouts.mode"),
        ("eval.num_tests_per_prompt", "rollouts.num_generations_per_prompt"),
        ("eval.max_rollout_turns", "rollouts.max_rollout_turns"),
        ("eval.max_seq_len", "rollouts.max_seq_len"),
        ("eval.environment", "rollouts.env.name"),
        ("eval.system_prompt", "rollouts.env.system_prompt"),
        ("eval.environment_step_timeout_s", "rollouts.env.step_timeout_s"),
    ])
    gym = moves_warned(OLDER / "nemo_gym_eval.yaml", [], EvalConfig)
    assert ("gym", "rollouts.gym") in gym and ("eval.rollout_mode", "rollouts.mode") in gym
    # a minimal eval config is both spellings at once: its implied single_turn is not a key the user wrote
    assert moves_warned(None, ["eval.dataset_path=d", "eval.save_path=s"], EvalConfig) == []


def test_the_grpo_spelling_warns_for_each_key_and_names_the_env_section_once() -> None:
    moves = moves_warned(OLDER / "grpo_smollm2.yaml", [], GRPOConfig)
    assert ("grpo.num_generations_per_prompt", "rollouts.num_generations_per_prompt") in moves
    assert ("data.system_prompt", "rollouts.env.system_prompt") in moves
    assert moves.count(("env", "rollouts.env")) == 1 and not any(old.startswith("env.") for old, _ in moves)


def test_the_warning_says_what_a_rollout_mode_means_today() -> None:
    with pytest.warns(DeprecationWarning, match=r"eval.rollout_mode is an older spelling of rollouts.mode "
                      r"\(single_turn is rollouts.mode: native with rollouts.max_rollout_turns: 1"):
        load_config(None, ["eval.dataset_path=d", "eval.save_path=s", "eval.rollout_mode=single_turn"], EvalConfig)


@pytest.mark.parametrize("name", ["evals/eval.yaml", "evals/tool_eval.yaml", "evals/nemo_gym_eval.yaml",
                                  "grpo_smollm2.yaml"])
def test_the_shipped_configs_warn_about_nothing(name: str) -> None:
    path = REPO / "examples" / "configs" / name
    assert moves_warned(path, [], GRPOConfig if name.startswith("grpo") else EvalConfig) == []


def test_an_unknown_rollout_mode_names_the_three_modes_of_the_older_spelling() -> None:
    with pytest.raises(ConfigError, match=r"eval.rollout_mode: Input should be 'single_turn', 'multi_turn' or "
                       r"'nemo_gym'"):  # a value that moves nowhere: an error, no warning
        load_config(None, ["eval.dataset_path=d", "eval.save_path=s", "eval.rollout_mode=chat"], EvalConfig)
