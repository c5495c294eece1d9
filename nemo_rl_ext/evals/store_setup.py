"""Opening an eval store for rolling out, the one setup that a run, a shard job and a Ray worker share.

    checked = check_store(cfg, root)                  # before any engine is built: a changed config fails fast
    opened = await open_store(checked, generation, shard=cfg.eval.shard_spec)
    # opened.datums, opened.expected, opened.manager (the caller shuts it down), opened.store

`check_store` refuses a resume with a config or dataset rows that changed and loads the rows; it changes nothing
on disk. `open_store` builds the datums and the `RolloutManager` (`experience.build.build_rollouts`), preflights
every row, keeps a shard's own datums (dataset indices kept), pins the rows the manager sends (nemo_gym:
gym_rows.jsonl, whose resume check comes last; nothing in native mode), and only then, every check passed,
cuts a torn last line and records config.yaml and dataset_fingerprint.json: a refused resume leaves its folder
as it was. Gym servers the manager launches keep their logs in `<store>/gym/` unless
`rollouts.gym.launch.work_dir` says otherwise. Neither branches on the rollout mode: the manager answers for its
implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from nemo_rl_ext.config import dump_config
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.distillation.teachers import build_scorer, local_teachers, placement
from nemo_rl_ext.evals.config import EvalConfig, dataset_file
from nemo_rl_ext.evals.gym_eval import prepare_rows
from nemo_rl_ext.evals.shards import ShardSpec
from nemo_rl_ext.evals.store import (
    CompletionStore,
    EvalPaths,
    check_resumable,
    dataset_record,
    row_digests,
    write_dataset_record,
)
from nemo_rl_ext.experience.build import build_rollouts, load_rollout_rows
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.models.generation.interfaces import GenerationInterface


def load_rows(cfg: EvalConfig) -> list[dict[str, Any]]:
    """The dataset rows the eval evaluates: the first `eval.num_prompts` rows of `eval.dataset_path`."""
    rows = load_rollout_rows(cfg.rollouts, dataset_file(cfg), subset=cfg.eval.dataset_subset,
                             split=cfg.eval.dataset_split)
    return list(rows[: cfg.eval.num_prompts])


def build_rollout_setup(
    cfg: EvalConfig, generation: GenerationInterface, rows: Sequence[dict[str, Any]] | None = None
) -> tuple[list[DatumSpec], RolloutManager]:
    """The datums and the RolloutManager of `cfg.rollouts` (`experience.build.build_rollouts`).

    `rows`: the rows to evaluate (default: `load_rows(cfg)`)."""
    rows = load_rows(cfg) if rows is None else rows
    return build_rollouts(
        cfg.rollouts,
        generation.tokenizer,
        generation,
        rows,
        generation_config=cfg.policy.generation,
        cluster=cfg.policy.cluster,
        # None without a teacher; the manager closes it. A local one: on this process's policy.device
        teachers=build_scorer(cfg.on_policy_distillation,
                              local_teachers(placement(cfg.policy.device, cfg.policy.dtype))),
    )


GYM_LOGS = "gym"
"""The folder in a store where the Gym servers its manager launches write env.yaml and their logs (unless
`rollouts.gym.launch.work_dir` names another)."""


@dataclass(frozen=True)
class CheckedStore:
    """A store whose files agree with the config (`check_store`)."""

    cfg: EvalConfig
    """The config it runs (as config.yaml records it)."""
    paths: EvalPaths
    """Its files."""
    store: CompletionStore
    """Its completions (a torn last line cut off)."""
    resuming: bool
    """True when it already held completions."""
    rows: list[dict[str, Any]]
    """The selected dataset rows."""
    dataset_record: dict[str, Any]
    """The dataset fingerprint to record once every check passed (`record_store`)."""


def check_store_config(cfg: EvalConfig, paths: EvalPaths) -> bool:
    """Whether the store `paths` holds completions; if so, refuse (ConfigError) a `cfg` that changed a key that
    changes completions against its config.yaml."""
    resuming = paths.completions.exists() and paths.completions.stat().st_size > 0
    if resuming:
        check_resumable(
            paths.config,
            cfg.model_dump(mode="json"),
            lambda saved: EvalConfig.model_validate(saved).model_dump(mode="json"),
            cfg.key_as_written,
        )
    return resuming


def check_store(cfg: EvalConfig, root: Path) -> CheckedStore:
    """Check the store `root` for `cfg` without changing it: when it holds completions, refuse a config that
    changed a key that changes completions, or dataset rows that changed (ConfigError); a garbage line is a
    ConfigError too. `record_store` (which `open_store` calls) then repairs and records."""
    paths = EvalPaths(root)
    store = CompletionStore(paths.completions, repair=False)  # ConfigError on a garbage line
    resuming = check_store_config(cfg, paths)
    rows = load_rows(cfg)
    digests = row_digests(rows)
    refused = store.data_error_rows()  # rows the user may have fixed since Gym refused them
    record = dataset_record(paths.dataset, cfg.eval.dataset_path, digests, resuming, may_change=refused)
    if refused:
        store.retry_data_errors(refused - _recorded_same(paths.dataset, digests, refused))
    return CheckedStore(cfg, paths, store, resuming, rows, record)


def _recorded_same(fingerprint: Path, digests: list[str], rows: set[int]) -> set[int]:
    """Those of `rows` whose recorded digest equals today's (unchanged rows keep their data errors)."""
    if not fingerprint.exists():
        return set(rows)
    recorded = orjson.loads(fingerprint.read_bytes())["row_sha256"]  # readable: dataset_record checked it
    return {i for i in rows if i < len(recorded) and i < len(digests) and recorded[i] == digests[i]}


