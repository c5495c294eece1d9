"""Every shipped config loads, and configs in the older spellings (NeMo-RL's eval keys, grpo.*, env, gym) load
to the same settings as the shipped ones; their errors name the keys as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.store import check_resumable
from nemo_rl_ext.grpo.config import GRPOConfig

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "examples" / "configs"
OLDER = Path(__file__).resolve().parent / "older_spelling"
"""Copies of the shipped configs as they were written before the shared `rollouts` section."""


def older_spelling() -> pytest.WarningsRecorder:
    """Expects the DeprecationWarning an older spelling gives (test_compat.py checks its every key)."""
    return pytest.warns(DeprecationWarning, match="is an older spelling of")


def schema_of(path: Path) -> type[EvalConfig] | type[GRPOConfig]:
    return GRPOConfig if path.name.startswith("grpo") or path.parent.name == "recipes" else EvalConfig


def shipped_configs() -> list[Path]:
    """Every config of this package under examples/configs (the gym/ folder holds NeMo Gym's own configs)."""
    return sorted(p for p in SHIPPED.rglob("*.yaml") if "gym" not in p.relative_to(SHIPPED).parts[:1])


def test_the_shipped_configs_are_all_found() -> None:
    names = {p.name for p in shipped_configs()}
    assert {"eval.yaml", "tool_eval.yaml", "nemo_gym_eval.yaml", "grpo_smollm2.yaml"} <= names


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path, [], schema_of(path))
    assert cfg.rollouts.mode in ("native", "nemo_gym")


@pytest.mark.parametrize("name", sorted(p.name for p in OLDER.glob("*.yaml")))
def test_a_config_in_the_older_spelling_means_the_same(name: str) -> None:
    schema = schema_of(OLDER / name)
    shipped = next(p for p in shipped_configs() if p.name == name)
    with older_spelling():
        old = load_config(OLDER / name, [], schema)
    new = load_config(shipped, [], schema)
    assert old.model_dump() == new.model_dump()
    assert old == new


def test_the_older_eval_spelling_maps_each_key() -> None:
    with older_spelling():
        cfg = load_config(OLDER / "tool_eval.yaml", ["eval.remote_environment=false",
                                                    "eval.environment_step_timeout_s=7"], EvalConfig)
    ro = cfg.rollouts
    assert (ro.mode, ro.mode_name, ro.max_rollout_turns, ro.num_generations_per_prompt) == ("native", "multi_turn", 3, 4)
    assert (ro.env.name, ro.env.system_prompt, ro.env.remote, ro.env.step_timeout_s) == ("tool_calculator", None, False, 7)
    with older_spelling():
        gym = load_config(OLDER / "nemo_gym_eval.yaml", [], EvalConfig).rollouts
    assert gym.mode_name == "nemo_gym" and gym.gym is not None and gym.gym.row_timeout_s == 300
    # rollout_mode multi_turn without an environment: the older spelling's default, the calculator
    with older_spelling():
        default = load_config(None, ["eval.dataset_path=d", "eval.save_path=s", "eval.rollout_mode=multi_turn"],
                              EvalConfig)
    assert default.rollouts.env.name == "tool_calculator" and default.rollouts.max_rollout_turns is None
    # no rollout_mode and no rollouts section: the older default, single_turn
    plain = load_config(None, ["eval.dataset_path=d", "eval.save_path=s"], EvalConfig)
    assert plain.rollouts.mode_name == "single_turn"


def test_errors_name_the_keys_as_written() -> None:
    with pytest.raises(ConfigError) as info, older_spelling():
        load_config(OLDER / "eval.yaml", ["eval.num_tests_per_prompt={a: 0}", "eval.max_seq_len=1"], EvalConfig)
    text = str(info.value)
    assert "eval.num_tests_per_prompt:" in text and "eval.max_seq_len:" in text, text
    assert "rollouts." not in text, text
    with pytest.raises(ConfigError) as info, older_spelling():
        load_config(OLDER / "grpo_smollm2.yaml", ["grpo.max_seq_len=4096", "env.typo=1"], GRPOConfig)
    text = str(info.value)
    assert "grpo.max_seq_len: exceeds policy.max_model_len (512)" in text and "env.typo:" in text, text
    with pytest.raises(ConfigError) as info, older_spelling():  # (from test_cluster_environments.py)
        load_config(None, ["eval.dataset_path=x.jsonl", "eval.save_path=out", "eval.remote_environment=sometimes",
                           "eval.environment_step_timeout_s=-1"], EvalConfig)
    text = str(info.value)
    assert "eval.remote_environment:" in text and "eval.environment_step_timeout_s:" in text, text
    # the same setting in both spellings in one place (the file, or the overrides) is refused, naming the older one
    with pytest.raises(ConfigError, match="eval.num_tests_per_prompt: is the older spelling of rollouts.num_gen"):
        load_config(SHIPPED / "evals" / "eval.yaml",
                    ["eval.num_tests_per_prompt=2", "rollouts.num_generations_per_prompt=2"], EvalConfig)


