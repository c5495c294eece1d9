"""NeMo-RL's `eval.rollout_mode: single_turn` beside the new `rollouts` section: the turn cap it implies (one)
agrees with a `rollouts.max_rollout_turns: 1` and refuses any other, naming the key as written, once."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig

SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "configs" / "evals" / "eval.yaml"


def mixed_file(tmp_path: Path) -> Path:
    """eval.yaml with NeMo-RL's `eval.rollout_mode: single_turn` for its `rollouts.mode: native` (its header
    comment says the older keys are accepted); its `rollouts.max_rollout_turns: 1` stays."""
    data = yaml.safe_load(SHIPPED.read_text())
    data["eval"]["rollout_mode"] = data["rollouts"].pop("mode") and "single_turn"
    assert data["rollouts"]["max_rollout_turns"] == 1
    path = tmp_path / "mixed.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_single_turn_beside_a_cap_of_one_loads_as_one_turn(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match="eval.rollout_mode"):
        cfg = load_config(mixed_file(tmp_path), [], EvalConfig)
    assert (cfg.rollouts.mode, cfg.rollouts.max_rollout_turns) == ("native", 1)
    with pytest.warns(DeprecationWarning, match="eval.rollout_mode"):
        cfg = load_config(SHIPPED, ["eval.rollout_mode=single_turn", "rollouts.max_rollout_turns=1"], EvalConfig)
    assert (cfg.rollouts.mode, cfg.rollouts.max_rollout_turns) == ("native", 1)


@pytest.mark.parametrize(
    ("overrides", "got"),
    [
        (["rollouts.max_rollout_turns=2"], "2"),  # over a file that says single_turn
        (["rollouts.max_rollout_turns=null"], "None"),  # no cap is not one turn either
    ],
)
def test_a_new_spelling_cap_other_than_one_under_single_turn_is_one_problem(tmp_path, overrides, got) -> None:
    with pytest.raises(ConfigError) as err, pytest.warns(DeprecationWarning):
        load_config(mixed_file(tmp_path), overrides, EvalConfig)
    message = str(err.value)
    assert "1 problem(s)" in message
    assert "rollouts.max_rollout_turns: rollout_mode=single_turn runs one generation" in message
    assert f"(got {got})" in message
    assert "eval.max_rollout_turns" not in message  # a key the user never wrote


def test_single_turn_given_with_a_cap_of_three_in_overrides_names_the_cap() -> None:
    with pytest.raises(ConfigError) as err, pytest.warns(DeprecationWarning):
        load_config(SHIPPED, ["eval.rollout_mode=single_turn", "rollouts.max_rollout_turns=3"], EvalConfig)
    assert "1 problem(s)" in str(err.value) and "rollouts.max_rollout_turns" in str(err.value)
    assert "(got 3)" in str(err.value) and "Extra inputs" not in str(err.value)
