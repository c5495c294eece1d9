"""An endless, seeded stream of prompts whose position is one integer (what a checkpoint stores)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from nemo_rl_ext.data.records import DatumSpec


class PromptStream:
    """Yields dataset rows epoch after epoch, each epoch in a seeded permutation (or in order).

    The order of epoch e depends only on (seed, e), so `consumed` (rows handed out so far) is the whole
    state: restoring it with `load_state_dict` continues exactly where a run stopped.
    """

    def __init__(
        self, datums: Sequence[DatumSpec], *, seed: int, shuffle: bool = True, fingerprint: str | None = None
    ) -> None:
        if not datums:
            raise ValueError("the prompt stream needs at least one row")
        # a list is copied; any other sequence (a table's datums, made when drawn) is kept as it is
        self.datums = list(datums) if isinstance(datums, list) else datums
        self.fingerprint = fingerprint
        """What identifies the dataset's rows (`data.sources.rows_fingerprint`), checked on resume; None: not checked."""
        self.seed = seed
        self.shuffle = shuffle
        self.consumed = 0
        self._order: tuple[int, np.ndarray] | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            n = len(self.datums)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order = (epoch, order)
        return self._order[1]

    @property
    def epoch(self) -> int:
        """The epoch the next row comes from (0-based)."""
        return self.consumed // len(self.datums)

    def next(self, n: int) -> list[DatumSpec]:
        """The next `n` rows (crossing into the next epoch when this one runs out)."""
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.consumed, len(self.datums))
            out.append(self.datums[int(self._epoch_order(epoch)[offset])])
            self.consumed += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The position, as JSON."""
        state: dict[str, Any] = {"consumed": self.consumed, "num_rows": len(self.datums)}
        if self.fingerprint is not None:
            state["fingerprint"] = self.fingerprint
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the dataset must have the same number of rows, and the same rows
        where both the checkpoint and this stream have a fingerprint)."""
        if int(state["num_rows"]) != len(self.datums):
            raise ValueError(
                f"the checkpoint's dataset had {state['num_rows']} rows, this one has {len(self.datums)}"
            )
        saved = state.get("fingerprint")
        if saved is not None and self.fingerprint is not None and saved != self.fingerprint:
            raise ValueError(
                "the dataset changed since the checkpoint was written (its rows' fingerprint differs: "
                f"{str(saved)[:12]} then, {self.fingerprint[:12]} now); resume with the same rows, or start a new run"
            )
        self.consumed = int(state["consumed"])


class MixedPromptStream:
    """Several datasets in one run: draw k comes from dataset i with probability weights[i] / sum(weights)
    (a generator seeded with (seed, k)), then the next row of that dataset's own `PromptStream` (seeded with
    seed + 1 + i). Like `PromptStream`, `consumed` (draws so far) is the whole state: setting it replays the
    draws to put every dataset's stream where it was."""

    def __init__(self, streams: Sequence[PromptStream], weights: Sequence[float], *, seed: int,
                 fingerprint: str | None = None) -> None:
        if not streams or len(streams) != len(weights) or min(weights) <= 0:
            raise ValueError(f"need one positive weight per dataset, got {list(weights)} for {len(streams)}")
        self.streams = list(streams)
        self.cumulative = np.cumsum(np.asarray(weights, dtype=np.float64)) / float(np.sum(weights))
        self.seed = seed
        self.fingerprint = fingerprint
        """What identifies the datasets' rows, checked on resume (as `PromptStream.fingerprint`)."""
        self._consumed = 0

    def source(self, draw: int) -> int:
        """The dataset of draw `draw` (0-based)."""
        u = np.random.default_rng([self.seed, draw]).random()
        return min(int(np.searchsorted(self.cumulative, u, side="right")), len(self.streams) - 1)

    @property
    def consumed(self) -> int:
        """Draws handed out so far."""
        return self._consumed

    @consumed.setter
    def consumed(self, value: int) -> None:
        for stream in self.streams:
            stream.consumed = 0
        for draw in range(value):
            self.streams[self.source(draw)].consumed += 1
        self._consumed = value

    def next(self, n: int) -> list[DatumSpec]:
        """The next `n` draws."""
        out = []
        for _ in range(n):
            out += self.streams[self.source(self._consumed)].next(1)
            self._consumed += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """The position, as JSON."""
        state: dict[str, Any] = {"consumed": self._consumed, "num_rows": [len(s.datums) for s in self.streams]}
        if self.fingerprint is not None:
            state["fingerprint"] = self.fingerprint
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the same datasets, in the same order, with the same rows)."""
        rows = [len(s.datums) for s in self.streams]
        if state.get("num_rows") != rows:
            raise ValueError(f"the checkpoint's datasets had {state.get('num_rows')} rows, these have {rows}")
        saved = state.get("fingerprint")
        if saved is not None and self.fingerprint is not None and saved != self.fingerprint:
            raise ValueError("the datasets changed since the checkpoint was written (their rows' fingerprint "
                             "differs); resume with the same rows, or start a new run")
        self.consumed = int(state["consumed"])
