"""The GRPO config schema: one typed section per concept, every problem reported in one `ConfigError`.

    cfg = load_config("examples/configs/grpo_smollm2.yaml", ["grpo.max_num_steps=3"], GRPOConfig)

Field problems (types, ranges, unknown keys) and the cross-field rules of `GRPOConfig.rule_problems` are
reported together. `input_problems` then checks what would otherwise fail only once the model is loaded
(the model folder, the data files and their agents' counts, the environment name), and a resumed run
refuses a config that differs from its checkpoint's outside `RESUME_MAY_CHANGE`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from nemo_rl_ext.compat import grpo_spellings
from nemo_rl_ext.config import INVALID, CheckedConfig, Renames, RuleProblem, StrictModel, raw_field
from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.experience.config import EnvironmentSettings, RolloutsConfig, rollouts_rule_problems
from nemo_rl_ext.experience.resume_keys import GRPO_RESUME_MAY_CHANGE
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation.interfaces import GenerationConfig
from nemo_rl_ext.objectives.loss_settings import LossSettings
from nemo_rl_ext.training.config import (
    OptimizerSettings,
    TrainerSettings,
    optimizer_rule_problems,
    trainer_rule_problems,
)

RESUME_MAY_CHANGE: tuple[str, ...] = GRPO_RESUME_MAY_CHANGE
"""Keys (and sections: `logger` means `logger.*`) that may differ between a run and its resumption
(`experience.resume_keys`, where the eval's list is too): how long to train, when to checkpoint and validate
and on what, where logs and outputs go, the hf batch size, and where the Gym servers listen. Any other change
is refused, listing the changed keys."""


RESTART = "restart"
"""`resume=restart`: start over in an output_dir that holds an earlier run (the only way to discard it)."""


class DynamicSamplingSettings(StrictModel):
    """DAPO-style dynamic sampling: keep only groups whose rewards differ, generate more to fill the step."""

    enabled: bool = Field(default=False, description="Drop zero-variance groups and roll out more prompts.")
    max_gen_batches: int = Field(
        default=4, ge=1, description="Most rollout batches (of num_prompts_per_step prompts) per training step."
    )


class AsyncSettings(StrictModel):
    """Asynchronous GRPO (`grpo/async_collector.py`): rollouts stay in flight while the trainer steps,
    each trained group at most `max_lag` policy versions behind the weights it trains."""

    enabled: bool = Field(default=False, description="Stream groups to the trainer; false: the synchronous loop.")
    max_lag: int = Field(
        default=1, ge=0, description="Most policy versions a trained group's oldest token may lag; 0 is on-policy."
    )
    in_flight: Literal["finish", "abort"] = Field(
        default="abort",
        description="Generations in flight at a weight update: abort and continue on the new weights (the turn "
        "keeps its tokens, each with its version), or finish on the old ones (the refit then waits for the "
        "longest generation in flight).",
    )
    oversample: int = Field(
        default=0, ge=0, description="Groups started beyond what the steps within max_lag need (straggler slack)."
    )
    group_deadline_s: float | None = Field(
        default=None, gt=0.0, description="A group running longer is cancelled and counted; None: no deadline."
    )
    queue_size: int | None = Field(
        default=None, ge=1, description="Most finished groups waiting for the trainer (admission stops); None: "
        "what max_lag and oversample allow."
    )


def async_wedge_warning(settings: AsyncSettings) -> str | None:
    """The warning for an asynchronous config where one group that never finishes stops the run (None when
    there is slack): max_lag 0 leaves no spare budget slot, as the synchronous loop has none."""
    if not (settings.enabled and settings.max_lag == 0 and settings.oversample == 0
            and settings.group_deadline_s is None):
        return None
    return ("grpo.async: max_lag 0 with oversample 0 and no group_deadline_s: a group that never finishes (a hung "
            "generation; a hung environment step until rollouts.fault_policy.env_step_timeout_s) stops the run, as "
            "it would the synchronous loop. Set grpo.async.oversample >= 1 or grpo.async.group_deadline_s.")


def stale_rollouts_lag(data: Mapping[str, Any]) -> int:
    """`grpo.async.max_lag` of a raw config when asynchronous GRPO is on with max_lag > 0 (rollouts may then come
    from weights one or more steps old), else 0; 0 too where those keys don't validate (their error says why)."""
    grpo = data.get("grpo")
    if not isinstance(grpo, Mapping):
        return 0
    settings = grpo.get("async", grpo.get("async_"))
    enabled = raw_field(AsyncSettings, settings, "enabled")
    max_lag = raw_field(AsyncSettings, settings, "max_lag")
    return max_lag if enabled is True and max_lag is not INVALID and max_lag > 0 else 0


class GRPOSettings(StrictModel):
    """The loop: how many prompts and samples per step, for how long, and when to validate and save."""

    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True, validate_by_name=True,
                              validate_by_alias=True)

    num_prompts_per_step: int = Field(default=8, ge=1, description="Prompts (groups) per training step.")
    max_num_steps: int = Field(default=100, ge=1, description="Training steps of the whole run.")
    baseline: Literal["mean", "leave_one_out"] = Field(
        default="leave_one_out",
        description="Group reward baseline: the mean of the other samples (NeMo-RL's default) or of all.",
    )
    normalize_std: bool = Field(
        default=True, description="Divide advantages by a reward std (skipped where that std is 0)."
    )
    std_scope: Literal["baseline", "group"] = Field(
        default="baseline",
        description="Std of the rewards the baseline averages (NeMo-RL), or of the whole group for every sample.",
    )
    adv_estimator: Literal["grpo", "gdpo", "reinforce_plus_plus"] = Field(
        default="grpo",
        description="grpo: advantages of the scalar reward; gdpo (NeMo-RL's, multi-reward): A_n = each named reward "
        "component's group advantage (same baseline and std as grpo), A = sum_n reward_weights[n] * A_n, then "
        "A = (A - mean) / std over the step's valid samples. Needs an environment that reports two or more "
        "components (rollouts.gym.reward_components for nemo_gym). reinforce_plus_plus (NeMo-RL's): A = r - the "
        "group mean (minus_baseline), minus kl_coef * KL per token with loss.use_kl_in_reward, then whitened over "
        "the step's trained tokens (baseline, normalize_std and std_scope are not read).",
    )
    minus_baseline: bool = Field(
        default=True, description="reinforce_plus_plus: subtract the group's mean reward (NeMo-RL's "
        "adv_estimator.minus_baseline); false: the raw reward, whitened."
    )
    reward_weights: dict[str, float] | None = Field(
        default=None,
        description="gdpo: {component: weight} of the sum (NeMo-RL's list, by name); every component the "
        "environment reports must be named. None: every component, weight 1.",
    )
    overlong_filtering: bool = Field(default=False, description="Truncated rollouts get no loss.")
    dynamic_sampling: DynamicSamplingSettings = Field(default_factory=DynamicSamplingSettings)
    val_period: int = Field(default=0, ge=0, description="Validate every this many steps; 0 never.")
    val_at_start: bool = Field(default=False, description="Also validate before the first step.")
    save_period: int = Field(
        default=0, ge=0, description="Checkpoint every this many steps and at the last; 0 never."
    )
    seed: int = Field(default=42, description="Seed of data order, torch, and rollouts when generation.seed is unset.")
    stop_timeout_s: float = Field(
        default=600.0, gt=0.0, description="On SIGTERM / Ctrl-C, most seconds to finish the step in progress and "
        "checkpoint it before stopping at once without a new checkpoint.",
    )
    async_: AsyncSettings = Field(
        default_factory=AsyncSettings, alias="async", description="Asynchronous GRPO (`grpo.async` in YAML)."
    )


