"""An OpenAI-compatible policy server that exposes any `GenerationInterface` over HTTP (for NeMo Gym).

Endpoints, shaped like vLLM's OpenAI server as NeMo-RL extends it:

- `POST /v1/chat/completions`: messages (+ tools) through the tokenizer's chat template, sampling parameters,
  `logprobs` (`return_tokens_as_token_ids` gives `"token_id:<int>"` tokens), Qwen/Hermes `<tool_call>` blocks
  parsed into OpenAI `tool_calls`. Each choice's message also carries `prompt_token_ids`,
  `generation_token_ids` and `generation_log_probs`; an assistant message in the request that carries them
  makes the new prompt start with exactly those ids (see `chat_prompt`). `stream: true`: SSE (`chat_stream`).
- `POST /v1/completions`: OpenAI text completions (see `completions`), each choice with the same token fields.
  Both take `response_format` json_object / json_schema (structured output, see `response_format`).
- `POST /tokenize`: the prompt ids a completion with the same messages would use (`{tokens, count,
  max_model_len}`), or the ids of a plain `prompt` string.
- `GET /v1/models`, `GET /health`.
- `GET /metrics`: Prometheus text (requests by route and status, cancelled requests, errors, prompt and
  generated tokens, time-to-first-token and end-to-end latency histograms, the engine's running and waiting
  rows, the weight version; see `server_metrics`). Like `/health` it needs no API key, as in vLLM (whose
  `--api-key` guards only its `/v1` routes): scrapers call it, and it holds counts, never request content.

Requests are served concurrently (each awaits `generate_async`), so a batching backend batches them.
Refused requests get a 400 whose message names the field and value; unexpected failures a 500 with the
message. In process: `with PolicyServer(generation, tokenizer) as srv: OpenAI(base_url=srv.base_url)`.
From the shell: `python -m nemo_rl_ext.serving.policy_server --model tiny --port 8000`
(`--max-tokens N`, default 256: what a request without max_tokens may generate).

One request never harms another: sampling fields are bounded before anything is batched; parsing,
chat-template rendering and tokenization run in worker threads, never on the event loop; bodies over
`max_request_bytes` get a 413 and JSON nested too deep a 400; a client that disconnects has its
generation cancelled (a batching backend drops its row at the next decode step). With an `api_key`
(`--api-key`, or `NEMO_RL_EXT_API_KEY` for the CLI) every route but `/health` and `/metrics` wants
`Authorization: Bearer <key>` (401 otherwise). It binds 127.0.0.1 unless told otherwise. Each cancelled
request (client gone, or past `request_timeout_s`) is counted and logged at WARNING (rate-limited).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.lifecycle import freeze_startup_heap
from nemo_rl_ext.models.generation.interfaces import GenerationConfig, GenerationInterface
from nemo_rl_ext.plugins import PluginError, add_import_argument, load_plugins
from nemo_rl_ext.serving.api_errors import ApiError
from nemo_rl_ext.serving.policy_service import (  # re-exported: imported from here by callers
    PolicyService,
    RefusedPrompts,
    ServerOptions,
    server_options,
)
from nemo_rl_ext.serving.request_guards import (
    DEFAULT_MAX_REQUEST_BYTES,
    ClientDisconnected,
    cancel_on_disconnect,
    check_api_key,
    parse_json_object,
    read_body,
)
from nemo_rl_ext.serving.server_metrics import CONTENT_TYPE, ServerMetrics
from nemo_rl_ext.serving.streaming import SseResponse
from nemo_rl_ext.serving.threaded_server import ThreadedServer, bind_socket, url_host

logger = logging.getLogger(__name__)

API_KEY_ENV = "NEMO_RL_EXT_API_KEY"
"""Environment variable the CLI reads its `--api-key` default from (in-process servers never read it)."""
DEFAULT_MAX_TOKENS = GenerationConfig().max_new_tokens
"""The CLI's `--max-tokens` default: a request without max_tokens must not generate until the context is full."""


async def _answer(
    request: Request, handler, metrics: ServerMetrics, api_key: str | None, max_request_bytes: int
) -> Response:
    """Run `handler(body, received_at)` for a POST route; count and log how it ended."""
    route, received_at = request.url.path, time.monotonic()
    metrics.in_progress.inc()
    try:
        check_api_key(request, api_key)
        raw = await read_body(request, max_request_bytes)
        body = await asyncio.to_thread(parse_json_object, raw)
        result = await cancel_on_disconnect(request, handler(body, received_at))
        result = result if isinstance(result, Response) else JSONResponse(result)
        if not isinstance(result, SseResponse):  # a stream counts itself when it is over (200 or 499)
            metrics.answered(route, 200)
        return result
    except (ClientDisconnected, ClientDisconnect):  # while generating, or while the body streamed in
        metrics.cancel(route, "client_disconnect", time.monotonic() - received_at)
        metrics.answered(route, 499)
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    except ApiError as err:
        logger.info("%s %s -> %d: %s", request.method, route, err.status_code, err.message)
        if err.status_code == 504:  # request_timeout_s: its generation was cancelled
            metrics.cancel(route, "timeout", time.monotonic() - received_at)
        metrics.answered(route, err.status_code, err.error_type)
        return JSONResponse(err.body(), status_code=err.status_code)
    except Exception as exc:
        logger.exception("%s %s failed", request.method, route)
        err = ApiError(f"{type(exc).__name__}: {exc}", status_code=500)
        metrics.answered(route, 500, err.error_type)
        return JSONResponse(err.body(), status_code=500)
    finally:
        metrics.in_progress.dec()


