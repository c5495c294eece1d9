"""Older spellings of config keys, in one place: each is rewritten to today's key before validation
(`CheckedConfig.legacy_spellings`, so errors still name the key as the user wrote it) and reported with a
`DeprecationWarning` naming the old key and the new one.

- The eval (NeMo-RL's eval spelling): `eval.rollout_mode` (single_turn = `rollouts.mode: native` with
  `rollouts.max_rollout_turns: 1`; multi_turn = native, by default in tool_calculator; nemo_gym),
  `eval.num_tests_per_prompt`, `eval.max_rollout_turns`, `eval.max_seq_len`, `eval.environment`,
  `eval.system_prompt`, `eval.remote_environment`, `eval.environment_step_timeout_s` and a top-level `gym`
  section, all now under `rollouts`.
- GRPO (NeMo-RL's GRPO spelling, and this package's earlier one): `grpo.num_generations_per_prompt`,
  `grpo.max_rollout_turns`, `grpo.max_seq_len`, the `env` section and `data.system_prompt`, all now under
  `rollouts`; `logger.tensorboard` is now `logger.tensorboard_enabled` (NeMo-RL's name). NeMo-RL's advantage
  keys: `grpo.normalize_rewards` (`grpo.normalize_std`), `grpo.use_leave_one_out_baseline` (true:
  `grpo.baseline: leave_one_out`, false: `mean`) and the nested section `grpo.adv_estimator: {name,
  normalize_rewards, use_leave_one_out_baseline, reward_weights, minus_baseline}` (`name` is
  `grpo.adv_estimator`; its list of `reward_weights`, ordered by sorted component name, becomes the
  `{name: weight}` of `grpo.reward_weights` over `rollouts.gym.reward_components`; `minus_baseline` is
  `grpo.minus_baseline`). A key given in both spellings must agree.

The warning's category is `DeprecationWarning`, attributed to the config module: a CLI's output stays as it is
(Python shows it with `-W default` or `PYTHONWARNINGS=default`), tests and library callers see it.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nemo_rl_ext.config import Renames, RuleProblem

EVAL_MODES = ("single_turn", "multi_turn", "nemo_gym")
"""The values of the eval's `eval.rollout_mode` (NeMo-RL's spelling)."""

EVAL_KEYS: dict[str, tuple[str, ...]] = {
    "num_tests_per_prompt": ("rollouts", "num_generations_per_prompt"),
    "max_rollout_turns": ("rollouts", "max_rollout_turns"),
    "max_seq_len": ("rollouts", "max_seq_len"),
    "environment": ("rollouts", "env", "name"),
    "system_prompt": ("rollouts", "env", "system_prompt"),
    "remote_environment": ("rollouts", "env", "remote"),
    "environment_step_timeout_s": ("rollouts", "env", "step_timeout_s"),
}
"""`eval.<key>` of the eval's older spelling -> the key path of the shared section."""

_MODE_HINT = "single_turn is rollouts.mode: native with rollouts.max_rollout_turns: 1, multi_turn is native"


def warn_older_spellings(moves: Iterable[tuple[tuple[str, ...], tuple[str, ...]]]) -> None:
    """One DeprecationWarning per (old key path, new key path) of `moves`, naming both."""
    for old, new in moves:
        hint = f" ({_MODE_HINT})" if old == ("eval", "rollout_mode") else ""
        warnings.warn(
            f"config key {'.'.join(old)} is an older spelling of {'.'.join(new)}{hint}; it still loads, "
            f"but write {'.'.join(new)}",
            DeprecationWarning,
            stacklevel=4,
        )