class DatasetEntry(StrictModel):
    """One of several training datasets (`data.datasets`), with its own environment and sampling weight."""

    path: Path = Field(description="The dataset: the kinds of source data.train_path takes.")
    subset: str | None = Field(default=None, description="The subset (configuration) of a hub dataset.")
    split: str = Field(default="train", description="The split of a hub dataset or save_to_disk folder.")
    weight: float = Field(default=1.0, gt=0.0, description="Sampling weight: a draw comes from this dataset with "
                          "probability weight / (sum of the weights).")
    env: EnvironmentSettings | None = Field(
        default=None, description="The environment that scores its rows (its rows' agent unless a row names one; "
        "the same keys as rollouts.env); null: rollouts.env. Native rollouts only."
    )


class DataSettings(StrictModel):
    """Datasets (JSONL, parquet, CSV, JSON, Arrow, a save_to_disk folder or a hub id) turned into prompts for the
    environment; the column names of NeMo-RL, TRL and verl are read (docs/datasets.md)."""

    train_path: Path | None = Field(
        default=None,
        description="Training rows: a .jsonl / .json / .parquet / .csv / .arrow file, a folder written by "
        "save_to_disk, or a Hugging Face hub id (owner/name, with data.subset and data.split). Exactly one of "
        "train_path and datasets.",
    )
    datasets: tuple[DatasetEntry, ...] = Field(
        default=(), description="Several training datasets instead of train_path, each with its own environment "
        "and sampling weight (draws seeded by grpo.seed); split_validation_size applies to each."
    )
    val_path: Path | None = Field(
        default=None, description="Validation rows (the same kinds of source); None: split_validation_size "
        "rows of the training set, or (0) the training set itself."
    )
    subset: str | None = Field(default=None, description="The subset (configuration) of a hub dataset.")
    split: str = Field(default="train", description="The split of a hub dataset or save_to_disk folder (training).")
    val_split: str = Field(
        default="validation", description="The split of a hub dataset or save_to_disk folder named by val_path."
    )
    split_validation_size: float = Field(
        default=0.0, ge=0.0, description="Without val_path: hold out this many training rows for validation "
        "(a count, or a fraction of the rows when < 1), drawn by a permutation seeded with grpo.seed; 0: none.",
    )
    question_key: str = Field(
        default="question", description="Key of the prompt text (NeMo-RL's input_key); without it a row's "
        "prompt is its `prompt` (a string or messages) or `messages` column."
    )
    answer_key: str = Field(
        default="answer", description="Key of the ground truth (NeMo-RL's output_key); without it a trailing "
        "assistant message, `ground_truth` or `reward_model.ground_truth`."
    )
    shuffle: bool = Field(default=True, description="Shuffle the rows each epoch (seeded by grpo.seed).")

    @model_validator(mode="after")
    def _one_training_source(self) -> DataSettings:
        if (self.train_path is None) == (not self.datasets):
            raise ValueError("give exactly one of data.train_path and data.datasets")
        names: dict[str, EnvironmentSettings] = {}
        for i, entry in enumerate(self.datasets):
            if entry.env is not None and names.setdefault(entry.env.resolved_name, entry.env) != entry.env:
                raise ValueError(f"data.datasets[{i}].env: environment {entry.env.resolved_name!r} is configured "
                                 "differently by an earlier dataset; one setting per environment")
        return self


