"""The eval config: each validation rule's message, every problem in one error, the shipped configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig

CONFIGS = Path(__file__).resolve().parents[3] / "examples" / "configs" / "evals"
BASE = ["eval.dataset_path=data.jsonl", "eval.save_path=out"]
GYM = ["rollouts.gym.agent_urls={agent_alpha: 'http://127.0.0.1:9'}", "rollouts.gym.serve_policy=false"]
MODE = {
    "single_turn": ["rollouts.mode=native", "rollouts.max_rollout_turns=1"],
    "multi_turn": ["rollouts.mode=native"],
    "nemo_gym": ["rollouts.mode=nemo_gym"],
}
"""The overrides of each of NeMo-RL's `eval.rollout_mode` values in today's spelling."""


def older_spelling() -> pytest.WarningsRecorder:
    """Expects the DeprecationWarning of NeMo-RL's eval spelling (the subject of the tests that use it)."""
    return pytest.warns(DeprecationWarning, match="is an older spelling of")


def load(*overrides: str) -> EvalConfig:
    return load_config(None, [*BASE, *overrides], EvalConfig)


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides)
    return str(info.value)


@pytest.mark.parametrize("name", ["eval.yaml", "tool_eval.yaml", "nemo_gym_eval.yaml"])
def test_shipped_configs_validate(name: str) -> None:
    cfg = load_config(CONFIGS / name, [], EvalConfig)
    assert cfg.ks == (1, 2, 4)


def test_shipped_modes() -> None:
    modes = {
        n: load_config(CONFIGS / n, [], EvalConfig).rollouts.mode_name
        for n in ("eval.yaml", "tool_eval.yaml", "nemo_gym_eval.yaml")
    }
    assert modes == {
        "eval.yaml": "single_turn",
        "tool_eval.yaml": "multi_turn",
        "nemo_gym_eval.yaml": "nemo_gym",
    }


def test_defaults() -> None:
    cfg = load()
    assert cfg.rollouts.mode_name == "single_turn"
    assert cfg.rollouts.env.resolved_name == "math"
    assert cfg.ks == (1,)
    with older_spelling():
        assert load("eval.rollout_mode=multi_turn").rollouts.env.resolved_name == "tool_calculator"


def test_default_ks_are_powers_of_two_and_the_count() -> None:
    assert load("rollouts.num_generations_per_prompt=6").ks == (1, 2, 4, 6)
    assert load("rollouts.num_generations_per_prompt=8").ks == (1, 2, 4, 8)
    per_agent = load("rollouts.num_generations_per_prompt={a: 3, _default: 5}")
    assert per_agent.ks == (1, 2, 4, 5)


def test_ks_are_sorted_and_deduplicated() -> None:
    assert load("rollouts.num_generations_per_prompt=4", "eval.ks=[4,1,2,1]").eval.ks == (1, 2, 4)


# ---- each rule's message --------------------------------------------------------------------------


def test_single_turn_rejects_max_rollout_turns_above_one() -> None:
    # a rule of NeMo-RL's spelling only (rollout_mode=single_turn, or no rollouts section at all)
    with older_spelling():
        msg = problems("eval.max_rollout_turns=3")
    assert (
        "eval.max_rollout_turns: rollout_mode=single_turn runs one generation and one environment step" in msg
    )
    assert "max_rollout_turns=3 would be ignored" in msg and "rollout_mode=multi_turn" in msg
    with older_spelling():
        assert load("eval.max_rollout_turns=1").rollouts.max_rollout_turns == 1
    with older_spelling():
        assert load("eval.rollout_mode=multi_turn", "eval.max_rollout_turns=3").rollouts.max_rollout_turns == 3


def test_nemo_gym_requires_null_max_rollout_turns() -> None:
    msg = problems("rollouts.mode=nemo_gym", "rollouts.max_rollout_turns=2")
    assert (
        "rollouts.max_rollout_turns: must be null: in nemo_gym mode the Gym agents own the turn loop (got 2)"
        in msg
    )


def test_nemo_gym_requires_null_top_k() -> None:
    msg = problems("rollouts.mode=nemo_gym", "policy.generation.top_k=20")
    assert "policy.generation.top_k: must be null in nemo_gym mode: the OpenAI API" in msg
    assert "has no top_k (got 20)" in msg


def test_nemo_gym_rejects_stop_strings() -> None:
    msg = problems("rollouts.mode=nemo_gym", "policy.generation.stop_strings=[</tool_call>]")
    assert (
        "policy.generation.stop_strings: must be empty in nemo_gym mode: stops are set by the Gym agents"
        in msg
    )


