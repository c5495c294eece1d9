"""The front door: a config's `policy` and `rollouts` sections turned into a generation backend, datums and a
RolloutManager. GRPO, the eval and the examples build through these two functions only; they are the only
places that branch on the backend (through the `models.backends` registry and `policy.cluster`) and on the
rollout mode.

    tokenizer, generation = build_policy(cfg.policy)
    datums, manager = build_rollouts(cfg.rollouts, tokenizer, generation, rows, generation_config=...)
    async for record in manager.stream_rollouts(datums, max_concurrent_prompts=8): ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from nemo_rl_ext.data.columns import columns_problem, normalize_row
from nemo_rl_ext.data.datasets import gym_datums, load_jsonl, prompt_datum, qa_datums, qa_row
from nemo_rl_ext.data.hf_source import RowTable, is_table_source
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.data.sources import LazyDatums, load_rows
from nemo_rl_ext.distillation.scoring import TeacherScorer
from nemo_rl_ext.environments.interfaces import EnvironmentInterface
from nemo_rl_ext.experience.config import EnvironmentSettings, RolloutsConfig
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.experience.rollout_params import TokenizerType
from nemo_rl_ext.models.config import ClusterConfig, PolicyConfig
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationInterface


def build_policy(
    policy: PolicyConfig, *, model: Any = None, tokenizer: Any = None
) -> tuple[TokenizerType, GenerationInterface]:
    """The tokenizer and generation backend `policy` describes: one engine in this process (`policy.backend`
    from the registry), or a Ray pool of them (`policy.cluster`). `model` / `tokenizer`: a trainer's, shared by
    an in-process engine that serves the model object it is handed. The caller shuts the backend down."""
    # local: no cycle; cluster adds no heavy import here (build loads torch already); could move up
    from nemo_rl_ext.cluster import build_policy_generation

    generation = build_policy_generation(policy, model, tokenizer)
    return generation.tokenizer, generation


def load_rollout_rows(
    cfg: RolloutsConfig,
    path: str | Path,
    *,
    question_key: str = "question",
    answer_key: str = "answer",
    subset: str | None = None,
    split: str | None = None,
) -> Sequence[dict[str, Any]]:
    """The rows of the dataset `path` (JSONL, or any source of `data.hf_source`: parquet, CSV, JSON, Arrow, a
    save_to_disk folder, a hub id with `subset` / `split`) for `cfg`'s mode, every unreadable line and every
    bad row named at once: a Gym row needs `responses_create_params` in the shape Gym accepts (with
    `gym.responses_create_params` merged in, as it is sent: `gym.rows.responses_params_problems`); a native row
    read by the default adapter a prompt and a reference answer under any of the names of `data.columns`
    (mapped to the question and answer keys); a registered adapter names the rows it can't use itself, in
    `make_datums`."""
    if cfg.mode == "nemo_gym":
        # local: only the nemo_gym mode checks Gym rows (gym.rows is light; could move to the top)
        from nemo_rl_ext.gym.rows import gym_row_problem

        overrides = dict(cfg.gym.responses_create_params) if cfg.gym is not None else {}

        def gym_row(row: Mapping[str, Any]) -> dict[str, Any]:
            if "responses_create_params" not in row:
                raise KeyError("missing key(s) ['responses_create_params']")
            params = row["responses_create_params"]
            problem = gym_row_problem({"responses_create_params": {**params, **overrides}
                                       if isinstance(params, Mapping) else params})
            if problem is not None:
                raise ValueError(problem)
            return dict(row)

        if not is_table_source(path):  # as before: JSONL rows come back as read
            return load_jsonl(path, required=("responses_create_params",),
                              check=lambda row: _problem_of(gym_row, row))
        return load_rows(path, gym_row, subset=subset, split=split)
    # lazy: the environment registry imports every implementation
    from nemo_rl_ext.environments import environment_entry

    default_rows = environment_entry(cfg.env.resolved_name).row_adapter is qa_row
    keys = dict(question_key=question_key, answer_key=answer_key)
    if not default_rows:
        return load_rows(path, subset=subset, split=split)
    return load_rows(path, partial(normalize_row, **keys), subset=subset, split=split,
                     columns_problem=partial(columns_problem, **keys))


def _problem_of(check: Any, row: Mapping[str, Any]) -> str | None:
    """The message of the error `check(row)` raises (None: none)."""
    try:
        check(row)
    except (KeyError, ValueError) as exc:
        return str(exc.args[0]) if exc.args else str(exc)
    return None


def row_agents(cfg: RolloutsConfig, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The agent of each row (`DatumSpec.agent`, what its sample count is looked up by), without a tokenizer:
    a Gym row's `agent_ref.name` (else `gym.agent_name`), a native row's `agent_name` (else the environment)."""
    if cfg.mode == "nemo_gym":
        return [d.agent for d in make_datums(cfg, None, list(rows))]
    if isinstance(rows, RowTable):
        return [agent for _, agent in LazyDatums(rows, None, cfg.env.resolved_name).agent_pairs()]  # type: ignore[arg-type]
    return [str(row.get("agent_name") or cfg.env.resolved_name) for row in rows]