class GRPORollouts(RolloutsConfig):
    """The shared `rollouts` section (`experience.config`) with GRPO's defaults: 8 samples, 512 tokens."""

    num_generations_per_prompt: int | dict[str, int] = Field(
        default=8, description="Samples per prompt: an int, or agent name -> int with `_default` as fallback."
    )
    max_seq_len: int = Field(default=512, ge=2, description="Most tokens (prompt + every turn) per rollout.")


class ValidationSettings(StrictModel):
    """Validation rollouts every `grpo.val_period` steps, scored with the eval metrics."""

    num_prompts: int | None = Field(default=None, ge=1, description="First N validation rows; None: all.")
    num_generations_per_prompt: int | None = Field(
        default=None, ge=1, description="Samples per prompt; None: the training setting (same manager)."
    )
    ks: tuple[Annotated[int, Field(ge=1)], ...] = Field(
        default=(1,), description="k values of pass@k, maj@k and mean@k."
    )


class WandbSettings(StrictModel):
    """The Weights & Biases run (`logger.wandb_enabled`; the `wandb` extra: `pip install -e '.[wandb]'`)."""

    project: str = Field(default="nemo-rl-ext", description="W&B project.")
    name: str | None = Field(default=None, description="Run name shown in W&B; None: W&B picks one.")
    entity: str | None = Field(default=None, description="W&B team or user; None: the logged-in default.")
    mode: Literal["online", "offline", "disabled"] = Field(
        default="online", description="online: stream to the server; offline: files under output_dir/wandb only "
        "(`wandb sync` uploads them later; no network needed); disabled: nothing."
    )


class MlflowSettings(StrictModel):
    """The MLflow run (`logger.mlflow_enabled`; the `mlflow` extra: `pip install -e '.[mlflow]'`)."""

    experiment_name: str = Field(default="nemo-rl-ext", description="MLflow experiment (created if absent).")
    run_name: str | None = Field(default=None, description="Run name; None: MLflow picks one.")
    tracking_uri: str | None = Field(
        default=None, description="Tracking server or store (http://..., sqlite:///..., file:...); None: "
        "sqlite:///<output_dir>/mlflow.db with artifacts in output_dir/mlartifacts."
    )


