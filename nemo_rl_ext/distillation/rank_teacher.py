"""A local teacher on the trainer ranks (`trainer.workers > 1`): loaded once on every rank, frozen, FSDP2-sharded
as the reference model is; the driver only sends the ids and reads back the scores. The ranks are reached through
a `TeacherHost` (the distributed trainer), which serializes the calls with the training calls, so scoring while
the trainer trains (asynchronous GRPO) waits for the rank's current call instead of interleaving collectives."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.distillation.local_teacher import batches
from nemo_rl_ext.distillation.teacher import Teacher, TeacherError, TeacherScores
from nemo_rl_ext.distillation.teachers import build_teacher, is_url


class TeacherHost(Protocol):
    """What holds teachers on the trainer ranks (`training.distributed_trainer.DistributedTrainer`)."""

    def load_teacher(self, spec: str) -> str:
        """Load the model `spec` names on every rank (frozen, sharded); returns the key that names it there."""
        ...

    def score_teacher(self, key: str, batches: Sequence[list[list[int]]], top_k: int) -> list[list[TeacherScores]]:
        """Each batch's scores (a forward pass of teacher `key` per batch, spread over the ranks), in order."""
        ...


class RankTeacher(Teacher):
    """A teacher loaded on the trainer ranks: `score` cuts the sequences into batches of at most
    `max_batch_tokens` padded tokens, as `LocalTeacher` does, and has the ranks score them (in a worker thread:
    the event loop keeps generating meanwhile). Any failure of the ranks is a `TeacherError`."""

    def __init__(self, host: TeacherHost, spec: str, *, max_batch_tokens: int = 16384) -> None:
        self.name = spec
        self.host = host
        self.max_batch_tokens = max_batch_tokens
        self.key = host.load_teacher(spec)
        """The name the ranks know this teacher by."""
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rank-teacher")

    async def score(self, sequences: Sequence[Sequence[int]], top_k: int = 0) -> list[TeacherScores]:
        """The scores of `sequences` (in order) from the ranks."""
        cut = batches([list(s) for s in sequences], self.max_batch_tokens)
        loop = asyncio.get_running_loop()
        try:
            scored = await loop.run_in_executor(self._executor, self.host.score_teacher, self.key, cut, top_k)
        except TeacherError:
            raise
        except Exception as exc:  # a rank that died or failed: infrastructure, never the model's answer
            raise TeacherError(f"trainer ranks: {type(exc).__name__}: {str(exc).strip()[:300]}") from exc
        return [s for batch in scored for s in batch]

    def close(self) -> None:
        """Stop the worker thread (the ranks drop the teacher when the trainer closes)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def teachers_on(host: TeacherHost) -> Callable[[str, DistillationSettings], Teacher]:
    """A `build_scorer` maker: a local teacher on `host`'s ranks (never loaded in this process), a URL over HTTP."""

    def make(spec: str, settings: DistillationSettings) -> Teacher:
        if is_url(spec):
            return build_teacher(spec, settings)
        return RankTeacher(host, spec, max_batch_tokens=settings.max_batch_tokens)

    return make
