"""The eval's output folder: the completions JSONL (append-only, crash-safe, resumable) and its neighbours.

A group's lines are written with one `write`, then flushed and fsynced, so a killed run leaves whole
groups plus at most one torn last line; opening the store truncates that line. A group can still be
partially present (a kill between the kernel writing some of its lines and the rest); the driver then
rolls the whole group out again (per-sample seeds make the samples identical) and writes only the
samples that are missing. Nothing is ever rewritten: resuming only appends.

Error completions (stop_reason "error": an infrastructure failure, not an answer) are written like any
other line, but they are not results. What a (prompt, sample) pair holds is decided by its lines in file
order: its first non-error line is its result (later lines for it are ignored as duplicates); until it
has one, its latest error line says why it failed and the driver rolls it out again. So a retry only
appends, a kill at any point leaves a readable file, and the error history stays on disk. A data error (the
row was refused as malformed, `CompletionLine.is_data_error`) is not rolled out again while the row is
unchanged: the same row would be refused again. A row whose every line is a data error may change (the user
fixed it): a resume then rolls it out again; any other changed row is a changed dataset (refused, see below).

The folder also records a fingerprint of the dataset rows it evaluates (`dataset_fingerprint.json`);
a resume against rows whose contents changed is refused (`check_dataset`).

The store hands out typed lines (`CompletionLine`, lines.py) and appends them; the bytes on disk are their
`to_json()`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from omegaconf import OmegaConf

from nemo_rl_ext.config import ConfigError, config_changes
from nemo_rl_ext.data.jsonl import json_lines, listed
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.experience.resume_keys import EVAL_RESUME_MAY_CHANGE

RESUME_MAY_CHANGE = EVAL_RESUME_MAY_CHANGE
"""Config keys that may differ between a run and its resumption (they change no completion; where things are,
e.g. `eval.save_path`, included): `experience.resume_keys`, where GRPO's list is too."""


@dataclass(frozen=True)
class EvalPaths:
    """The files of one eval's output folder."""

    root: Path
    """The folder (`eval.save_path`)."""

    @property
    def config(self) -> Path:
        """The resolved config, as YAML."""
        return self.root / "config.yaml"

    @property
    def completions(self) -> Path:
        """One JSON line per completion."""
        return self.root / "completions.jsonl"

    @property
    def summary(self) -> Path:
        """The metrics over every prompt (written once the last group is on disk)."""
        return self.root / "summary.json"

    @property
    def runs(self) -> Path:
        """One JSON line per invocation: what it generated, its rollout metrics and wall time."""
        return self.root / "runs.jsonl"

    @property
    def dataset(self) -> Path:
        """The fingerprint of the evaluated dataset rows (checked on resume)."""
        return self.root / "dataset_fingerprint.json"

    @property
    def plot(self) -> Path:
        """pass@k against k, per agent."""
        return self.root / "pass_at_k.png"

    @property
    def report(self) -> Path:
        """The Markdown summary next to the plot."""
        return self.root / "report.md"


def _json_default(value: Any) -> Any:
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    return str(value)


def dumps(obj: Any, indent: bool = False) -> bytes:
    """orjson with str() for anything it can't serialize (never fails on an odd env_extras value)."""
    option = orjson.OPT_NON_STR_KEYS | (orjson.OPT_INDENT_2 if indent else 0)
    return orjson.dumps(obj, default=_json_default, option=option)