class LoggerSettings(StrictModel):
    """Where step metrics go: always `output_dir/metrics.jsonl`, and each tracker enabled here."""

    tensorboard_enabled: bool = Field(
        default=True, description="Also write TensorBoard events (if installed); `logger.tensorboard` is the "
        "older spelling."
    )
    wandb_enabled: bool = Field(default=False, description="Also log to Weights & Biases (`logger.wandb`).")
    wandb: WandbSettings = Field(default_factory=WandbSettings)
    mlflow_enabled: bool = Field(default=False, description="Also log to MLflow (`logger.mlflow`).")
    mlflow: MlflowSettings = Field(default_factory=MlflowSettings)
    num_sample_rollouts: int = Field(
        default=4, ge=0, description="Rollouts per step (prompt, answer, reward, agent) logged as a table to "
        "the trackers (W&B, MLflow); 0: none."
    )
    progress: bool = Field(default=True, description="Show a progress bar over steps.")
    print_steps: bool = Field(default=True, description="Print one summary line per step.")


class GRPOConfig(CheckedConfig):
    """A whole GRPO run (resuming may change only the keys of `RESUME_MAY_CHANGE`)."""

    grpo: GRPOSettings = Field(default_factory=GRPOSettings)
    loss: LossSettings = Field(default_factory=LossSettings)
    optimizer: OptimizerSettings = Field(default_factory=OptimizerSettings)
    trainer: TrainerSettings = Field(default_factory=TrainerSettings)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    data: DataSettings
    rollouts: GRPORollouts = Field(default_factory=GRPORollouts)
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    logger: LoggerSettings = Field(default_factory=LoggerSettings)
    on_policy_distillation: DistillationSettings = Field(default_factory=DistillationSettings)
    output_dir: Path = Field(default=Path("results/grpo"), description="Metrics, config and checkpoints.")
    resume: bool | Literal["restart"] | Path = Field(
        default=False,
        description="false: a new run (refused where output_dir holds checkpoints or step folders); true: "
        "continue from the latest complete checkpoint in output_dir (refused where the folder holds an earlier "
        "run's step folders or step metrics but no complete checkpoint); a path: continue from that checkpoint; "
        "restart: start over at step 0, deleting the checkpoints and step folders in output_dir.",
    )
    keep_last_checkpoints: int | None = Field(default=2, ge=1, description="Delete older ones; None keeps all.")

    @classmethod
    def legacy_spellings(
        cls, data: dict[str, Any], *, whole: bool = True, base: Mapping[str, Any] | None = None
    ) -> tuple[Renames, list[RuleProblem]]:
        """NeMo-RL's GRPO spellings and this package's earlier ones (`compat.grpo_spellings`) rewritten to the
        shared `rollouts` section, with a DeprecationWarning per key."""
        return grpo_spellings(data, whole=whole, base=base)

    @model_validator(mode="before")
    @classmethod
    def _stale_rollouts_get_importance_sampling(cls, data: Any) -> Any:
        """With grpo.async on and max_lag > 0, loss.importance_sampling_correction defaults to true (NeMo-RL's
        async GRPO guide requires it there); an explicit false is refused by `rule_problems`."""
        if not isinstance(data, Mapping) or not stale_rollouts_lag(data):
            return data
        loss = data.get("loss")
        loss = {} if loss is None else loss
        if not isinstance(loss, Mapping) or "importance_sampling_correction" in loss:
            return data
        return {**data, "loss": {**loss, "importance_sampling_correction": True}}

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[RuleProblem]:
        """The shared rollouts rules (`rollouts_rule_problems`), sampling is never greedy, an asynchronous
        run's queue holds at least one step's groups, and one whose rollouts may be stale keeps the
        importance-sampling correction."""
        policy = data.get("policy")
        generation = policy.get("generation") if isinstance(policy, Mapping) else None
        temperature = raw_field(GenerationConfig, generation, "temperature")
        problems = rollouts_rule_problems(data, GRPORollouts, seq_len_within_model=True)
        if temperature is not INVALID and temperature == 0.0:
            problems.append(
                (
                    ("policy", "generation", "temperature"),
                    "must be > 0: GRPO compares sampled completions",
                    temperature,
                )
            )
        grpo = data.get("grpo")
        settings = grpo.get("async") if isinstance(grpo, Mapping) else None
        queue_size = raw_field(AsyncSettings, settings, "queue_size")
        per_step = raw_field(GRPOSettings, grpo, "num_prompts_per_step")
        if queue_size not in (None, INVALID) and per_step is not INVALID and queue_size < per_step:
            problems.append(
                (
                    ("grpo", "async", "queue_size"),
                    f"must be >= grpo.num_prompts_per_step ({per_step}): the trainer waits for a step's groups",
                    queue_size,
                )
            )
        lag, loss = stale_rollouts_lag(data), data.get("loss")
        written = isinstance(loss, Mapping) and "importance_sampling_correction" in loss  # absent: true (above)
        correction = raw_field(LossSettings, loss, "importance_sampling_correction") if written else None
        if lag and correction is False:
            problems.append(
                (
                    ("loss", "importance_sampling_correction"),
                    f"must be true when grpo.async is enabled with max_lag > 0 (here {lag}): a group may have been "
                    "generated by weights one or more steps old, and without the correction its policy gradient "
                    "is taken as if the current weights had sampled it (NeMo-RL's async GRPO guide: 'required for "
                    "convergence'). Leave the key out (it defaults to true there) or set grpo.async.max_lag: 0",
                    correction,
                )
            )
        problems += gdpo_rule_problems(data) + distillation_rule_problems(data)
        problems += kl_in_reward_rule_problems(data)
        device = raw_field(PolicyConfig, policy, "device") if isinstance(policy, Mapping) or policy is None else "cpu"
        problems += trainer_rule_problems(data, "cpu" if device is INVALID else device)
        problems += optimizer_rule_problems(data)
        return problems