def move_key(data: dict[str, Any], old: Sequence[str], new: Sequence[str], renames: Renames) -> list[RuleProblem]:
    """Move the value at key path `old` to `new` in the nested dict `data` (in place), recording the move in
    `renames`; nothing when `old` is absent. Returns a problem when both spellings are given."""
    parent: Any = data
    for part in old[:-1]:
        parent = parent.get(part) if isinstance(parent, Mapping) else None
    if not isinstance(parent, dict) or old[-1] not in parent:
        return []
    target: Any = data
    for part in new[:-1]:
        if not isinstance(target.get(part), dict):
            if target.get(part) is not None:
                return [(tuple(new[:-1]), "expected a section", target.get(part))]
            target[part] = {}
        target = target[part]
    if new[-1] in target:
        return [
            (tuple(old), f"is the older spelling of {'.'.join(new)}, which is also given; give only one", parent[old[-1]])
        ]
    target[new[-1]] = parent.pop(old[-1])
    if not parent and len(old) > 1:  # an emptied legacy section goes too (it may not exist any more)
        grand: Any = data
        for part in old[:-2]:
            grand = grand[part]
        grand.pop(old[-2])
    renames[tuple(new)] = tuple(old)
    return []


def eval_spellings(
    data: dict[str, Any], *, whole: bool = True, base: Mapping[str, Any] | None = None
) -> tuple[Renames, list[RuleProblem]]:
    """The eval's older spelling (module docstring) in `data` rewritten to the shared `rollouts` section, in
    place. Only a `whole` config gets the older spelling's defaults (single_turn; the calculator for
    multi_turn); an override (`whole` False) is read against `base`, the file as written."""
    renames: Renames = {}
    ev = data.get("eval")
    if ev is None and isinstance(data.get("rollouts"), Mapping):
        ev = {}  # (not added to `data`) a `rollouts` section alone is still read against the file's rollout_mode
    if not isinstance(ev, dict):
        return renames, []
    written = [("eval", key) for key in ev] + ([("gym",)] if "gym" in data else [])
    mode, problems = _eval_mode(data, ev, whole=whole, base=base)
    for name, new in EVAL_KEYS.items():
        problems += move_key(data, ("eval", name), new, renames)
    if mode is not None:
        data.setdefault("rollouts", {})
        if isinstance(data["rollouts"], dict):
            if "mode" in data["rollouts"]:
                problems.append((("eval", "rollout_mode"), "is also given as rollouts.mode; give only one", mode))
            else:
                data["rollouts"]["mode"] = "nemo_gym" if mode == "nemo_gym" else "native"
                renames[("rollouts", "mode")] = ("eval", "rollout_mode")
    problems += move_key(data, ("gym",), ("rollouts", "gym"), renames)
    warn_older_spellings((old, new) for new, old in renames.items() if old in written)
    return renames, problems


def _eval_mode(
    data: dict[str, Any], ev: dict[str, Any], *, whole: bool, base: Mapping[str, Any] | None
) -> tuple[str | None, list[RuleProblem]]:
    """`eval.rollout_mode` (taken out of `ev`; a `whole` config without a `rollouts` section defaults to
    single_turn) and its problems; fills in what the mode implied in the `eval` keys it moves."""
    problems: list[RuleProblem] = []
    spelled_new = isinstance(data.get("rollouts"), Mapping)
    mode = ev.pop("rollout_mode", "single_turn" if whole and not spelled_new else None)
    if mode is not None and mode not in EVAL_MODES:
        allowed = ", ".join(repr(m) for m in EVAL_MODES[:-1]) + f" or {EVAL_MODES[-1]!r}"
        problems.append((("eval", "rollout_mode"), f"Input should be {allowed}", mode))
        mode = None
    if mode == "multi_turn" and whole and ev.get("environment") is None:
        ev["environment"] = "tool_calculator"  # the older spelling's default for multi_turn
    rollouts = data.get("rollouts") if spelled_new else {}
    if mode == "multi_turn" and "max_rollout_turns" not in ev and "max_rollout_turns" not in rollouts:
        ev["max_rollout_turns"] = None  # multi_turn over a single-turn file: no longer one turn
    written_mode = mode
    if mode is None and isinstance(base, Mapping) and isinstance(base.get("eval"), Mapping):
        base_default = None if isinstance(base.get("rollouts"), Mapping) else "single_turn"
        written_mode = base["eval"].get("rollout_mode", base_default)
    problems += _single_turn_caps(ev, rollouts, mode, written_mode)
    if mode == "nemo_gym":
        for name in ("environment", "system_prompt"):
            if name in ev and ev[name] is None:
                ev.pop(name)  # null is the older spelling's "not set"
    return mode, problems


