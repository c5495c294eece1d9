"""What stands between an HTTP request and the policy server's work: key, size, nesting, disconnects.

- `check_api_key`: with a key configured, a request must send `Authorization: Bearer <key>` (401 otherwise).
- `read_body`: the body, refused with 413 past `max_bytes` (by its Content-Length, or while it streams in).
- `parse_json_object`: the body as a JSON object, refused with 400 if it nests deeper than `MAX_JSON_DEPTH`
  (Python's parser and everything after it recurse; 100k nested brackets would raise RecursionError).
- `cancel_on_disconnect`: runs a request's work and cancels it as soon as the client goes away, so a
  generation nobody waits for stops (the backend drops the row at its next decode step).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

from nemo_rl_ext.serving.api_errors import ApiError
from nemo_rl_ext.serving.openai_schemas import MAX_JSON_DEPTH, exceeds_depth, too_deep_message

T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
"""Default bound on a request body (16 MiB: a long multi-turn request with token ids stays far below)."""


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready; its work was cancelled."""


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raise a 401 unless no key is configured (None or "") or the request sends `Bearer <api_key>`."""
    if not api_key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise ApiError(
            "missing or wrong API key: send the server's key as 'Authorization: Bearer <key>'",
            status_code=401,
        )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body; a 413 once it is known to exceed `max_bytes` (before reading it when possible)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(f"the Content-Length header is not an integer: {declared!r}") from None
        if size > max_bytes:
            raise _too_large(size, max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes, at_least=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, max_bytes: int, *, at_least: bool = False) -> ApiError:
    return ApiError(
        f"the request body has {'over ' if at_least else ''}{size} bytes; this server accepts at most "
        f"{max_bytes} (its max_request_bytes, --max-request-bytes)",
        status_code=413,
    )


def parse_json_object(raw: bytes | str) -> dict[str, Any]:
    """The body as a JSON object; 400 naming the problem if it is not JSON, not an object, or too deep."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(too_deep_message("the request body")) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise ApiError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    if exceeds_depth(body, MAX_JSON_DEPTH):
        deep = [k for k, v in body.items() if exceeds_depth(v, MAX_JSON_DEPTH - 1)]
        raise ApiError(too_deep_message("the request body"), param=deep[0] if deep else None)
    return body


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise `ClientDisconnected`.

    Call it after the body was read: from then on the ASGI `receive` only returns `http.disconnect`
    (when the client goes away, or once the response is sent).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)  # let the cancellation run to its end
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