def create_app(
    generation: GenerationInterface,
    tokenizer: PreTrainedTokenizerBase,
    options: ServerOptions | None = None,
    **option_fields: Any,
) -> FastAPI:
    """The FastAPI app serving `generation` (see the module docstring for the routes); `options` and
    `option_fields` as in `server_options`."""
    options = server_options(options, **option_fields)
    api_key, max_request_bytes = options.api_key, options.max_request_bytes
    service = PolicyService(generation, tokenizer, options)
    metrics = service.metrics
    app = FastAPI(title="nemo_rl_ext policy server")
    app.state.service = service
    app.state.metrics = metrics

    async def answer(request: Request, handler) -> Response:
        return await _answer(request, handler, metrics, api_key, max_request_bytes)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        return await answer(request, service.chat_completion)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await answer(request, service.text_completion)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await answer(request, lambda body, _: asyncio.to_thread(service.tokenize, body))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check_api_key(request, api_key)
        except ApiError as err:
            metrics.answered(request.url.path, err.status_code, err.error_type)
            return JSONResponse(err.body(), status_code=err.status_code)
        metrics.answered(request.url.path, 200)
        return JSONResponse(service.models())

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness, open without the API key (load balancers and startup probes call it)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        """Prometheus text format, open without the API key like `/health` (and vLLM's `/metrics`)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


class PolicyServer(ThreadedServer):
    """Runs the policy server in a background thread: `with PolicyServer(gen, tok) as srv: ...`.

    The caller keeps ownership of `generation` (stopping the server does not shut the backend down).
    """

    def __init__(
        self,
        generation: GenerationInterface,
        tokenizer: PreTrainedTokenizerBase,
        options: ServerOptions | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 30.0,
        log_level: str = "warning",
        **option_fields: Any,
    ) -> None:
        """`options` and `option_fields` as in `server_options`; the rest is where and how it listens."""
        self.options = server_options(options, **option_fields)
        self.served_model_name = self.options.served_model_name
        super().__init__(
            create_app(generation, tokenizer, self.options),
            host=host,
            port=port,
            name=f"policy server ({self.served_model_name})",
            startup_timeout_s=startup_timeout_s,
            log_level=log_level,
        )

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, `http://HOST:PORT/v1`."""
        return f"{self.url}/v1"

    @property
    def refused_prompts(self) -> RefusedPrompts:
        """The prompts it refused for context length."""
        return self.app.state.service.refused_prompts


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments."""
    from nemo_rl_ext.models.config import PolicyConfig  # local (light, no cycle): could move to the top

    defaults = PolicyConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help='a model folder, "smollm2" or "tiny"')
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    parser.add_argument("--served-model-name", default=None, help="name in /v1/models (default: --model)")
    parser.add_argument("--backend", default=defaults.backend, help="a registered backend: hf, vllm, or one of yours (--import its module)")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--dtype", default=defaults.dtype, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size)
    parser.add_argument(
        "--max-tokens",
        type=_non_negative_int,
        default=DEFAULT_MAX_TOKENS,
        help="most tokens generated for a request that sets no max_tokens / max_completion_tokens (like "
        "vLLM's --override-generation-config max_tokens); 0: up to the context length, as vLLM without it",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer <key>' on every route but /health and /metrics (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, help="larger bodies get a 413"
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template sent with a request (refused by default: templates run loops)",
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="vllm backend: no CUDA graphs / compilation (faster start)"
    )
    parser.add_argument("--log-level", default="info")
    add_import_argument(parser, before="--backend is looked up")
    return parser


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def generation_defaults(max_tokens: int) -> GenerationConfig | None:
    """The server's defaults for fields a request leaves out: `max_tokens` new tokens (0: None, i.e. a
    request without max_tokens generates up to the context length, vLLM's default)."""
    return GenerationConfig(max_new_tokens=max_tokens) if max_tokens else None


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: load the model, then serve it in the foreground until SIGINT / SIGTERM."""
    # local: no cycle, nothing heavy (this module loads torch and transformers already); could move up
    from nemo_rl_ext.models.backends import build_generation
    from nemo_rl_ext.models.config import PolicyConfig, VllmConfig
    from nemo_rl_ext.models.policy import resolve_model_path

    args = build_parser().parse_args(argv)
    try:
        load_plugins(args.imports)  # before --backend is checked: a plugin may register it
    except PluginError as err:  # its message alone, no traceback; 2 as for any bad command line
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = PolicyConfig(
        model_name=args.model,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_batch_size=args.max_batch_size,
        vllm=VllmConfig(enforce_eager=args.enforce_eager),
    )
    path = resolve_model_path(cfg)
    generation = build_generation(cfg)
    name = args.served_model_name or args.model
    options = ServerOptions(
        served_model_name=name,
        default_config=generation_defaults(args.max_tokens),
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    app = create_app(generation, generation.tokenizer, options)
    freeze_startup_heap()  # the imports' and the model's objects leave the collector's scans
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    logger.info(
        "policy server for %s (max_model_len=%d, max_tokens=%s) listening on http://%s:%d/v1 (%s)",
        path,
        generation.max_model_len,
        args.max_tokens or "up to the context length",
        url_host(args.host),
        port,
        "API key required" if args.api_key else "no API key",
    )
    # uvicorn re-raises the SIGTERM it caught once it has stopped; with the default handler that kills
    # the process before `finally` runs, orphaning a vLLM engine's processes. Unwind instead.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level=args.log_level.lower(), lifespan="off")).run(
            sockets=[sock]
        )
    finally:
        sock.close()
        generation.shutdown()


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