def test_nemo_gym_rejects_stop_token_ids() -> None:
    msg = problems("rollouts.mode=nemo_gym", "policy.generation.stop_token_ids=[2]")
    assert "policy.generation.stop_token_ids: must be empty in nemo_gym mode" in msg


def test_nemo_gym_rejects_native_environment_settings() -> None:
    msg = problems("rollouts.mode=nemo_gym", "rollouts.env.name=math", "rollouts.env.system_prompt=hi")
    assert "rollouts.env.name: must be null in nemo_gym mode" in msg
    assert "rollouts.env.system_prompt: must be null in nemo_gym mode" in msg


def test_nemo_gym_accepts_several_samples_and_per_agent_counts() -> None:
    cfg = load("rollouts.mode=nemo_gym", "rollouts.num_generations_per_prompt={agent_alpha: 4, _default: 2}",
               *GYM)
    assert cfg.rollouts.num_generations_per_prompt == {"agent_alpha": 4, "_default": 2}
    assert cfg.rollouts.max_samples == 4


@pytest.mark.parametrize("mode", ["single_turn", "multi_turn", "nemo_gym"])
def test_several_samples_need_temperature_above_zero(mode: str) -> None:
    msg = problems(*MODE[mode], "rollouts.num_generations_per_prompt=4", "policy.generation.temperature=0")
    assert "policy.generation.temperature: temperature=0.0 is greedy decoding" in msg
    assert "num_generations_per_prompt=4; set temperature > 0 or one sample per prompt" in msg
    gym = GYM if mode == "nemo_gym" else []
    assert load(*MODE[mode], "policy.generation.temperature=0", *gym).policy.generation.greedy


def test_several_samples_for_one_agent_need_temperature_above_zero() -> None:
    msg = problems("rollouts.num_generations_per_prompt={math: 1, agent_b: 3}", "policy.generation.temperature=0")
    assert "num_generations_per_prompt gives more than one sample to agent_b: 3" in msg


def test_ks_above_the_largest_sample_count_are_rejected() -> None:
    msg = problems("rollouts.num_generations_per_prompt=4", "eval.ks=[1,4,8,16]")
    assert "eval.ks: k=[8, 16] larger than the largest sample count (4 from num_generations_per_prompt)" in msg


def test_bad_field_values() -> None:
    msg = problems("eval.ks=[0,1]", "rollouts.num_generations_per_prompt={a: 0, b: x}", "rollouts.mode=chat")
    assert "eval.ks: Value error, every k must be >= 1; bad: [0]" in msg
    assert "bad entries: {'a': 0, 'b': 'x'}" in msg
    assert "rollouts.mode: Value error, unknown rollout mode 'chat'; registered modes: native, nemo_gym" in msg


def test_nemo_gym_needs_a_gym_section_and_other_modes_refuse_one() -> None:
    msg = problems("rollouts.mode=nemo_gym")
    assert "rollouts.gym: is required with rollouts.mode=nemo_gym: gym.launch" in msg
    msg = problems(*MODE["single_turn"], *GYM)
    assert "gym: is only used with rollouts.mode=nemo_gym" in msg


def test_unknown_environment_lists_the_known_ones() -> None:
    msg = problems("rollouts.env.name=chess")
    assert "unknown environment 'chess'; known:" in msg and "tool_calculator" in msg


def test_every_problem_is_reported_at_once() -> None:
    msg = problems(
        "rollouts.mode=nemo_gym",
        "rollouts.max_rollout_turns=3",
        "policy.generation.top_k=5",
        "policy.generation.stop_strings=[x]",
        "policy.generation.stop_token_ids=[1]",
        "rollouts.num_generations_per_prompt=4",
        "policy.generation.temperature=0",
        "eval.ks=[1,8]",
        "policy.dtype=int3",
        "eval.typo_key=1",
        *GYM,
    )
    assert msg.splitlines()[0].endswith("8 problem(s)")
    for key in (
        "rollouts.max_rollout_turns:",
        "policy.generation.top_k:",
        "policy.generation.stop_strings:",
        "policy.generation.stop_token_ids:",
        "policy.generation.temperature:",
        "eval.ks:",
        "policy.dtype:",
        "eval.typo_key: Extra inputs are not permitted",
    ):
        assert key in msg, key


def test_rules_still_run_next_to_a_missing_required_field() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["eval.dataset_path=x", "rollouts.mode=nemo_gym", "rollouts.max_rollout_turns=2"],
                    EvalConfig)
    msg = str(info.value)
    assert "eval.save_path: Field required" in msg
    assert "rollouts.max_rollout_turns: must be null: in nemo_gym mode" in msg


def test_model_validate_of_a_valid_instance_round_trips() -> None:
    cfg = load("rollouts.num_generations_per_prompt=2")
    assert EvalConfig.model_validate(cfg.model_dump()) == cfg
