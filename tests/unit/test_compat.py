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


# ---- NeMo-RL's advantage keys: grpo.normalize_rewards, grpo.use_leave_one_out_baseline, grpo.adv_estimator.{...} --

GYM = ["rollouts.mode=nemo_gym", "rollouts.gym={head_server_url: 'http://127.0.0.1:9', policy_port: 9, "
       "reward_components: [format, correct]}"]
NESTED = ("grpo.adv_estimator={name: gdpo, normalize_rewards: false, use_leave_one_out_baseline: false, "
          "reward_weights: [1.0, 0.5], minus_baseline: false}")  # NeMo-RL's section (grpo_math_1B.yaml's keys)


def _grpo(*overrides: str) -> GRPOConfig:
    return load_config(None, ["data.train_path=t.jsonl", *overrides], GRPOConfig)


def test_nemo_rls_nested_adv_estimator_loads_as_todays_keys_with_a_warning_per_key() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = _grpo(NESTED, *GYM)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    moves = sorted(MOVE.match(m).groups() for m in messages if MOVE.match(m))
    assert moves == sorted([("grpo.adv_estimator.name", "grpo.adv_estimator"),
                            ("grpo.adv_estimator.normalize_rewards", "grpo.normalize_std"),
                            ("grpo.adv_estimator.use_leave_one_out_baseline", "grpo.baseline"),
                            ("grpo.adv_estimator.reward_weights", "grpo.reward_weights"),
                            ("grpo.adv_estimator.minus_baseline", "grpo.minus_baseline")])
    assert len(messages) == len(moves)
    # the list is by sorted component name (NeMo-RL's order): correct < format
    assert cfg.grpo == _grpo("grpo.adv_estimator=gdpo", "grpo.normalize_std=false", "grpo.baseline=mean",
                             "grpo.reward_weights={correct: 1.0, format: 0.5}", "grpo.minus_baseline=false",
                             *GYM).grpo


def test_nemo_rls_flat_keys_and_the_section_that_repeats_them_load() -> None:
    # grpo_math_1B.yaml writes both: adv_estimator.normalize_rewards: ${grpo.normalize_rewards}
    overrides = ["data.train_path=t.jsonl", "grpo.normalize_rewards=true", "grpo.use_leave_one_out_baseline=true",
                 "grpo.adv_estimator={name: grpo, normalize_rewards: true, use_leave_one_out_baseline: true}"]
    assert sorted(moves_warned(None, overrides, GRPOConfig)) == sorted([
        ("grpo.normalize_rewards", "grpo.normalize_std"), ("grpo.use_leave_one_out_baseline", "grpo.baseline"),
        ("grpo.adv_estimator.normalize_rewards", "grpo.normalize_std"), ("grpo.adv_estimator.name", "grpo.adv_estimator"),
        ("grpo.adv_estimator.use_leave_one_out_baseline", "grpo.baseline")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cfg = load_config(None, overrides, GRPOConfig)
    assert (cfg.grpo.adv_estimator, cfg.grpo.baseline, cfg.grpo.normalize_std) == ("grpo", "leave_one_out", True)
    with pytest.warns(DeprecationWarning, match=r"grpo.use_leave_one_out_baseline is an older spelling of grpo.baseline"):
        assert _grpo("grpo.use_leave_one_out_baseline=false").grpo.baseline == "mean"


@pytest.mark.parametrize(("overrides", "named"), [
    (["grpo.adv_estimator={name: gdpo, reward_weights: [1.0, 0.5]}"],
     "grpo.adv_estimator.reward_weights: a list of weights is ordered by the components' sorted names"),
    (["grpo.adv_estimator={name: gdpo, reward_weights: [1.0]}", *GYM],
     "grpo.adv_estimator.reward_weights: has 1 weights for the 2 components"),
    (["grpo.adv_estimator={name: gae}"], "grpo.adv_estimator.name: Input should be 'grpo', 'gdpo' or "
     "'reinforce_plus_plus'"),
    (["grpo.adv_estimator={name: grpo, gae_lambda: 0.9}"], "grpo.adv_estimator.gae_lambda: is not a key"),
    (["grpo.adv_estimator={use_leave_one_out_baseline: maybe}"],
     "grpo.adv_estimator.use_leave_one_out_baseline: must be true or false"),
    (["grpo.normalize_std=false", "grpo.adv_estimator={normalize_rewards: true}"],
     "grpo.adv_estimator.normalize_rewards: is the older spelling of grpo.normalize_std, which is also given"),
])
def test_a_bad_nested_adv_estimator_is_one_error_naming_the_key_as_written(overrides, named) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError) as err:
            _grpo(*overrides)
    assert named in str(err.value)
    assert str(err.value).count("\n  - ") == 1