def record_store(checked: CheckedStore) -> None:
    """Once every check passed: cut a torn last line, then record config.yaml and the dataset fingerprint."""
    paths, store = checked.paths, checked.store
    paths.root.mkdir(parents=True, exist_ok=True)
    if store.torn_bytes:
        store.cut_torn_line()
        print(f"resume: cut a torn last line ({store.torn_bytes} bytes) from {paths.completions}")
    # its two files at once (the merge refuses a store without them)
    write_dataset_record(paths.dataset, checked.dataset_record)
    paths.config.write_text(dump_config(checked.cfg))


@dataclass(frozen=True)
class OpenStore:
    """A store ready for rolling out (`open_store`)."""

    checked: CheckedStore
    """Its files and rows."""
    datums: list[DatumSpec]
    """The datums it rolls out (a shard's own), with their dataset indices."""
    expected: dict[int, int]
    """prompt_idx -> samples it needs (its agent's count), for each of `datums`."""
    manager: RolloutManager
    """The manager that rolls them out (the caller shuts it down)."""
    gym_logs: Path | None = None
    """Where the Gym servers the manager launches write their logs (None: it launches none)."""

    @property
    def paths(self) -> EvalPaths:
        """The store's files."""
        return self.checked.paths

    @property
    def store(self) -> CompletionStore:
        """The store's completions."""
        return self.checked.store


async def open_store(
    checked: CheckedStore,
    generation: GenerationInterface,
    *,
    shard: ShardSpec | None = None,
    build_cfg: EvalConfig | None = None,
) -> OpenStore:
    """Build the datums and the manager of `checked`'s config over `generation` (`build_cfg`: the config to build
    from instead, e.g. a Ray worker's own Gym folder), preflight every row (also in a shard: each shard reports
    the same missing counts), keep the datums `shard` owns, and pin the rows the manager sends (gym_eval.py).
    The manager is shut down when any of this fails."""
    build = build_cfg or checked.cfg
    build = build.model_copy(update={"rollouts": build.rollouts.with_gym_work_dir(checked.paths.root / GYM_LOGS)})
    datums, manager = build_rollout_setup(build, generation, checked.rows)
    try:
        manager.preflight(datums)
        if shard is not None:  # the datums keep their dataset index: seeds and the merge key depend on it
            datums = [d for d in datums if shard.owns(d.idx)]
        expected = {d.idx: manager.counts.for_agent(d.agent) for d in datums}
        checked.paths.root.mkdir(parents=True, exist_ok=True)
        prepare_rows(manager, datums, expected, checked.paths.root, checked.resuming,
                     rebuilt=checked.store.fixed_rows)  # before the first is sent
        record_store(checked)  # every check passed
    except BaseException:
        await manager.shutdown()
        raise
    return OpenStore(checked, datums, expected, manager, build.rollouts.gym_work_dir)
