"""One reader for every dataset source: JSONL (`datasets.load_jsonl`, bad rows named by line) or anything
`hf_source.open_dataset` opens (bad rows named by row number), each row checked and mapped by the caller's
`normalize` (every bad row in one error), and the seeded split of a validation set off a training set."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from nemo_rl_ext.data.datasets import load_jsonl
from nemo_rl_ext.data.hf_source import RowTable, is_table_source, open_dataset
from nemo_rl_ext.data.jsonl import listed
from nemo_rl_ext.data.records import DatumSpec

Normalize = Callable[[Mapping[str, Any]], dict[str, Any]]
"""A row -> the row the caller reads; KeyError / ValueError / TypeError naming what is wrong with it."""


def load_rows(
    source: str | Path, normalize: Normalize | None = None, *, subset: str | None = None, split: str | None = None,
    columns_problem: Callable[[Sequence[str]], str | None] | None = None,
) -> Sequence[dict[str, Any]]:
    """The rows of `source` mapped by `normalize`: a list for JSONL, a `RowTable` (rows read when asked for)
    otherwise. Every row `normalize` refuses is named in one ValueError (file and line or row); a table whose
    columns `columns_problem` refuses is one error naming its columns (not one per row)."""
    if not is_table_source(source):
        def check(row: dict[str, Any]) -> str | None:
            return _problem(normalize, row) if normalize is not None else None

        rows = load_jsonl(source, check=check)
        return [normalize(r) for r in rows] if normalize is not None else rows
    table = RowTable(open_dataset(source, subset=subset, split=split), normalize=normalize, name=str(source))
    if columns_problem is not None and (problem := columns_problem(table.dataset.column_names)) is not None:
        raise ValueError(f"{source}: {problem}; its columns: {table.dataset.column_names}")
    if normalize is not None:
        found = []
        for start, batch in table.raw_batches():
            found += [f"row {start + i}: {p}" for i, r in enumerate(batch) if (p := _problem(normalize, r))]
        if found:
            raise ValueError(f"{source}: {len(found)} bad row(s):\n" + listed(found))
    return table


def _problem(normalize: Normalize, row: Mapping[str, Any]) -> str | None:
    """What `normalize` finds wrong with `row` (None: nothing)."""
    try:
        normalize(row)
    except (KeyError, ValueError, TypeError) as exc:
        return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return None


def rows_fingerprint(rows: Sequence[Mapping[str, Any]]) -> str:
    """sha256 identifying `rows`: a `RowTable`'s own, else over each row's JSON (sorted keys)."""
    if isinstance(rows, RowTable):
        return rows.fingerprint
    digest = hashlib.sha256()
    for row in rows:
        digest.update(orjson.dumps(row, option=orjson.OPT_SORT_KEYS, default=str))
        digest.update(b"\n")
    return digest.hexdigest()


def split_validation(
    rows: Sequence[dict[str, Any]], size: int | float, seed: int
) -> tuple[Sequence[dict[str, Any]], Sequence[dict[str, Any]]]:
    """(train, validation): `size` rows (a count, or a fraction of the rows when < 1) drawn by a permutation
    seeded with `seed`, the rest in their order. ValueError when that leaves either side empty."""
    n = len(rows)
    k = int(size) if size >= 1 else int(round(size * n))
    if not 0 < k < n:
        raise ValueError(f"split_validation_size {size} of {n} rows leaves {k} validation and {n - k} training rows")
    chosen = np.sort(np.random.default_rng(seed).permutation(n)[:k])
    rest = np.setdiff1d(np.arange(n), chosen)
    if isinstance(rows, RowTable):
        return rows.take(rest), rows.take(chosen)
    return [rows[int(i)] for i in rest], [rows[int(i)] for i in chosen]


class LazyDatums(Sequence[DatumSpec]):
    """The datums of a `RowTable`, each made (tokenized) when it is first asked for and kept: a training run
    over a large table tokenizes only the rows it draws. `make(idx, row)` makes one; `default_agent` is the
    agent of a row that names none (the environment)."""

    def __init__(self, rows: RowTable, make: Callable[[int, dict[str, Any]], DatumSpec], default_agent: str) -> None:
        self.rows = rows
        self.make = make
        self.default_agent = default_agent
        self._made: dict[int, DatumSpec] = {}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> DatumSpec:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]  # type: ignore[return-value]
        i = range(len(self))[i]
        if i not in self._made:
            self._made[i] = self.make(i, self.rows[i])
        return self._made[i]

    def agent_pairs(self) -> list[tuple[int, str]]:
        """(index, agent) of every row without making its datum: the `agent_name` column, else the default."""
        default = self.default_agent
        if "agent_name" not in self.rows.dataset.column_names:
            return [(i, default) for i in range(len(self))]
        return [(start + i, str(r.get("agent_name") or default))
                for start, batch in self.rows.raw_batches(["agent_name"]) for i, r in enumerate(batch)]