def kl_in_reward_rule_problems(data: Mapping[str, Any]) -> list[RuleProblem]:
    """`loss.use_kl_in_reward` only with `grpo.adv_estimator: reinforce_plus_plus` (NeMo-RL's grpo and gdpo
    estimators ignore it while its loss drops the KL term: the KL would vanish without a word)."""
    loss, grpo = data.get("loss"), data.get("grpo")
    in_reward = raw_field(LossSettings, loss, "use_kl_in_reward")
    estimator = raw_field(GRPOSettings, grpo, "adv_estimator")
    if in_reward is True and estimator not in (INVALID, "reinforce_plus_plus"):
        return [(("loss", "use_kl_in_reward"), f"is read by grpo.adv_estimator: reinforce_plus_plus only (here "
                 f"{estimator!r}, whose advantages have no KL: NeMo-RL's would train without any KL term)", True)]
    return []


def distillation_rule_problems(data: Mapping[str, Any]) -> list[RuleProblem]:
    """Dynamic sampling drops the groups whose rewards are all equal, which a distillation teacher still scores
    token by token: the two together would throw away most of the teacher's signal."""
    grpo, section = data.get("grpo"), data.get("on_policy_distillation")
    dynamic = grpo.get("dynamic_sampling") if isinstance(grpo, Mapping) else None
    enabled = raw_field(DistillationSettings, section, "enabled") if isinstance(section, Mapping) else False
    if enabled is True and raw_field(DynamicSamplingSettings, dynamic, "enabled") is True:
        return [(("grpo", "dynamic_sampling", "enabled"), "must be false with on_policy_distillation (it drops the "
                 "groups without reward variance, which the teacher still scores per token)", True)]
    return []