def make_datums(
    cfg: RolloutsConfig,
    tokenizer: TokenizerType,
    rows: Sequence[Mapping[str, Any]],
    *,
    question_key: str = "question",
    answer_key: str = "answer",
) -> Sequence[DatumSpec]:
    """The datums of `rows` for `cfg`'s mode: Gym rows as they are (nemo_gym), else each row read by the
    environment's registered row adapter, with `rollouts.env.system_prompt` or the environment's default."""
    if cfg.mode == "nemo_gym":
        gym = cfg.gym
        return gym_datums(
            rows,
            agent_name=gym.agent_name if gym is not None else None,
            responses_create_params=gym.responses_create_params if gym is not None else None,
        )
    # lazy: the environment registry imports every implementation
    from nemo_rl_ext.environments import environment_entry

    name = cfg.env.resolved_name
    entry = environment_entry(name)
    system_prompt = cfg.env.system_prompt if cfg.env.system_prompt is not None else entry.system_prompt
    if isinstance(rows, RowTable):  # a table: each datum made when drawn (its rows were checked when loaded)
        def make(idx: int, row: dict[str, Any]) -> DatumSpec:
            prompt = entry.row_adapter(row, question_key=question_key, answer_key=answer_key)
            return prompt_datum(tokenizer, idx, prompt, name, system_prompt or None)

        return LazyDatums(rows, make, default_agent=name)
    return qa_datums(
        tokenizer,
        rows,
        name,
        system_prompt=system_prompt or None,
        question_key=question_key,
        answer_key=answer_key,
        row_adapter=entry.row_adapter,
    )


def _build_environments(
    settings_list: Sequence[EnvironmentSettings], cluster: ClusterConfig | None
) -> tuple[dict[str, EnvironmentInterface], list[EnvironmentInterface]]:
    """One environment per name of `settings_list` (in this process or a Ray actor); all shut down if one fails."""
    # local: no cycle; cluster adds no heavy import here (build loads torch already); could move up
    from nemo_rl_ext.cluster import build_environment

    task_to_env: dict[str, EnvironmentInterface] = {}
    owned: list[EnvironmentInterface] = []
    try:
        for settings in settings_list:
            if settings.resolved_name not in task_to_env:
                task_to_env[settings.resolved_name] = build_environment(
                    settings.resolved_name, settings.kwargs, remote=settings.remote,
                    step_timeout_s=settings.step_timeout_s, cluster=cluster)
                owned.append(task_to_env[settings.resolved_name])
    except BaseException:
        for env in owned:
            env.shutdown()
        raise
    return task_to_env, owned


def build_rollouts(
    cfg: RolloutsConfig,
    tokenizer: TokenizerType,
    generation: GenerationInterface,
    rows: Sequence[Mapping[str, Any]] = (),
    *,
    generation_config: GenerationConfig,
    cluster: ClusterConfig | None = None,
    task_to_env: Mapping[str, EnvironmentInterface] | None = None,
    question_key: str = "question",
    answer_key: str = "answer",
    more_envs: Sequence[EnvironmentSettings] = (),
    teachers: TeacherScorer | None = None,
) -> tuple[Sequence[DatumSpec], RolloutManager]:
    """The datums of `rows` and the RolloutManager of `cfg.mode` (a registered rollout mode).

    Native mode (and any other mode but nemo_gym: rows, environment and turn cap as native's) builds the
    configured environment (in this process, or in a Ray actor with
    `rollouts.env.remote`, on `cluster`'s Ray) and the manager owns it (its `shutdown` stops it); a given
    `task_to_env` is used instead and stays the caller's. `more_envs`: environments built (and owned) beside it
    (the environments of GRPO's `data.datasets`; one per name). A rollout's tokens are capped by the engine's
    `max_model_len` as well as by `rollouts.max_seq_len`. `teachers` score every record (on-policy distillation).
    """
    datums = make_datums(cfg, tokenizer, rows, question_key=question_key, answer_key=answer_key)
    common: dict[str, Any] = dict(
        tokenizer=tokenizer,
        num_generations_per_prompt=cfg.num_generations_per_prompt,
        max_seq_len=min(cfg.max_seq_len, generation.max_model_len),
        policy_generation=generation,
        generation_config=generation_config,
        fault_policy=cfg.fault_policy, teachers=teachers,
    )
    if cfg.mode == "nemo_gym":
        return datums, RolloutManager(**common, task_to_env=None, mode=cfg.mode, gym_config=cfg.gym)
    owned: list[EnvironmentInterface] = []
    if task_to_env is None:
        task_to_env, owned = _build_environments((cfg.env, *more_envs), cluster)
    try:
        manager = RolloutManager(
            **common, mode=cfg.mode, task_to_env=task_to_env, max_rollout_turns=cfg.max_rollout_turns,
            owned_environments=owned,
        )
    except BaseException:
        for env in owned:
            env.shutdown()
        raise
    return datums, manager
