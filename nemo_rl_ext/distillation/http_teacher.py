"""A teacher served over HTTP: any OpenAI-compatible server that scores a prompt given as token ids
(`POST /v1/completions` with `echo: true`, `max_tokens: 0`, `logprobs: k`, `return_tokens_as_token_ids`), as
our policy server and vLLM do. A group's sequences go in one request (a list of id lists); each request has a
deadline and is retried with backoff; at most `max_concurrency` requests are in flight."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from nemo_rl_ext.distillation.teacher import Teacher, TeacherError, TeacherScores

logger = logging.getLogger(__name__)

RETRIED_STATUS = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP answers worth another attempt (the server is busy, restarting or timed out); any other error is final."""


def root_url(url: str) -> str:
    """The server's root: `url` without a trailing `/` or `/v1` (both spellings are accepted)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def scoring_body(sequences: Sequence[Sequence[int]], top_k: int, *, as_token_ids: bool = True) -> dict[str, Any]:
    """The `/v1/completions` body that scores `sequences` as they are: the prompt echoed with its logprobs,
    nothing generated, tokens spelled `token_id:<id>` (so the answer can be checked id by id)."""
    return {"prompt": [list(s) for s in sequences], "echo": True, "max_tokens": 0, "logprobs": top_k or 1,
            "temperature": 1.0, "return_tokens_as_token_ids": as_token_ids}


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise TeacherError(f"the teacher spelled a token {token!r}, not token_id:<id> (return_tokens_as_token_ids)")
    return int(token[len("token_id:"):])


def parse_scores(answer: Mapping[str, Any], sequences: Sequence[Sequence[int]], top_k: int) -> list[TeacherScores]:
    """Each sequence's scores from a `/v1/completions` answer to `scoring_body`; `TeacherError` naming what is
    wrong when the answer does not score exactly the ids sent (another tokenization, no prompt logprobs)."""
    choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != len(sequences):
        raise TeacherError(f"the teacher answered {len(choices)} choices for {len(sequences)} sequences")
    out = []
    for i, (choice, seq) in enumerate(zip(choices, sequences, strict=True)):
        logprobs = choice.get("logprobs") or {}
        tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
        if [_token_id(t) for t in tokens] != list(seq) or len(values) != len(seq):
            raise TeacherError(f"sequence {i}: the teacher's echoed tokens are not the {len(seq)} ids sent "
                               f"(got {len(tokens)} tokens, {len(values)} logprobs)")
        if any(v is None for v in values[1:]):
            raise TeacherError(f"sequence {i}: the teacher returned no logprob for some prompt tokens")
        scores = TeacherScores(tuple(float(v) for v in values[1:]))
        if top_k > 0:
            tops = [sorted(((_token_id(t), float(v)) for t, v in (top or {}).items()), key=lambda p: -p[1])[:top_k]
                    for top in (logprobs.get("top_logprobs") or [])[1:]]
            if len(tops) != len(seq) - 1 or any(len(t) < min(top_k, 1) for t in tops):
                raise TeacherError(f"sequence {i}: the teacher returned no top logprobs for the prompt")
            scores = TeacherScores(scores.logprobs, tuple(tuple(t for t, _ in top) for top in tops),
                                   tuple(tuple(v for _, v in top) for top in tops))
        out.append(scores)
    return out


class HttpTeacher(Teacher):
    """Scores sequences through a server's `/v1/completions` (see the module docstring)."""

    def __init__(self, url: str, *, timeout_s: float = 120.0, retries: int = 2, retry_backoff_s: float = 0.5,
                 max_concurrency: int = 16, model: str | None = None) -> None:
        self.name = url
        self.completions_url = root_url(url) + "/v1/completions"
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.max_concurrency = max_concurrency
        self.model = model
        self._loop_state: tuple[asyncio.AbstractEventLoop, httpx.AsyncClient, asyncio.Semaphore] | None = None

    def _state(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        """This event loop's client and concurrency limit (a new loop, e.g. another `asyncio.run`, gets its own)."""
        loop = asyncio.get_running_loop()
        if self._loop_state is None or self._loop_state[0] is not loop:
            limits = httpx.Limits(max_connections=self.max_concurrency)
            client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s)),
                                       limits=limits)
            self._loop_state = (loop, client, asyncio.Semaphore(self.max_concurrency))
        return self._loop_state[1], self._loop_state[2]

    async def score(self, sequences: Sequence[Sequence[int]], top_k: int = 0) -> list[TeacherScores]:
        """One request for all `sequences` (retried: `retries` more attempts, `retry_backoff_s` apart and
        doubling; each within `timeout_s`); `TeacherError` naming the server and the last failure."""
        body = scoring_body(sequences, top_k)
        if self.model is not None:
            body["model"] = self.model
        client, limit = self._state()
        delay, failure = self.retry_backoff_s, ""
        for attempt in range(self.retries + 1):
            if attempt:
                logger.warning("teacher %s: %s; retry %d in %.2fs", self.name, failure, attempt, delay)
                await asyncio.sleep(delay)
                delay *= 2
            try:
                async with limit, asyncio.timeout(self.timeout_s):
                    response = await client.post(self.completions_url, json=body)
            except (httpx.TransportError, TimeoutError) as exc:
                failure = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                continue
            if response.status_code == 200:
                try:
                    answer = response.json()
                except ValueError as exc:
                    raise TeacherError(f"teacher {self.name} answered no JSON: {response.text[:300]!r}") from exc
                return parse_scores(answer, sequences, top_k)
            failure = f"HTTP {response.status_code}: {response.text[:300]}"
            if response.status_code not in RETRIED_STATUS:
                break
        raise TeacherError(f"teacher {self.name} failed after {attempt + 1} attempt(s): {failure}")

    def close(self) -> None:
        """Forget the client (its connections close with their event loop)."""
        self._loop_state = None