def _single_turn_caps(
    ev: dict[str, Any], rollouts: Mapping[str, Any], mode: str | None, written_mode: str | None
) -> list[RuleProblem]:
    """single_turn is one turn. Where the config says single_turn (in this layer, or in the file under these
    overrides) a turn cap over 1 is refused in either spelling, and `rollouts.max_rollout_turns` must be 1 if
    given; where this layer says it and gives no cap in the new spelling, `eval.max_rollout_turns` becomes 1."""
    if written_mode != "single_turn":
        return []
    problems: list[RuleProblem] = []
    turns = ev.get("max_rollout_turns")
    if isinstance(turns, int) and not isinstance(turns, bool) and turns > 1:
        problems.append((("eval", "max_rollout_turns"), _one_turn_only(turns), turns))
    if "max_rollout_turns" in rollouts:
        given = rollouts["max_rollout_turns"]
        if isinstance(given, bool) or given != 1:
            problems.append((("rollouts", "max_rollout_turns"), _one_turn_only(given), given))
    elif mode == "single_turn":
        ev["max_rollout_turns"] = 1
    return problems


def _one_turn_only(turns: Any) -> str:
    return (
        f"rollout_mode=single_turn runs one generation and one environment step, so max_rollout_turns={turns} "
        "would be ignored; remove it or use rollout_mode=multi_turn"
    )


def grpo_spellings(
    data: dict[str, Any], *, whole: bool = True, base: Mapping[str, Any] | None = None
) -> tuple[Renames, list[RuleProblem]]:
    """NeMo-RL's GRPO spellings in `data` rewritten to the shared `rollouts` section, in place:
    `grpo.num_generations_per_prompt`, `grpo.max_rollout_turns`, `grpo.max_seq_len`, the `env` section and
    `data.system_prompt` (this package's earlier spelling; `env` other than `env.remote` is ignored in nemo_gym
    mode, as it was)."""
    renames: Renames = {}
    problems: list[RuleProblem] = []
    for name in ("num_generations_per_prompt", "max_rollout_turns", "max_seq_len"):
        problems += move_key(data, ("grpo", name), ("rollouts", name), renames)
    rollouts = data.get("rollouts")
    gym_mode = isinstance(rollouts, Mapping) and rollouts.get("mode") == "nemo_gym"
    env = data.get("env")
    if gym_mode and isinstance(env, dict):
        for name in ("name", "kwargs", "step_timeout_s"):
            env.pop(name, None)
        if not env:
            data.pop("env")
    if isinstance(data.get("env"), dict):
        for name in list(data["env"]):  # unknown keys too: their error then names env.<key>
            problems += move_key(data, ("env", name), ("rollouts", "env", name), renames)
    problems += move_key(data, ("data", "system_prompt"), ("rollouts", "env", "system_prompt"), renames)
    problems += move_key(data, ("logger", "tensorboard"), ("logger", "tensorboard_enabled"), renames)
    problems += advantage_spellings(data, renames, base=base)
    moves = [(old, new) for new, old in renames.items() if old[0] != "env"]
    if any(old[0] == "env" for old in renames.values()):  # a section moved whole is named once
        moves.append((("env",), ("rollouts", "env")))
    warn_older_spellings(moves)
    return renames, problems


