"""Run a request's generations concurrently, as one: a deadline over all, and none left running after it."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from nemo_rl_ext.models.generation.grammar import GrammarError
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationInterface, GenerationOutput
from nemo_rl_ext.serving.api_errors import ApiError
from nemo_rl_ext.serving.response_format import schema_error


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
        outputs = list(await asyncio.wait_for(asyncio.gather(*tasks), timeout_s))
    except TimeoutError:
        raise ApiError(f"generation did not finish within request_timeout_s={timeout_s}", status_code=504) from None
    except GrammarError as exc:  # a schema the grammar failed on mid-generation: that request alone ends
        raise schema_error(exc) from exc
    except ValueError as exc:  # the backend's "bad input" (e.g. ids outside the vocabulary)
        raise ApiError(f"the backend refused the request: {exc}", param=prompt_param) from exc
    finally:
        for task in tasks:
            task.cancel()  # no-op for finished ones
    for (_, config), out in zip(jobs, outputs, strict=True):
        _check_extras(generation, config, out)
    return outputs


def _check_extras(generation: GenerationInterface, config: GenerationConfig, out: GenerationOutput) -> None:
    """A 400 when the backend left out the top or prompt logprobs the request asked for (a backend that does not
    compute them), rather than an answer silently without them."""
    backend = type(generation).__name__
    if config.top_logprobs and out.top_logprobs is None:
        raise ApiError(f"top logprobs (chat top_logprobs, completions logprobs = {config.top_logprobs}) are not "
                       f"supported by the {backend} backend: it returned none")
    if config.prompt_logprobs is not None and out.prompt_logprobs is None:
        raise ApiError(f"prompt logprobs (completions echo with logprobs) are not supported by the {backend} "
                       "backend: it returned none", param="echo")
