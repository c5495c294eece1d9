"""The `rollouts` config section that GRPO and the eval share, and every rule about it in one place.

    rollouts:
      mode: native                 # or nemo_gym: Gym agents own the turn loop and the reward
      num_generations_per_prompt: 4  # or {agent_name: n, _default: n}
      max_rollout_turns: null      # native: most generations per rollout (1: single turn)
      max_seq_len: 1024            # most tokens, prompt and every turn
      env: {name: math, kwargs: {}, system_prompt: null, remote: false, step_timeout_s: 300}
      gym: null                    # nemo_gym: where the agents are (GymConfig)
      fault_policy: {...}          # retries, deadlines, record or raise

`rollouts_rule_problems` holds the cross-field rules (with the `policy` section they depend on); GRPO and
the eval add only their own (GRPO: sampling is never greedy; eval: every k fits a sample count).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from nemo_rl_ext.config import INVALID, RuleProblem, StrictModel, raw_field
from nemo_rl_ext.data.generation_counts import DEFAULT_KEY, GenerationCounts
from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.gym.config import GymConfig
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation.interfaces import GenerationConfig

DEFAULT_ENVIRONMENT = "math"
"""The environment of native rollouts when `rollouts.env.name` is null."""


class EnvironmentSettings(StrictModel):
    """The environment that continues and scores native rollouts (rows' task_name)."""

    name: str | None = Field(default=None, description="A registered environment; null: math.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of its constructor.")
    system_prompt: str | None = Field(
        default=None,
        description="System message of every prompt; null: the environment's registered default (the calculator "
        'prompt for tool_calculator, none for math); "" for none.',
    )
    remote: bool = Field(
        default=False,
        description="Host it in a Ray actor (policy.cluster's Ray, or a local one) that a step past "
        "step_timeout_s kills and restarts; false: in this process (cheap environments).",
    )
    step_timeout_s: float = Field(default=300.0, gt=0.0, description="remote: deadline of one step, in seconds.")

    @field_validator("name")
    @classmethod
    def _known_environment(cls, value: str | None) -> str | None:
        if value is not None:
            # lazy: the registry imports the implementations; config validation stays light
            from nemo_rl_ext.environments import available_environments

            if value not in available_environments():
                raise ValueError(f"unknown environment {value!r}; known: {', '.join(available_environments())}")
        return value

    @property
    def resolved_name(self) -> str:
        """`name`, or the default environment."""
        return self.name or DEFAULT_ENVIRONMENT


class RolloutsConfig(StrictModel):
    """How rollouts are made, for training and evaluation alike: the mode is the only difference between
    native and NeMo Gym rollouts."""

    mode: str = Field(
        default="native",
        description="A registered rollout mode: native: the generate -> environment step loop in this process; "
        "nemo_gym: NeMo Gym agents own the turn loop and the reward; or one a plugin registers "
        "(`experience.rollout_modes.register_rollout_mode`).",
    )
    num_generations_per_prompt: int | dict[str, int] = Field(
        default=1, description="Samples per prompt: an int, or agent name -> int with `_default` as fallback."
    )
    max_rollout_turns: int | None = Field(
        default=None, ge=1, description="native: most generations per rollout (1: single turn; null: until "
        "max_seq_len or the environment ends it)."
    )
    max_seq_len: int = Field(default=1024, ge=2, description="Most tokens (prompt + every turn) per rollout.")
    env: EnvironmentSettings = Field(default_factory=EnvironmentSettings, description="native: the environment.")
    gym: GymConfig | None = Field(default=None, description="nemo_gym: where the Gym agents are.")
    fault_policy: FaultPolicy = Field(default_factory=FaultPolicy, description="Retries, deadlines, errors.")

    @field_validator("mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        # imported here: the registry imports the implementations (and torch); this module stays light to load
        from nemo_rl_ext.experience.rollout_modes import rollout_mode_class

        rollout_mode_class(value)  # an unknown name lists the registered ones
        return value

    @field_validator("num_generations_per_prompt", mode="before")
    @classmethod
    def _valid_counts(cls, value: Any) -> Any:
        GenerationCounts.parse(value)  # every bad entry in one ValueError -> one config problem
        return value

    @property
    def counts(self) -> GenerationCounts:
        """The parsed per-agent sample counts."""
        return GenerationCounts.parse(self.num_generations_per_prompt)

    @property
    def max_samples(self) -> int:
        """The largest number of samples any prompt gets."""
        return largest_count(self.num_generations_per_prompt)

    @property
    def mode_name(self) -> str:
        """single_turn, multi_turn (native) or nemo_gym: the eval's name of this setting (NeMo-RL's `rollout_mode`);
        a plugin's mode by its own name."""
        if self.mode != "native":
            return self.mode
        return "single_turn" if self.max_rollout_turns == 1 else "multi_turn"

    @property
    def gym_work_dir(self) -> Path | None:
        """Where the Gym servers this section launches keep env.yaml and their logs (None: it launches none, or
        a temp dir of the launcher's when `gym.launch.work_dir` is null)."""
        launch = self.gym.launch if self.gym is not None and self.mode == "nemo_gym" else None
        return None if launch is None else launch.work_dir

    def with_gym_work_dir(self, folder: Path) -> RolloutsConfig:
        """This section with `gym.launch.work_dir` set to `folder` when it launches Gym and sets none: a run
        keeps its Gym servers' logs in its own folder instead of a temp dir."""
        launch = self.gym.launch if self.gym is not None and self.mode == "nemo_gym" else None
        if self.gym is None or launch is None or launch.work_dir is not None:
            return self
        launch = launch.model_copy(update={"work_dir": Path(folder)})
        return self.model_copy(update={"gym": self.gym.model_copy(update={"launch": launch})})


def largest_count(value: int | Mapping[str, int]) -> int:
    """The largest count of an int-or-dict `num_generations_per_prompt`."""
    if isinstance(value, Mapping):
        return max(value.values(), default=1)
    return value


def rollouts_rule_problems(
    data: Mapping[str, Any], rollouts_cls: type[RolloutsConfig], *, seq_len_within_model: bool
) -> list[RuleProblem]:
    """The rules of a config with `rollouts` and `policy` sections, on the raw data (as `CheckedConfig` asks):

    - `rollouts.gym` is set exactly in nemo_gym mode;
    - nemo_gym: no turn cap, no environment settings, `policy.generation.top_k` null and no stop strings or
      stop token ids (the agents own the turn loop and the reward, call the policy through the OpenAI API,
      which has no top_k, and set their own stops);
    - more than one sample of a prompt needs `policy.generation.temperature` > 0;
    - with `seq_len_within_model` (GRPO: a training sequence is that long), `rollouts.max_seq_len` fits
      `policy.max_model_len`; without (the eval), a rollout is capped by both (see `build_rollouts`).
    """
    rollouts, policy = _section(data, "rollouts"), _section(data, "policy")
    gen = _section(policy, "generation")
    mode = raw_field(rollouts_cls, rollouts, "mode")
    problems = _gym_section_problems(mode, _section(rollouts, "gym"))
    if mode == "nemo_gym":
        problems += _nemo_gym_problems(rollouts, rollouts_cls, gen)
    problems += _greedy_sampling_problems(raw_field(rollouts_cls, rollouts, "num_generations_per_prompt"), gen)
    max_seq_len = raw_field(rollouts_cls, rollouts, "max_seq_len")
    max_model_len = raw_field(PolicyConfig, policy, "max_model_len")
    if seq_len_within_model and INVALID not in (max_seq_len, max_model_len) and max_seq_len > max_model_len:
        problems.append(
            (("rollouts", "max_seq_len"), f"exceeds policy.max_model_len ({max_model_len})", max_seq_len)
        )
    return problems


def _section(parent: Any, name: str) -> Any:
    """`parent[name]` when `parent` is a mapping (raw data may hold anything), else None."""
    return parent.get(name) if isinstance(parent, Mapping) else None


def _written(parent: Any, name: str, parsed: Any) -> Any:
    """The value as the user wrote it, for the problem's report; `parsed` when the raw data lacks it."""
    return parent[name] if isinstance(parent, Mapping) and name in parent else parsed


def _gym_section_problems(mode: Any, gym: Any) -> list[RuleProblem]:
    """`rollouts.gym` is set exactly in nemo_gym mode."""
    problems: list[RuleProblem] = []
    if mode == "nemo_gym" and gym is None:
        problems.append(
            (
                ("rollouts", "gym"),
                "is required with rollouts.mode=nemo_gym: gym.launch (start Gym from a venv), gym.head_server_url "
                "or gym.agent_urls",
                None,
            )
        )
    if mode == "native" and gym is not None:
        problems.append((("rollouts", "gym"), "is only used with rollouts.mode=nemo_gym", gym))
    return problems


def _nemo_gym_problems(rollouts: Any, rollouts_cls: type[RolloutsConfig], gen: Any) -> list[RuleProblem]:
    """nemo_gym mode: no turn cap, top_k null, no stops, no environment settings (the Gym agents own them)."""
    problems: list[RuleProblem] = []
    owned = "in nemo_gym mode the Gym agents own the turn loop"
    turns = raw_field(rollouts_cls, rollouts, "max_rollout_turns")
    if turns is not INVALID and turns is not None:
        written = _written(rollouts, "max_rollout_turns", turns)
        problems.append((("rollouts", "max_rollout_turns"), f"must be null: {owned}", written))
    for name, why in (
        ("top_k", "the OpenAI API that Gym agents call the policy through has no top_k"),
        ("stop_strings", "stops are set by the Gym agents, not by this config"),
        ("stop_token_ids", "stops are set by the Gym agents, not by this config"),
    ):
        value = raw_field(GenerationConfig, gen, name)
        if value is not INVALID and value:
            problems.append(
                (
                    ("policy", "generation", name),
                    f"must be {'null' if name == 'top_k' else 'empty'} in nemo_gym mode: {why}",
                    _written(gen, name, value),
                )
            )
    env = _section(rollouts, "env")
    for name in ("name", "system_prompt", "kwargs", "remote"):
        value = raw_field(EnvironmentSettings, env, name)
        if value is not INVALID and value:
            why = (
                "must be null in nemo_gym mode: the Gym rows carry their own input and the Gym agents score it"
                if name in ("name", "system_prompt")
                else "is only used with rollouts.mode=native: in nemo_gym mode the Gym agents score"
            )
            problems.append((("rollouts", "env", name), why, _written(env, name, value)))
    return problems


def _greedy_sampling_problems(counts: Any, gen: Any) -> list[RuleProblem]:
    """More than one sample of a prompt needs `policy.generation.temperature` > 0."""
    try:
        parsed = GenerationCounts.parse(counts) if counts is not INVALID else None
    except ValueError:
        parsed = None
    if parsed is None:
        return []
    many = {a: n for a, n in parsed.per_agent.items() if n > 1}
    if parsed.default is not None and parsed.default > 1:
        many[DEFAULT_KEY] = parsed.default
    temperature = raw_field(GenerationConfig, gen, "temperature")
    if not many or temperature is INVALID or not temperature <= 0:
        return []
    what = (
        f"num_generations_per_prompt={counts}"
        if isinstance(counts, int)
        else "num_generations_per_prompt gives more than one sample to "
        + ", ".join(f"{a}: {n}" for a, n in many.items())
    )
    return [
        (
            ("policy", "generation", "temperature"),
            f"temperature={temperature} is greedy decoding, so the samples of a prompt would all be the "
            f"same but {what}; set temperature > 0 or one sample per prompt",
            _written(gen, "temperature", temperature),
        )
    ]
