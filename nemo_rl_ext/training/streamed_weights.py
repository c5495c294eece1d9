"""A refit's tensors made a bucket at a time, as the engine reads them: no copy of every changed tensor at once.

`update_weights(..., partial=True)` on the hf engine copies a state dict into its model tensor by tensor, in the
mapping's order. A `StreamedWeights` hands it each tensor when asked: the bucket holding it is made then (a LoRA
target module merged with its adapter, or a bucket of them gathered from the trainer ranks) and the previous
bucket is dropped, so besides the engine's own weights at most one bucket exists at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch


class StreamedWeights(Mapping[str, torch.Tensor]):
    """{name: tensor}, the tensors made bucket by bucket on access (read it in its own order: a bucket is made
    again when a name of an earlier one is asked for)."""

    def __init__(self, buckets: Sequence[Sequence[str]], fetch: Callable[[list[str]], Mapping[str, torch.Tensor]],
                 nbytes: int) -> None:
        self._buckets = [list(b) for b in buckets if b]
        self._bucket_of = {name: i for i, bucket in enumerate(self._buckets) for name in bucket}
        self._fetch = fetch
        self._current: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self.nbytes = nbytes
        """The bytes of every tensor (what `refit/bytes` reports), known without making any."""
        self.fetches = 0
        """How many buckets were made."""

    def __getitem__(self, name: str) -> torch.Tensor:
        index = self._bucket_of[name]
        if self._current is None or self._current[0] != index:
            self._current = None  # the previous bucket goes first
            self._current = (index, self._fetch(self._buckets[index]))
            self.fetches += 1
        return self._current[1][name]

    def __iter__(self) -> Iterator[str]:
        return (name for bucket in self._buckets for name in bucket)

    def __len__(self) -> int:
        return len(self._bucket_of)

    def release(self) -> None:
        """Drop the bucket held (the engine has copied it)."""
        self._current = None


def refit_nbytes(weights: Mapping[str, torch.Tensor]) -> int:
    """The bytes of a refit's tensors, without making a streamed one's."""
    if isinstance(weights, StreamedWeights):
        return weights.nbytes
    return sum(t.numel() * t.element_size() for t in weights.values())
