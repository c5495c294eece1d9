"""Datasets through Hugging Face `datasets`: a local `.json` / `.parquet` / `.csv` / `.arrow` file, a folder
written by `Dataset.save_to_disk`, or a hub id (with a subset and a split), as NeMo-RL's `load_dataset_from_path`
reads them.

The rows stay in Arrow (memory-mapped from the `datasets` cache): `RowTable` is a sequence whose row `i` is read
when it is asked for, so a 1,000,000-row parquet file is never turned into Python objects as a whole. Its
`fingerprint` is the sha256 of the Arrow files it reads, so it covers exactly the loaded rows. (`.jsonl` files
keep their own reader, `datasets.load_jsonl`, which names a bad row by its line.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
"""The `datasets` builder of each local file suffix (`.jsonl` keeps `datasets.load_jsonl`)."""
LOCAL_FORMATS = ".jsonl, .json, .parquet, .csv, .arrow, or a folder written by save_to_disk"
"""What a local source may be (for messages)."""
BATCH_ROWS = 4096
"""Rows per batch when every row is checked (the batch is the most held as Python objects at once)."""


class SourceError(ValueError):
    """A dataset that cannot be opened: a missing file, an unknown format, a hub id that cannot be fetched."""


def is_table_source(source: str | Path) -> bool:
    """Whether `source` is read through `datasets` (everything but a `.jsonl` file)."""
    return Path(source).suffix.lower() != ".jsonl"


def is_hub_id(source: str | Path) -> bool:
    """Whether `source` names a hub dataset (`owner/name`, no suffix, nothing on disk there)."""
    text = str(source)
    path = Path(text)
    return not path.is_absolute() and not path.suffix and text.count("/") == 1 and not path.exists()


def open_dataset(source: str | Path, *, subset: str | None = None, split: str | None = None) -> Any:
    """The `datasets.Dataset` of `source` (module docstring); `SourceError` naming what could not be read.
    `datasets`' progress bars stay off meanwhile (a user error is one message on stderr)."""
    # lazy: datasets imports pyarrow and pandas (seconds); only a run with such a source pays for it
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    were_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        return _open(source, subset, split)
    finally:
        if not were_disabled:
            enable_progress_bars()


def _open(source: str | Path, subset: str | None, split: str | None) -> Any:
    """`open_dataset`, progress bars aside."""
    import datasets  # lazy: as in open_dataset

    path = Path(source)
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as exc:
            raise SourceError(f"{path}: not a folder written by save_to_disk ({exc})") from None
        return _one_split(loaded, split or "train", str(path))
    if path.suffix.lower() in BUILDERS:
        if not path.is_file():
            raise SourceError(f"file not found: {path}")
        try:
            return datasets.load_dataset(BUILDERS[path.suffix.lower()], data_files=str(path), split="train")
        except Exception as exc:  # noqa: BLE001 - every reader error of every format: one message naming the file
            raise SourceError(f"{path}: cannot be read as {path.suffix} ({type(exc).__name__}: {exc})") from None
    if not is_hub_id(source):
        raise SourceError(f"{source}: not a dataset: a local file ({LOCAL_FORMATS}) or a hub id 'owner/name'")
    return _from_hub(str(source), subset, split or "train")


def _one_split(loaded: Any, split: str, where: str) -> Any:
    """The split `split` of a DatasetDict (a Dataset as it is)."""
    if not hasattr(loaded, "keys"):
        return loaded
    if split not in loaded:
        raise SourceError(f"{where}: no split {split!r}; it has {sorted(loaded.keys())}")
    return loaded[split]


def _from_hub(name: str, subset: str | None, split: str) -> Any:
    """`name` from the Hugging Face hub (or the local `datasets` cache); one error when it cannot be fetched."""
    import datasets  # lazy: heavy (pyarrow, pandas), as in open_dataset

    what = f"{name}" + (f" (subset {subset!r})" if subset else "") + f" split {split!r}"
    try:
        return datasets.load_dataset(name, subset, split=split)
    except Exception as exc:  # noqa: BLE001 - offline, unknown id, no access: all one message
        raise SourceError(
            f"hub dataset {what} could not be fetched ({type(exc).__name__}: {str(exc).splitlines()[0]:.300}). "
            f"On a machine without network, use a local copy instead: {LOCAL_FORMATS} (on a machine with "
            f"network: datasets.load_dataset({name!r}, {subset!r}, split={split!r}).save_to_disk(FOLDER))"
        ) from None


def arrow_fingerprint(dataset: Any) -> str:
    """sha256 over the Arrow files `dataset` reads (its rows, exactly), or `datasets`' own fingerprint of an
    in-memory dataset."""
    files = [Path(f["filename"]) for f in dataset.cache_files]
    if not files:
        return f"datasets:{dataset._fingerprint}"
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


class RowTable(Sequence[dict[str, Any]]):
    """The rows of a `datasets.Dataset`, each read (and mapped by `normalize`) when it is asked for; a slice is
    a view. `fingerprint` identifies the rows (`arrow_fingerprint`, with the view's indices)."""

    def __init__(self, dataset: Any, *, normalize: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None,
                 fingerprint: str | None = None, indices: np.ndarray | None = None, name: str = "dataset") -> None:
        self.dataset = dataset
        self.normalize = normalize
        self.indices = indices
        self.name = name
        base = fingerprint if fingerprint is not None else arrow_fingerprint(dataset)
        self.fingerprint = base if indices is None else hashlib.sha256(
            base.encode() + np.asarray(indices, dtype=np.int64).tobytes()).hexdigest()
        self._base = base

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else self.dataset.num_rows

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, i: slice) -> RowTable: ...
    def __getitem__(self, i: int | slice) -> dict[str, Any] | RowTable:
        if isinstance(i, slice):
            return self.take(np.arange(len(self))[i])
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        row = self.dataset[int(self.indices[i]) if self.indices is not None else i % len(self)]
        return self.normalize(row) if self.normalize is not None else dict(row)

    def take(self, positions: np.ndarray) -> RowTable:
        """A view of the rows at `positions` (of this view)."""
        positions = np.asarray(positions, dtype=np.int64)
        base = positions if self.indices is None else self.indices[positions]
        return RowTable(self.dataset, normalize=self.normalize, fingerprint=self._base, indices=base, name=self.name)

    def raw_batches(self, columns: Sequence[str] | None = None) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """(first position, raw rows) of every `BATCH_ROWS` rows, with only `columns` (None: all)."""
        dataset = self.dataset if columns is None else self.dataset.select_columns(
            [c for c in columns if c in self.dataset.column_names])
        for start in range(0, len(self), BATCH_ROWS):
            stop = min(start + BATCH_ROWS, len(self))
            keys = slice(start, stop) if self.indices is None else [int(k) for k in self.indices[start:stop]]
            batch = dataset[keys]
            names = list(batch)
            yield start, [dict(zip(names, values, strict=True)) for values in zip(*batch.values(), strict=True)]