def gdpo_rule_problems(data: Mapping[str, Any]) -> list[RuleProblem]:
    """`grpo.reward_weights` only with gdpo, finite; with nemo_gym rollouts (whose components the config
    names) gdpo needs two or more `rollouts.gym.reward_components` and every weighted name among them."""
    grpo = data.get("grpo")
    estimator = raw_field(GRPOSettings, grpo, "adv_estimator")
    weights = raw_field(GRPOSettings, grpo, "reward_weights")
    if estimator is INVALID or weights is INVALID:
        return []
    if estimator != "gdpo":
        if weights is not None:
            return [(("grpo", "reward_weights"), "is used only with grpo.adv_estimator: gdpo", weights)]
        return []
    problems: list[RuleProblem] = [
        (("grpo", "reward_weights", name), "must be a finite number", w)
        for name, w in (weights or {}).items() if not math.isfinite(w)
    ]
    rollouts = data.get("rollouts")
    gym = rollouts.get("gym") if isinstance(rollouts, Mapping) else None
    if not isinstance(rollouts, Mapping) or rollouts.get("mode") != "nemo_gym" or not isinstance(gym, Mapping):
        return problems  # a native environment's components are known once it has returned them
    names = gym.get("reward_components") or ()
    if not isinstance(names, list | tuple) or len(names) < 2:
        problems.append(
            (("grpo", "adv_estimator"), "gdpo needs two or more named reward components: list the /verify "
             "response's fields in rollouts.gym.reward_components (one component: use grpo)", estimator)
        )
    else:
        problems += [
            (("grpo", "reward_weights", name), f"names no component of rollouts.gym.reward_components "
             f"{list(names)}", w)
            for name, w in (weights or {}).items() if name not in names
        ]
        unweighted = [n for n in names if weights is not None and n not in weights]
        if unweighted:
            problems.append(
                (("grpo", "reward_weights"), f"has no weight for the component(s) {unweighted} of "
                 "rollouts.gym.reward_components", weights)
            )
    return problems


def saved_config_settings(saved: Any) -> Any:
    """A checkpoint's saved config with the settings it trained with where it predates a key: a config without
    `loss.kl_gradient` and with a KL term trained with the pathwise KL gradient (the default before NeMo-RL's),
    so resuming it under today's default is listed as a changed key instead of switching silently."""
    if not isinstance(saved, Mapping):
        return saved
    out = dict(saved)
    loss = out.get("loss")
    if isinstance(loss, Mapping) and "kl_gradient" not in loss and loss.get("kl_coef", 0.0) not in (0, 0.0, None):
        out["loss"] = {**loss, "kl_gradient": "pathwise"}
    return out


def input_problems(cfg: GRPOConfig, *, train: bool = True, val: bool = True) -> list[str]:
    """What a run of `cfg` would stop on once its model is loaded, found without loading it: the model folder,
    the Gym configs it launches, the training (`train`) and validation (`val`) files and their agents' counts.
    Switch a file's check off when the run is given its datums directly. (An unknown environment name is a
    config error already: `experience.config` validates it.)"""
    # local (light, no cycle): could move to the top
    from nemo_rl_ext.experience.input_checks import dataset_problems, rollouts_problems

    problems = [p for p in (cfg.policy.model_folder_problem(),) if p is not None]
    problems += rollouts_problems(cfg.rollouts)
    keys = dict(question_key=cfg.data.question_key, answer_key=cfg.data.answer_key)
    counts_key = cfg.key_as_written("rollouts.num_generations_per_prompt")
    if train:
        for key, path, rollouts, subset, split in training_sources(cfg):
            problems += dataset_problems(key, path, rollouts, subset=subset, split=split, counts_key=counts_key,
                                         counts=cfg.rollouts.num_generations_per_prompt, **keys)
    if val and (cfg.grpo.val_period > 0 or cfg.grpo.val_at_start) and cfg.data.val_path is not None:
        val_counts = cfg.validation.num_generations_per_prompt
        problems += dataset_problems(
            "data.val_path", cfg.data.val_path, cfg.rollouts, limit=cfg.validation.num_prompts, split=cfg.data.val_split,
            subset=cfg.data.subset,
            counts=val_counts if val_counts is not None else cfg.rollouts.num_generations_per_prompt,
            counts_key="validation.num_generations_per_prompt" if val_counts is not None
            else cfg.key_as_written("rollouts.num_generations_per_prompt"),
            **keys,
        )
    return problems


def training_sources(cfg: GRPOConfig) -> list[tuple[str, Path, RolloutsConfig, str | None, str]]:
    """(config key, source, the rollouts settings its rows are read with, subset, split) of each training
    dataset: `data.train_path`, or each of `data.datasets` with its own environment."""
    data = cfg.data
    if data.train_path is not None:
        return [("data.train_path", data.train_path, cfg.rollouts, data.subset, data.split)]
    return [(f"data.datasets[{i}].path", entry.path,
             cfg.rollouts if entry.env is None else cfg.rollouts.model_copy(update={"env": entry.env}),
             entry.subset, entry.split) for i, entry in enumerate(data.datasets)]
