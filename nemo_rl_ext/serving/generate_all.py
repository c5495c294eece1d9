"""Run a request's generations concurrently, as one: a deadline over all, and none left running after it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationInterface, GenerationOutput
from nemo_rl_ext.serving.openai_schemas import ApiError


async def generate_all(
    generation: GenerationInterface,
    jobs: Sequence[tuple[Sequence[int], GenerationConfig]],
    timeout_s: float | None,
    prompt_param: str | None = None,
) -> list[GenerationOutput]:
    """Every (prompt ids, config) job's output, in order; when one fails, or `timeout_s` runs out (a 504), or
    the caller is cancelled, the others are cancelled. A backend's ValueError (bad input) becomes a 400 whose
    `param` is `prompt_param`."""
    tasks = [asyncio.ensure_future(generation.generate_async(list(ids), config)) for ids, config in jobs]
    try:
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout_s))
    except TimeoutError:
        raise ApiError(f"generation did not finish within request_timeout_s={timeout_s}", status_code=504) from None
    except ValueError as exc:  # the backend's "bad input" (e.g. ids outside the vocabulary)
        raise ApiError(f"the backend refused the request: {exc}", param=prompt_param) from exc
    finally:
        for task in tasks:
            task.cancel()  # no-op for finished ones
