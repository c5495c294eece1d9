"""The data of a GRPO run's `data` section: each training dataset (`data.train_path`, or each of `data.datasets`
with its own environment and weight) with its validation rows (`data.val_path`, else `data.split_validation_size`
rows held out of each training set by a seeded draw, else the training rows), and the seeded prompt stream over
them (one dataset: `PromptStream`; several: `MixedPromptStream`)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.records import DatumSpec
from nemo_rl_ext.data.sources import rows_fingerprint, split_validation
from nemo_rl_ext.experience.build import load_rollout_rows, make_datums
from nemo_rl_ext.experience.config import RolloutsConfig
from nemo_rl_ext.grpo.config import GRPOConfig, training_sources
from nemo_rl_ext.grpo.prompt_stream import MixedPromptStream, PromptStream

Rows = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class RunSource:
    """One training dataset of a run, loaded."""

    rollouts: RolloutsConfig
    """The rollouts settings its rows are read and scored with (its own `env` for one of `data.datasets`)."""
    rows: Rows
    """Its training rows (empty when the run was given its datums)."""
    val_rows: Rows
    """Its validation rows (empty when the run does not validate)."""
    weight: float
    """Its sampling weight."""


def run_sources(cfg: GRPOConfig, *, train: bool, validates: bool) -> list[RunSource]:
    """The training datasets of `cfg` (module docstring); what is not asked for (`train`, `validates`) is empty,
    but a held-out validation split is always taken out of the training rows. `data.val_path` is the first
    dataset's validation set."""
    data = cfg.data
    keys = dict(question_key=data.question_key, answer_key=data.answer_key)
    held_out = data.val_path is None and data.split_validation_size > 0
    weights = [1.0] if data.train_path is not None else [e.weight for e in data.datasets]
    out = []
    for k, ((key, path, rollouts, subset, split), weight) in enumerate(zip(training_sources(cfg), weights, strict=True)):
        rows: Rows = ()
        if train or (validates and data.val_path is None):
            rows = load_rollout_rows(rollouts, path, subset=subset, split=split, **keys)
        val: Rows = ()
        if held_out:
            try:
                rows, val = split_validation(rows, data.split_validation_size, cfg.grpo.seed)
            except ValueError as exc:
                raise ConfigError(f"data.split_validation_size: {key}: {exc}") from None
        elif validates and data.val_path is not None:
            val = load_rollout_rows(cfg.rollouts, data.val_path, subset=data.subset, split=data.val_split,
                                    **keys) if k == 0 else ()
        elif validates:
            val = rows
        out.append(RunSource(rollouts, rows if train else (), val if validates else (), weight))
    return out


class ShiftedDatums(Sequence[DatumSpec]):
    """`datums` with every `idx` moved up by `offset` (prompt indices stay distinct across datasets)."""

    def __init__(self, datums: Sequence[DatumSpec], offset: int) -> None:
        self.datums = datums
        self.offset = offset

    def __len__(self) -> int:
        return len(self.datums)

    def __getitem__(self, i: int) -> DatumSpec:  # type: ignore[override]
        datum = self.datums[i]
        return dataclasses.replace(datum, idx=datum.idx + self.offset)

    def agent_pairs(self) -> list[tuple[int, str]]:
        """(index, agent) of every datum, without making the datums of a table (`LazyDatums.agent_pairs`)."""
        lazy = getattr(self.datums, "agent_pairs", None)
        pairs = lazy() if lazy is not None else [(d.idx, d.agent) for d in self.datums]
        return [(idx + self.offset, agent) for idx, agent in pairs]


def training_stream(cfg: GRPOConfig, tokenizer: Any, sources: Sequence[RunSource],
                    first: Sequence[DatumSpec] | None) -> PromptStream | MixedPromptStream:
    """The seeded stream over the sources' rows; `first`: the first source's datums if `build_rollouts` made
    them (None: made here)."""
    data = cfg.data
    fingerprints = [rows_fingerprint(s.rows) for s in sources]
    if len(sources) == 1:
        assert first is not None, "one dataset: build_rollouts made its datums"
        return PromptStream(first, seed=cfg.grpo.seed, shuffle=data.shuffle, fingerprint=fingerprints[0])
    streams, offset = [], 0
    for k, source in enumerate(sources):
        datums = first if k == 0 and first is not None else make_datums(source.rollouts, tokenizer, source.rows,
                                                  question_key=data.question_key, answer_key=data.answer_key)
        streams.append(PromptStream(ShiftedDatums(datums, offset) if offset else datums,
                                    seed=cfg.grpo.seed + 1 + k, shuffle=data.shuffle))
        offset += len(datums)
    both = hashlib.sha256("\n".join(fingerprints).encode()).hexdigest()
    return MixedPromptStream(streams, [s.weight for s in sources], seed=cfg.grpo.seed, fingerprint=both)


def validation_datums(cfg: GRPOConfig, tokenizer: Any, sources: Sequence[RunSource]) -> list[DatumSpec]:
    """The first `validation.num_prompts` validation datums, dataset after dataset (prompt indices distinct),
    each made by its own dataset's settings; only those are tokenized."""
    data, limit = cfg.data, cfg.validation.num_prompts
    out: list[DatumSpec] = []
    offset = 0
    for source in sources:
        room = None if limit is None else limit - len(out)
        if room is not None and room <= 0:
            break
        rows = source.val_rows[:room] if room is not None else source.val_rows
        datums = make_datums(source.rollouts, tokenizer, rows, question_key=data.question_key,
                             answer_key=data.answer_key)
        out += [dataclasses.replace(d, idx=d.idx + offset) for d in datums]
        offset += len(source.val_rows)
    return out