class CompletionStore:
    """The completions JSONL of one output folder: read what is there, append groups durably.

    Raises ConfigError naming the file and every bad line when a line other than a torn last one is not
    a completion (a file that was edited or belongs to something else: the user must look at it).
    """

    def __init__(self, path: Path, *, repair: bool = True, keep_bytes: bool = False) -> None:
        self.path = path
        self.repair = repair
        """True: opening the store cuts a torn last line off the file; False (a reader, e.g. the merge, or a
        resume that checks its folder before it changes anything): the torn line is skipped and the file is
        left as it is until `cut_torn_line`."""
        self.keep_bytes = keep_bytes
        """True: keep each pair's line as written (`line_bytes`), for byte-exact comparison and copying."""
        self.line_bytes: dict[tuple[int, int], bytes] = {}
        """With `keep_bytes`: the bytes (without newline) of the line `line()` returns, per pair."""
        self.torn_bytes = 0
        """Bytes of a torn last line that opening the store cut off, or skipped (0 when the file was whole)."""
        self.results: dict[tuple[int, int], CompletionLine] = {}
        """The result of each (prompt_idx, sample_idx) that has one: its first non-error line."""
        self.errors: dict[tuple[int, int], CompletionLine] = {}
        """The latest error line of each pair that has no result yet (to be rolled out again)."""
        self.fixed_rows: set[int] = set()
        """Prompts whose data errors are rolled out again: their row changed since it was refused."""
        self.error_lines = 0
        """Error lines in the file (every failed attempt, also those superseded by a later result)."""
        self.duplicates = 0
        """Lines for a pair that already had a result (ignored)."""
        self._whole_bytes: int | None = None
        """The file's size without its torn last line, while that line is still on disk (None: no such line)."""
        self._read()

    def _read(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a torn last line from a killed run: skipped, and cut off when repairing
            self.torn_bytes = len(data) - end
            self._whole_bytes = end
            data = data[:end]
        problems: list[str] = []
        for lineno, line, row in json_lines(data, problems):
            try:
                self._add(CompletionLine.from_json(row), line)
            except ValueError as exc:  # what line_problem found
                problems.append(f"line {lineno}: {exc}")
        if problems:
            raise ConfigError(
                f"{self.path}: {len(problems)} unreadable line(s), not from a killed run "
                f"(fix or move the file, or use another eval.save_path):\n{listed(problems)}"
            )
        if self.repair:
            self.cut_torn_line()

    def cut_torn_line(self) -> None:
        """Cut the torn last line that opening found (`torn_bytes`) off the file (once); nothing without one."""
        if self._whole_bytes is None:
            return
        with open(self.path, "r+b") as f:
            f.truncate(self._whole_bytes)
            f.flush()
            os.fsync(f.fileno())
        self._whole_bytes = None

    def _add(self, row: CompletionLine, raw: bytes) -> None:
        key = (row.prompt_idx, row.sample_idx)
        if key in self.results:
            self.duplicates += 1
            return
        if row.is_error:
            self.error_lines += 1
            self.errors[key] = row
        else:
            self.errors.pop(key, None)
            self.results[key] = row
        if self.keep_bytes:
            self.line_bytes[key] = raw

    @classmethod
    def of_lines(cls, rows: Iterable[CompletionLine]) -> CompletionStore:
        """A store in memory holding `rows` (read in order, as from a file); nothing is written."""
        store = cls(Path("/nonexistent/in-memory-store.jsonl"), repair=False)
        for row in rows:
            store._add(row, b"")
        return store

    def keys(self) -> list[tuple[int, int]]:
        """Every (prompt_idx, sample_idx) that has a line, sorted."""
        return sorted(self.results.keys() | self.errors.keys())

    def line(self, prompt_idx: int, sample_idx: int) -> CompletionLine | None:
        """What the pair holds now: its result, else its latest error line, else None."""
        key = (prompt_idx, sample_idx)
        return self.results.get(key, self.errors.get(key))

    def done(self, prompt_idx: int, num_samples: int) -> set[int]:
        """The sample indices below `num_samples` of a prompt that have a result, or whose latest line is a data
        error (the row was refused as malformed: rolling the unchanged row out again cannot help)."""
        return {s for s in range(num_samples)
                if (prompt_idx, s) in self.results or self._data_error(prompt_idx, s)}

    def failed(self, prompt_idx: int, num_samples: int) -> set[int]:
        """The sample indices below `num_samples` of a prompt whose latest line is an infrastructure error (to be
        retried)."""
        return {s for s in range(num_samples) if (prompt_idx, s) in self.errors and not self._data_error(prompt_idx, s)}

    def _data_error(self, prompt_idx: int, sample_idx: int) -> bool:
        line = self.errors.get((prompt_idx, sample_idx))
        return line is not None and line.is_data_error and prompt_idx not in self.fixed_rows

    def data_error_rows(self) -> set[int]:
        """The prompts whose every line is a data error (none has a result): their row was refused whole."""
        refused = {p for (p, _), line in self.errors.items() if line.is_data_error}
        return refused - {p for p, _ in self.results} - {p for (p, _), line in self.errors.items()
                                                          if not line.is_data_error}

    def retry_data_errors(self, prompts: Iterable[int]) -> None:
        """Roll these prompts' data errors out again (their row changed since it was refused): `failed`, not
        `done`, from now on."""
        self.fixed_rows |= set(prompts)

    def append(self, rows: Iterable[CompletionLine]) -> int:
        """Write lines with one write, then flush and fsync; returns how many were written."""
        rows = list(rows)
        if not rows:
            return 0
        self.cut_torn_line()  # a line appended after a torn one would be unreadable
        payload = b"".join(dumps(r.to_json()) + b"\n" for r in rows)
        with open(self.path, "ab") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        for line in payload.splitlines():
            self._add(CompletionLine.from_json(orjson.loads(line)), line)  # exactly what a later read gives
        return len(rows)


# ---- the dataset fingerprint ---------------------------------------------------------------------------


def row_digests(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A short content hash per row: sha256 of its canonical JSON (sorted keys), first 16 hex digits."""
    return [hashlib.sha256(dumps_canonical(row)).hexdigest()[:16] for row in rows]


def dumps_canonical(obj: Any) -> bytes:
    """JSON with sorted keys: the same bytes for the same content, however the file was formatted."""
    return orjson.dumps(obj, default=_json_default, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SORT_KEYS)


def check_dataset(fingerprint: Path, dataset_path: str, digests: Sequence[str], resuming: bool) -> None:
    """Compare the selected rows with the fingerprint an earlier run recorded, then record the union
    (`dataset_record`, then `write_dataset_record`)."""
    write_dataset_record(fingerprint, dataset_record(fingerprint, dataset_path, digests, resuming))


def write_dataset_record(fingerprint: Path, record: Mapping[str, Any]) -> None:
    """Write a `dataset_record` atomically."""
    tmp = fingerprint.with_name(fingerprint.name + ".tmp")
    tmp.write_bytes(dumps(record, indent=True) + b"\n")
    os.replace(tmp, fingerprint)


def dataset_record(
    fingerprint: Path, dataset_path: str, digests: Sequence[str], resuming: bool, may_change: Collection[int] = ()
) -> dict[str, Any]:
    """The fingerprint to record for the selected rows (the union with what an earlier run recorded); nothing
    is written.

    When `resuming` (completions are on disk), every row index both runs selected must hold the same
    content, but for the rows of `may_change` (those whose every line is a data error: the user fixed the row
    that was refused); otherwise ConfigError names the file and the rows that changed. A longer selection
    (more `num_prompts`) extends the record; a shorter one keeps the recorded tail for a later, longer resume.
    A folder written before fingerprints existed (none recorded) is accepted and gets one.
    """
    recorded: list[str] = []
    if resuming and fingerprint.exists():
        try:
            recorded = list(orjson.loads(fingerprint.read_bytes())["row_sha256"])
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{fingerprint}: unreadable ({type(exc).__name__}: {exc}); move it aside to resume "
                "without the dataset check"
            ) from None
        changed = [i for i, (old, new) in enumerate(zip(recorded, digests, strict=False))
                   if old != new and i not in may_change]
        if changed:
            shown = ", ".join(map(str, changed[:20])) + (" ..." if len(changed) > 20 else "")
            raise ConfigError(
                f"{dataset_path} changed since the completions in {fingerprint.parent} were written: "
                f"{len(changed)} of the {min(len(recorded), len(digests))} rows they cover differ (rows {shown}); "
                "resuming would mix answers to different questions. Restore the file, or use another "
                "eval.save_path."
            )
    merged = list(digests) + recorded[len(digests) :]
    return {
        "dataset_path": dataset_path,
        "num_rows": len(merged),
        "sha256": hashlib.sha256("".join(merged).encode()).hexdigest(),
        "row_sha256": merged,
    }


def check_resumable(
    saved_config: Path,
    current: Mapping[str, Any],
    canonical: Callable[[Any], Mapping[str, Any]] | None = None,
    spell: Callable[[str], str] | None = None,
) -> None:
    """Raise ConfigError when the config saved by an earlier run differs from `current` in a key that
    changes completions (anything outside RESUME_MAY_CHANGE)."""
    if not saved_config.exists():
        return
    saved = OmegaConf.to_container(OmegaConf.load(saved_config), resolve=True)
    if canonical is not None:  # a config saved in an older spelling compares by its settings
        try:
            saved = canonical(saved)
        except ValueError:  # ValidationError included: compare as saved, key by key
            pass
    changed = config_changes(saved, current, RESUME_MAY_CHANGE, spell)
    if changed:
        listed = "\n  ".join(f"- {line}" for line in changed)
        raise ConfigError(
            f"{saved_config.parent} holds completions of a different config; resuming would mix them. "
            f"Changed keys:\n  {listed}\nUse another eval.save_path, or restore these values."
        )