def test_an_override_in_either_spelling_replaces_the_files_setting() -> None:
    for file in (SHIPPED / "evals" / "eval.yaml", OLDER / "eval.yaml"):
        for key in ("eval.num_tests_per_prompt", "rollouts.num_generations_per_prompt"):
            if file == OLDER / "eval.yaml" or key.startswith("eval."):
                with older_spelling():
                    cfg = load_config(file, [f"{key}=8"], EvalConfig)
            else:
                cfg = load_config(file, [f"{key}=8"], EvalConfig)
            assert cfg.rollouts.num_generations_per_prompt == 8, (file, key)
            assert cfg.key_as_written("rollouts.num_generations_per_prompt") == key
    # NeMo-RL's multi_turn over a single-turn file lifts the one-turn cap and keeps the file's environment
    with older_spelling():
        multi = load_config(SHIPPED / "evals" / "eval.yaml", ["eval.rollout_mode=multi_turn"],
                            EvalConfig).rollouts
    assert (multi.mode_name, multi.max_rollout_turns, multi.env.name) == ("multi_turn", None, "math")
    # a file in the older spelling that says single_turn still refuses a turn cap above one
    with pytest.raises(ConfigError, match="rollout_mode=single_turn runs one generation"), older_spelling():
        load_config(OLDER / "eval.yaml", ["eval.max_rollout_turns=4"], EvalConfig)
    # GRPO: NeMo-RL's grpo.num_generations_per_prompt over the shipped file
    with older_spelling():
        grpo = load_config(SHIPPED / "grpo_smollm2.yaml", ["grpo.num_generations_per_prompt=2"], GRPOConfig)
    assert grpo.rollouts.num_generations_per_prompt == 2


def test_input_problems_name_the_count_key_as_written(tmp_path: Path) -> None:
    from nemo_rl_ext.evals.config import input_problems

    data = tmp_path / "rows.jsonl"
    data.write_text('{"question": "q", "answer": "a", "agent_name": "x"}\n')
    with older_spelling():
        old = load_config(None, [f"eval.dataset_path={data}", "eval.save_path=s",
                                 "eval.num_tests_per_prompt={y: 1}", "policy.model_name=tiny"], EvalConfig)
    new = load_config(None, [f"eval.dataset_path={data}", "eval.save_path=s", "policy.model_name=tiny",
                             "rollouts.num_generations_per_prompt={y: 1}"], EvalConfig)
    assert any(p.startswith("eval.num_tests_per_prompt: rows of") for p in input_problems(old)), input_problems(old)
    assert any(p.startswith("rollouts.num_generations_per_prompt: rows of") for p in input_problems(new))


def test_an_eval_saved_in_the_older_spelling_resumes_under_the_new_one(tmp_path: Path) -> None:
    saved = tmp_path / "config.yaml"
    saved.write_text((OLDER / "eval.yaml").read_text())
    current = load_config(SHIPPED / "evals" / "eval.yaml", [], EvalConfig).model_dump(mode="json")
    canonical = lambda raw: EvalConfig.model_validate(raw).model_dump(mode="json")  # noqa: E731
    with older_spelling():
        check_resumable(saved, current, canonical)  # the same settings: no error
    changed = load_config(SHIPPED / "evals" / "eval.yaml", ["rollouts.max_seq_len=256"], EvalConfig)
    with pytest.raises(ConfigError, match=r"rollouts.max_seq_len: 512 -> 256"), older_spelling():
        check_resumable(saved, changed.model_dump(mode="json"), canonical)


def test_both_spellings_in_overrides_are_one_problem_naming_the_older_key() -> None:
    """An override layer's conflict is found again when the merged config is validated; it is reported once, and
    the older key left beside the new one is not also an 'Extra inputs' error."""
    with pytest.raises(ConfigError) as err:  # (refused before any older-spelling warning)
        load_config(SHIPPED / "evals" / "eval.yaml",
                    ["eval.num_tests_per_prompt=2", "rollouts.num_generations_per_prompt=2"], EvalConfig)
    lines = [line for line in str(err.value).splitlines() if line.lstrip().startswith("- ")]
    conflict = [line for line in lines if "eval.num_tests_per_prompt" in line]
    assert len(conflict) == 1 and "give only one (got 2)" in conflict[0]
    assert "Extra inputs" not in str(err.value)
