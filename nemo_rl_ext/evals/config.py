"""The eval config: sections `eval`, `policy` and `gym`, validated with every problem reported at once.

    cfg = load_config("examples/configs/evals/eval.yaml", ["eval.num_tests_per_prompt=8"], EvalConfig)

Field problems (wrong types, unknown keys, out-of-range values) and the cross-field rules below are
collected into one `ValidationError`, so one run of the CLI lists everything that is wrong:

- `single_turn` rejects `eval.max_rollout_turns` > 1 (it runs one generation and one environment step).
- `nemo_gym` requires `eval.max_rollout_turns: null`, `policy.generation.top_k: null`, no
  `stop_strings` and no `stop_token_ids` (Gym agents own the turn loop and call the policy through the
  OpenAI API, which has no top_k and whose stops the agents set), and no `eval.environment` /
  `eval.system_prompt` (the Gym rows carry their own input; the agents own the reward).
- more than one sample per prompt (for any agent) requires `policy.generation.temperature` > 0.
- every k in `eval.ks` must be <= the largest sample count (otherwise it is reported for no prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from nemo_rl_ext.config import INVALID, CheckedConfig, RuleProblem, StrictModel, raise_problems, raw_field
from nemo_rl_ext.data.generation_counts import DEFAULT_KEY, GenerationCounts
from nemo_rl_ext.gym.config import GymConfig, resolve_gym_path
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation.interfaces import GenerationConfig

RolloutMode = Literal["single_turn", "multi_turn", "nemo_gym"]

DEFAULT_ENVIRONMENTS: dict[str, str] = {"single_turn": "math", "multi_turn": "tool_calculator"}
"""The environment each native mode uses when `eval.environment` is null."""


class EvalSettings(StrictModel):
    """What to evaluate, how many samples, which metrics, and where the outputs go."""

    rollout_mode: RolloutMode = Field(
        default="single_turn",
        description="single_turn: one generation, one env step; multi_turn: the native env loop; "
        "nemo_gym: NeMo Gym agents own the turn loop and the reward.",
    )
    dataset_path: str = Field(
        description="JSONL dataset: rows with question/answer (native modes) or Gym rows with "
        "responses_create_params and agent_ref.name or gym.agent_name (nemo_gym). Relative paths are relative "
        "to the CWD; in nemo_gym mode with gym.launch, one not found there is looked up in the Gym install."
    )
    save_path: str = Field(description="Output folder; re-running with the same folder resumes.")
    num_prompts: int | None = Field(default=None, ge=1, description="Evaluate only the first N rows.")
    num_tests_per_prompt: int | dict[str, int] = Field(
        default=1, description="Samples per prompt: an int, or agent name -> int with `_default` as fallback."
    )
    ks: tuple[int, ...] | None = Field(
        default=None,
        description="The k of pass@k, maj@k, mean@k; null: powers of two up to the largest sample count, "
        "and that count.",
    )
    reward_threshold: float = Field(
        default=1.0, description="A sample is correct when its reward is >= this."
    )
    max_rollout_turns: int | None = Field(
        default=None, ge=1, description="multi_turn: most generations per rollout (null: until max_seq_len)."
    )
    max_seq_len: int = Field(default=1024, ge=2, description="Most tokens (prompt + all turns) per rollout.")
    environment: str | None = Field(
        default=None,
        description="Native modes: the registered environment; null: math (single_turn) or "
        "tool_calculator (multi_turn).",
    )
    remote_environment: bool = Field(
        default=False,
        description="Native modes: host the environment in a Ray actor (policy.cluster's Ray, or a local one) "
        "that a step past environment_step_timeout_s kills and restarts; false: in this process.",
    )
    environment_step_timeout_s: float = Field(
        default=300.0, gt=0.0, description="remote_environment: deadline of one environment step, in seconds."
    )
    system_prompt: str | None = Field(
        default=None,
        description="Native modes: system message of every prompt; null: the environment's default "
        '(the calculator prompt for tool_calculator, none for math); "" for none.',
    )
    save_token_ids: bool = Field(default=False, description="Also write each message's token ids.")
    max_concurrent_prompts: int | None = Field(
        default=None,
        ge=1,
        description="Prompts rolled out at once (null: all); smaller keeps more "
        "finished groups on disk if a run is killed.",
    )
    max_error_rate: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of samples that may end as errors (infrastructure failures, not answers) for the "
        "run to succeed; above it the CLI exits 3. 0: any error left fails the run; 1: errors never do.",
    )

    @field_validator("num_tests_per_prompt", mode="before")
    @classmethod
    def _valid_counts(cls, value: Any) -> Any:
        """Every bad entry in one error (bools and strings are not counts)."""
        try:
            GenerationCounts.parse(value)
        except ValueError as exc:
            raise ValueError(str(exc).replace("num_generations_per_prompt", "num_tests_per_prompt")) from None
        return value

    @field_validator("ks")
    @classmethod
    def _positive_ks(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        bad = [k for k in value if k < 1]
        if bad:
            raise ValueError(f"every k must be >= 1; bad: {bad}")
        if not value:
            raise ValueError("ks must list at least one k (or be null for the default)")
        return tuple(sorted(set(value)))

    @field_validator("environment")
    @classmethod
    def _known_environment(cls, value: str | None) -> str | None:
        if value is not None:
            from nemo_rl_ext.environments import available_environments

            if value not in available_environments():
                raise ValueError(
                    f"unknown environment {value!r}; known: {', '.join(available_environments())}"
                )
        return value

    @property
    def max_samples(self) -> int:
        """The largest number of samples any prompt gets."""
        return max_sample_count(self.num_tests_per_prompt)

    @property
    def resolved_ks(self) -> tuple[int, ...]:
        """`ks`, or the default: 1, 2, 4, ... up to the largest sample count, and that count."""
        if self.ks is not None:
            return self.ks
        n, ks, k = self.max_samples, [], 1
        while k < n:
            ks.append(k)
            k *= 2
        return (*ks, n)

    @property
    def resolved_environment(self) -> str | None:
        """The environment of a native mode (None for nemo_gym)."""
        return self.environment or DEFAULT_ENVIRONMENTS.get(self.rollout_mode)


class EvalConfig(CheckedConfig):
    """A whole eval run: `eval` settings, the `policy` that generates, the `gym` section (nemo_gym)."""

    eval: EvalSettings
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    gym: GymConfig | None = Field(
        default=None, description="nemo_gym mode: where the Gym agents are (passed as the manager's gym_config)."
    )

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[RuleProblem]:
        """The cross-field rules of the module docstring."""
        return rule_problems(data)


def input_problems(cfg: EvalConfig) -> list[str]:
    """What a run of `cfg` would stop on once its model is loaded, found without loading it: a missing model
    folder, a missing or unreadable dataset, rows whose agent has no count in `num_tests_per_prompt`."""
    from nemo_rl_ext.experience.input_checks import dataset_problems

    ev = cfg.eval
    problems = [p for p in (cfg.policy.model_folder_problem(),) if p is not None]
    if ev.rollout_mode == "nemo_gym" and cfg.gym is not None and cfg.gym.launch is not None:
        from nemo_rl_ext.gym.launcher import missing_config_paths

        problems += missing_config_paths(cfg.gym.launch)
    problems += dataset_problems(
        "eval.dataset_path",
        dataset_file(cfg),
        gym_rows=ev.rollout_mode == "nemo_gym",
        task_name=ev.resolved_environment,
        required=("question", "answer"),
        counts=ev.num_tests_per_prompt,
        counts_key="eval.num_tests_per_prompt",
        limit=ev.num_prompts,
        gym_agent_name=cfg.gym.agent_name if ev.rollout_mode == "nemo_gym" and cfg.gym is not None else None,
    )
    return problems


def dataset_file(cfg: EvalConfig) -> Path:
    """`eval.dataset_path` from the CWD; in nemo_gym mode with `gym.launch`, a relative path that is not
    there is looked up in the Gym install (e.g. resources_servers/mcqa/data/example.jsonl)."""
    launch = cfg.gym.launch if cfg.eval.rollout_mode == "nemo_gym" and cfg.gym is not None else None
    return resolve_gym_path(cfg.eval.dataset_path, launch.gym_venv if launch is not None else None)


def check_inputs(cfg: EvalConfig) -> None:
    """Raise one ConfigError listing every `input_problems` of `cfg` (the CLI calls it before loading)."""
    raise_problems(input_problems(cfg), "the eval's inputs")


def max_sample_count(value: int | Mapping[str, int]) -> int:
    """The largest count of an int-or-dict `num_tests_per_prompt`."""
    if isinstance(value, Mapping):
        return max(value.values(), default=1)
    return value


# ---- the cross-field rules, on the raw data (so they run even when other fields are invalid) ----------


def rule_problems(data: Mapping[str, Any]) -> list[RuleProblem]:
    """Every broken cross-field rule as (key path, message, offending value); fields that don't validate
    on their own are skipped here (their own error reports them)."""
    ev = data.get("eval")
    policy = data.get("policy")
    gen = policy.get("generation") if isinstance(policy, Mapping) else None

    def e(name: str) -> Any:
        return raw_field(EvalSettings, ev, name)

    def g(name: str) -> Any:
        return raw_field(GenerationConfig, gen, name)

    def raw(section: Any, name: str, parsed: Any) -> Any:
        """The value as written (for the message), else the parsed default."""
        return section[name] if isinstance(section, Mapping) and name in section else parsed

    mode, turns, counts, ks = e("rollout_mode"), e("max_rollout_turns"), e("num_tests_per_prompt"), e("ks")
    problems: list[RuleProblem] = []
    if mode == "single_turn" and turns is not INVALID and turns is not None and turns > 1:
        problems.append(
            (
                ("eval", "max_rollout_turns"),
                f"rollout_mode=single_turn runs one generation and one environment step, so "
                f"max_rollout_turns={turns} would be ignored; remove it or use rollout_mode=multi_turn",
                raw(ev, "max_rollout_turns", turns),
            )
        )
    if mode == "nemo_gym" and data.get("gym") is None:
        problems.append(
            (
                ("gym",),
                "is required in nemo_gym mode: gym.launch (start Gym from a venv), gym.head_server_url "
                "or gym.agent_urls",
                None,
            )
        )
    if mode != "nemo_gym" and data.get("gym") is not None:
        problems.append((("gym",), f"is only used in nemo_gym mode, not {mode}", data.get("gym")))
    if mode == "nemo_gym":
        gym_owned = "in nemo_gym mode the Gym agents own the turn loop"
        if turns is not INVALID and turns is not None:
            problems.append(
                (
                    ("eval", "max_rollout_turns"),
                    f"must be null: {gym_owned}",
                    raw(ev, "max_rollout_turns", turns),
                )
            )
        for name, why in (
            ("top_k", "the OpenAI API that Gym agents call the policy through has no top_k"),
            ("stop_strings", "stops are set by the Gym agents, not by the eval config"),
            ("stop_token_ids", "stops are set by the Gym agents, not by the eval config"),
        ):
            value = g(name)
            if value is not INVALID and value:
                problems.append(
                    (
                        ("policy", "generation", name),
                        f"must be {'null' if name == 'top_k' else 'empty'} in nemo_gym mode: {why}",
                        raw(gen, name, value),
                    )
                )
        for name in ("environment", "system_prompt"):
            value = e(name)
            if value is not INVALID and value is not None:
                problems.append(
                    (
                        ("eval", name),
                        "must be null in nemo_gym mode: the Gym rows carry their own "
                        "input and the Gym agents score it",
                        raw(ev, name, value),
                    )
                )
        if e("remote_environment") is True:
            problems.append(
                (("eval", "remote_environment"), "must be false in nemo_gym mode: the Gym agents score", True)
            )
    try:
        parsed = GenerationCounts.parse(counts) if counts is not INVALID else None
    except ValueError:
        parsed = None
    if parsed is not None:
        many = {a: n for a, n in parsed.per_agent.items() if n > 1}
        if parsed.default is not None and parsed.default > 1:
            many[DEFAULT_KEY] = parsed.default
        temperature = g("temperature")
        if many and temperature is not INVALID and temperature <= 0:
            what = (
                f"num_tests_per_prompt={counts}"
                if isinstance(counts, int)
                else (
                    "num_tests_per_prompt gives more than one sample to "
                    + ", ".join(f"{a}: {n}" for a, n in many.items())
                )
            )
            problems.append(
                (
                    ("policy", "generation", "temperature"),
                    f"temperature={temperature} is greedy decoding, so the samples of a prompt would all be the same "
                    f"but {what}; set temperature > 0 or one sample per prompt",
                    raw(gen, "temperature", temperature),
                )
            )
        largest = max_sample_count(counts)
        if ks is not INVALID and ks:
            too_big = [k for k in ks if k > largest]
            if too_big:
                problems.append(
                    (
                        ("eval", "ks"),
                        f"k={too_big} larger than the largest sample count ({largest} from num_tests_per_prompt) "
                        f"would be reported for no prompt",
                        raw(ev, "ks", ks),
                    )
                )
    return problems