ADV_ESTIMATOR_KEYS: dict[str, tuple[str, ...]] = {
    "name": ("grpo", "adv_estimator"),
    "normalize_rewards": ("grpo", "normalize_std"),
    "use_leave_one_out_baseline": ("grpo", "baseline"),
    "reward_weights": ("grpo", "reward_weights"),
    "minus_baseline": ("grpo", "minus_baseline"),
}
"""NeMo-RL's nested `grpo.adv_estimator.<key>` -> today's key path."""


def advantage_spellings(data: dict[str, Any], renames: Renames, *, base: Mapping[str, Any] | None = None
                        ) -> list[RuleProblem]:
    """NeMo-RL's advantage keys (module docstring) rewritten in `data` in place, recording each move in
    `renames`; returns the problems (values that cannot move, a key given twice with different values)."""
    grpo = data.get("grpo")
    if not isinstance(grpo, dict):
        return []
    problems: list[RuleProblem] = []
    for name in ("normalize_rewards", "use_leave_one_out_baseline"):
        if name in grpo:
            problems += _put(data, ("grpo", name), grpo.pop(name), renames)
    section = grpo.get("adv_estimator")
    if not isinstance(section, dict):
        return problems
    del grpo["adv_estimator"]
    for key, value in section.items():
        old = ("grpo", "adv_estimator", key)
        if key not in ADV_ESTIMATOR_KEYS:
            problems.append((old, f"is not a key of NeMo-RL's grpo.adv_estimator section that this package reads "
                             f"(those are {', '.join(ADV_ESTIMATOR_KEYS)})", value))
        elif key == "reward_weights" and isinstance(value, list | tuple):
            weights, problem = _weights_by_name(data, base, value)
            problems += [(old, problem, value)] if problem else _put(data, old, weights, renames)
        else:
            problems += _put(data, old, value, renames)
    return problems


def _put(data: dict[str, Any], old: tuple[str, ...], value: Any, renames: Renames) -> list[RuleProblem]:
    """Set NeMo-RL's advantage key `old` (already taken out of `data`) at today's key, converting the value of
    `use_leave_one_out_baseline`; a problem when today's key holds a different value."""
    new = ADV_ESTIMATOR_KEYS[old[-1]]
    if old[-1] == "use_leave_one_out_baseline":
        if not isinstance(value, bool):
            return [(old, "must be true or false", value)]
        value = "leave_one_out" if value else "mean"
    grpo = data["grpo"]
    if new[-1] in grpo and grpo[new[-1]] != value:
        return [(old, f"is the older spelling of {'.'.join(new)}, which is also given with another value "
                 f"({grpo[new[-1]]!r}); give only one", value)]
    grpo[new[-1]] = value
    if new in renames:  # NeMo-RL's flat key and the section's both: the first is warned here, the last below
        warn_older_spellings([(renames[new], new)])
    renames[new] = old  # warned with the other moves by `grpo_spellings`
    return []


def _weights_by_name(data: Mapping[str, Any], base: Mapping[str, Any] | None, weights: Sequence[Any]
                     ) -> tuple[dict[str, Any], str | None]:
    """NeMo-RL's list of GDPO weights (ordered by sorted component name) as {name: weight}, over the names of
    `rollouts.gym.reward_components` (of `data`, else of `base`); ({}, the problem) when that cannot be done."""
    names = None
    for source in (data, base):
        rollouts = source.get("rollouts") if isinstance(source, Mapping) else None
        gym = rollouts.get("gym") if isinstance(rollouts, Mapping) else None
        if isinstance(gym, Mapping) and isinstance(gym.get("reward_components"), list | tuple):
            names = sorted(str(n) for n in gym["reward_components"])
            break
    if names is None:
        return {}, ("a list of weights is ordered by the components' sorted names, which this config does not "
                    "list: write grpo.reward_weights as {name: weight}")
    if len(names) != len(weights):
        return {}, (f"has {len(weights)} weights for the {len(names)} components of rollouts.gym.reward_components "
                    f"{names} (one per component, in sorted name order)")
    return dict(zip(names, weights, strict=True)), None
