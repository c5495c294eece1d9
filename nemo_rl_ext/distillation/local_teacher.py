"""A teacher in this process: a model our loaders know (`smollm2`, `tiny`, a folder), loaded once, frozen, in
eval mode, on the student's device and in its precision (`teachers.Placement`), scored with batched forward passes
in one worker thread (the event loop keeps generating meanwhile); on the CPU with one torch thread (as the
engines). The scores come back as Python floats whatever the device."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from nemo_rl_ext.distillation.teacher import Teacher, TeacherScores


class LocalTeacher(Teacher):
    """Scores sequences with `model` (frozen here: no grad, eval mode, never given to an optimizer)."""

    def __init__(self, model: Any, name: str, *, max_batch_tokens: int = 16384, torch_threads: int | None = 1,
                 tokenizer: Any = None, autocast: torch.dtype | None = None) -> None:
        self.name = name
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.autocast = autocast
        """The dtype its forward passes run under autocast in (bf16 mixed precision), or None."""
        init = (lambda: torch.set_num_threads(torch_threads)) if torch_threads else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="teacher", initializer=init)
        self._lock = threading.Lock()

    @classmethod
    def load(cls, name: str, *, dtype: torch.dtype | str = torch.float32, device: str = "cpu",
             autocast: torch.dtype | str | None = None, **kwargs: Any) -> LocalTeacher:
        """Load the model `name` names (as `policy.model_name`: a built-in name or a folder) on `device` with
        weights in `dtype` (a torch dtype or its name), its forward passes under `autocast` (a dtype) or not; on
        the CPU it scores with one torch thread unless `torch_threads` says otherwise (elsewhere torch's own)."""
        # local: models.policy builds the built-in models on first use (light import, but only when loading)
        from nemo_rl_ext.models.config import PolicyConfig
        from nemo_rl_ext.models.loading import load_model_and_tokenizer
        from nemo_rl_ext.models.policy import resolve_model_path

        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        autocast = getattr(torch, autocast) if isinstance(autocast, str) else autocast
        kwargs.setdefault("torch_threads", 1 if torch.device(device).type == "cpu" else None)
        model, tokenizer = load_model_and_tokenizer(resolve_model_path(PolicyConfig(model_name=name)), dtype, device)
        return cls(model, name, tokenizer=tokenizer, autocast=autocast, **kwargs)

    @property
    def device(self) -> torch.device:
        """Where its weights are."""
        return next(self.model.parameters()).device

    async def score(self, sequences: Sequence[Sequence[int]], top_k: int = 0) -> list[TeacherScores]:
        """Forward passes over batches of at most `max_batch_tokens` (padded) tokens, in the worker thread."""
        loop = asyncio.get_running_loop()
        out: list[TeacherScores] = []
        for batch in batches([list(s) for s in sequences], self.max_batch_tokens):
            out += await loop.run_in_executor(self._executor, self._score_batch, batch, top_k)
        return out

    def _score_batch(self, batch: list[list[int]], top_k: int) -> list[TeacherScores]:
        """`score_batch` with this teacher's model (one forward at a time; autocast is per thread: set here)."""
        precision = (torch.autocast(self.device.type, dtype=self.autocast) if self.autocast is not None
                     else contextlib.nullcontext())
        with self._lock, precision:
            return score_batch(self.model, batch, top_k)

    def close(self) -> None:
        """Stop the worker thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def score_batch(model: Any, batch: list[list[int]], top_k: int, device: torch.device | None = None
                ) -> list[TeacherScores]:
    """One right-padded forward pass of `model` over `batch` on `device` (default: its first parameter's): the
    logprob of each next id, and the top-k there (the local teacher's and the trainer ranks' sharded teacher's,
    so both compute the same math)."""
    longest = max(len(s) for s in batch)
    device = device or next(model.parameters()).device
    ids = torch.zeros((len(batch), longest), dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for row, seq in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    out = []
    for row, seq in enumerate(batch):
        logprobs = torch.log_softmax(logits[row, : len(seq) - 1].float(), dim=-1)
        chosen = logprobs.gather(-1, torch.tensor(seq[1:], device=logprobs.device)[:, None])[:, 0]
        scores = TeacherScores(tuple(chosen.tolist()))
        if top_k > 0:
            values, indices = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
            scores = TeacherScores(scores.logprobs, tuple(map(tuple, indices.tolist())),
                                   tuple(map(tuple, values.tolist())))
        out.append(scores)
    return out


def batches(sequences: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """`sequences` in order, cut into batches whose padded size (rows x longest) stays within `max_tokens`
    (a longer sequence alone is a batch)."""
    batches: list[list[list[int]]] = []
    current: list[list[int]] = []
    for seq in sequences:
        if current and (len(current) + 1) * max(len(seq), *map(len, current)) > max_tokens:
            batches.append(current)
            current = []
        current.append(seq)
    if current:
        batches.append(current)
    return batches
