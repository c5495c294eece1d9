"""A run's inputs checked before any model loads: the Gym configs it launches, the dataset file, its rows, and
a count for every row's agent.

GRPO and the eval call these from their config's `input_problems`, so that a missing file or a missing
`_default` is one message naming the config key and the file, seconds after start, not a traceback after the
model loaded. Rows are read as `build.load_rollout_rows` reads them for the run itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

from nemo_rl_ext.data.generation_counts import GenerationCountError, GenerationCounts
from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.experience.config import RolloutsConfig
from nemo_rl_ext.models.config import PolicyConfig


def rollouts_problems(rollouts: RolloutsConfig) -> list[str]:
    """What `rollouts` needs on disk: in nemo_gym mode with `gym.launch`, every Gym config file it names."""
    gym = rollouts.gym if rollouts.mode == "nemo_gym" else None
    if gym is None or gym.launch is None:
        return []
    # local: only when Gym is launched (gym.launcher is light; could move up)
    from nemo_rl_ext.gym.launcher import missing_config_paths

    return missing_config_paths(gym.launch)


def dataset_problems(
    key: str,
    path: str | Path,
    rollouts: RolloutsConfig,
    *,
    counts: int | Mapping[str, int],
    counts_key: str,
    limit: int | None = None,
    question_key: str = "question",
    answer_key: str = "answer",
    subset: str | None = None,
    split: str | None = None,
) -> list[str]:
    """Every problem of the dataset at `path` (config key `key`) for `rollouts` with these sample `counts`:
    the file, its lines and rows (`build.load_rollout_rows`), and a count for each row's agent
    (`build.row_agents`). `limit`: only the first rows are rolled out, so only they need a count."""
    # lazy: build loads torch and the backends; input checks stay light for config validation
    from nemo_rl_ext.data.hf_source import is_table_source
    from nemo_rl_ext.experience.build import load_rollout_rows, row_agents

    path = Path(path)
    if not is_table_source(path) and not path.is_file():
        return [f"{key}: file not found: {path}"]
    try:
        rows = load_rollout_rows(rollouts, path, question_key=question_key, answer_key=answer_key,
                                 subset=subset, split=split)[:limit]
        agents = row_agents(rollouts, rows)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        message = str(exc)
        return [f"{key}: {message if str(path) in message else f'{path}: {message}'}"]
    try:
        with warnings.catch_warnings():  # unused count keys: the manager warns about those itself
            warnings.simplefilter("ignore", UserWarning)
            GenerationCounts.parse(counts).preflight(enumerate(agents))
    except GenerationCountError as exc:
        return [f"{counts_key}: rows of {path}: {str(exc).replace('num_generations_per_prompt', counts_key)}"]
    return []


def dataset_agents(path: str | Path, rollouts: RolloutsConfig, *, limit: int | None = None,
                   question_key: str = "question", answer_key: str = "answer", subset: str | None = None,
                   split: str | None = None) -> list[str]:
    """The agent of each row of the dataset at `path` (empty when it cannot be read: `dataset_problems` names
    why)."""
    # lazy: build loads torch and the backends; input checks stay light for config validation
    from nemo_rl_ext.experience.build import load_rollout_rows, row_agents

    try:
        rows = load_rollout_rows(rollouts, path, question_key=question_key, answer_key=answer_key,
                                 subset=subset, split=split)[:limit]
        return row_agents(rollouts, rows)
    except (OSError, UnicodeDecodeError, ValueError):
        return []


def distillation_input_problems(settings: DistillationSettings, policy: PolicyConfig,
                                agents: Iterable[str]) -> list[str]:
    """Every problem of on-policy distillation's `settings` for a run of `policy` over rows of `agents`, before
    any model loads: unmapped agents, missing teachers, a teacher whose tokenizer is not the student's, a
    teacher URL that does not answer or returns no prompt logprobs (`distillation.checks`)."""
    if not settings.enabled:
        return []
    student = None
    if policy.model_folder_problem() is None:  # a missing student folder is reported by its own check
        # local: the student's tokenizer only when distilling (models.policy may build a built-in model once)
        from nemo_rl_ext.models.loading import load_tokenizer
        from nemo_rl_ext.models.policy import resolve_model_path

        student = load_tokenizer(resolve_model_path(policy))
    # local: distillation.checks imports httpx, which a config check without a teacher does without
    from nemo_rl_ext.distillation.checks import distillation_problems

    return distillation_problems(settings, agents, student)
