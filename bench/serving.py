"""The policy server over HTTP: streaming against non-streaming, and the cost of a response_format grammar.

    python bench/serving.py                    # tiny random Qwen2: bursts of 16 requests x 32 tokens
    python bench/serving.py --model smollm2    # SmolLM2-135M-Instruct: bursts of 8 requests
    python bench/serving.py --quick            # smoke run

A real `PolicyServer` (uvicorn on 127.0.0.1, in this process) over the hf engine, called over its socket by an
`httpx` client that sends `--requests` chat completions at once (a burst) and waits for all of them. Contenders,
run alternately over `--rounds` rounds after one warm-up each (who goes first rotates):

- `non-streaming` (the baseline): `max_tokens=--tokens`, EOS ignored by its engine, so every request generates
  exactly `--tokens` tokens. Its time to first token is the time to the whole answer (what such a client waits).
- `streaming`: the same requests with `stream: true`; time to first token = the first chunk with content. Until
  the server streams (it answers 400 to `stream: true`), its rows say "not built".
- `json_schema`: the same prompts with `response_format` json_schema (an object with a bounded string, an integer,
  an array of integers and an enum), on a second engine over the same model that keeps EOS (the grammar ends each
  row with it). Its baseline is `same lengths, no grammar`: the same requests without response_format, each
  with max_tokens = the length request i generated under the grammar in the warm-up (seeded, so every round
  generates the same lengths), on the EOS-ignoring engine: the same rows of the same lengths in the same batches,
  without the feature. The grammar's own CPU time on the engine thread (the llguidance mask of each step plus
  advancing each row's matcher) is also measured and reported per constrained token.

Reported per contender: requests/s (burst size / burst wall time), p50 and p95 time to first token over every
request of every round, ms per decoded token (burst wall time / tokens) and CPU ms per decoded token (this
process's CPU time: the figure a loaded machine disturbs least), and the ratios to its baseline (medians of
per-round ratios, min-max). Client, server and engine share this process and its cores, for every contender
alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import QUESTIONS, engine_bench_parser, machine_line, main_args, median, print_table, spread  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = engine_bench_parser(__doc__.splitlines()[0], "smoke run: smaller bursts, fewer rounds")
    parser.add_argument("--requests", type=int, default=None, help="requests per burst (default 16; smollm2 8; quick 4)")
    parser.add_argument("--tokens", type=int, default=None, help="max_tokens per request (default 32; quick 8)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 5; smollm2 3; quick 1)")
    args = parser.parse_args()
    args.requests = args.requests or (4 if args.quick else 8 if args.model == "smollm2" else 16)
    args.tokens = args.tokens or (8 if args.quick else 32)
    args.rounds = args.rounds or (1 if args.quick else 3 if args.model == "smollm2" else 5)
    return args


ARGS = main_args(__name__, parse_args)  # before torch is imported

import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402

from nemo_rl_ext.models.generation import grammar  # noqa: E402
from nemo_rl_ext.models.generation.hf_backend import HfGeneration  # noqa: E402
from nemo_rl_ext.serving.policy_server import PolicyServer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "degrees": {"type": "integer", "minimum": -60, "maximum": 60},
        "hourly": {"type": "array", "items": {"type": "integer", "minimum": -60, "maximum": 60}, "maxItems": 6},
        "sky": {"type": "string", "enum": ["clear", "cloudy", "rain", "snow"]},
    },
    "required": ["city", "degrees", "hourly", "sky"],
    "additionalProperties": False,
}
"""The json_schema contender's schema: every field bounded, so a random model finishes it too."""
NOT_BUILT = "not built"
BASELINES = {
    "non-streaming": "non-streaming",
    "streaming": "non-streaming",
    "same lengths, no grammar": "same lengths, no grammar",
    "json_schema": "same lengths, no grammar",
}
"""Each contender and the one its ratios are taken against."""


@dataclass
class Burst:
    """One contender's burst: its wall time, each request's time to first token, tokens generated."""

    wall_s: float
    cpu_s: float
    """CPU time of this process (client, server and engine) during the burst."""
    ttft_s: list[float]
    tokens: list[int]
    """Tokens each request generated."""

    @property
    def requests_per_s(self) -> float:
        return len(self.ttft_s) / self.wall_s

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.wall_s / sum(self.tokens)

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000 * self.cpu_s / sum(self.tokens)


@dataclass
class GrammarClock:
    """CPU time the engine thread spends in the grammar's mask and matcher advances (patched into the engine's
    calls; `time.thread_time`, so time other processes take from the core is not counted)."""

    seconds: float = 0.0
    tokens: int = 0
    originals: dict = field(default_factory=dict)

    def install(self) -> None:
        mask, accept = grammar.Grammars.mask, grammar.RowGrammar.accept
        self.originals = {"mask": mask, "accept": accept}

        def timed_mask(logits, grammars):
            start = time.thread_time()
            try:
                return mask(logits, grammars)
            finally:
                self.seconds += time.thread_time() - start

        def timed_accept(row_grammar, token):
            start = time.thread_time()
            try:
                return accept(row_grammar, token)
            finally:
                self.seconds += time.thread_time() - start
                self.tokens += 1

        grammar.Grammars.mask = staticmethod(timed_mask)
        grammar.RowGrammar.accept = timed_accept


async def burst(client: httpx.AsyncClient, url: str, bodies: list[dict], stream: bool) -> Burst:
    """Send every body at once; time each one's first token (the answer, or the first content chunk)."""
    start, cpu_start = time.perf_counter(), time.process_time()

    async def one(body: dict) -> tuple[float, int]:
        if not stream:
            answer = await client.post(url, json=body)
            answer.raise_for_status()
            choice = answer.json()["choices"][0]
            return time.perf_counter() - start, len(choice["message"]["generation_token_ids"])
        first, tokens = None, 0
        async with client.stream("POST", url, json={**body, "stream": True}) as answer:
            answer.raise_for_status()
            async for line in answer.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if first is None and delta.get("content"):
                        first = time.perf_counter() - start
                    tokens = len(delta.get("generation_token_ids") or ()) or tokens  # in the last chunk
        return (first if first is not None else time.perf_counter() - start), tokens

    results = await asyncio.gather(*(one(b) for b in bodies))
    return Burst(time.perf_counter() - start, time.process_time() - cpu_start, [t for t, _ in results],
                 [n for _, n in results])


async def streams(client: httpx.AsyncClient, url: str, body: dict) -> bool:
    """Whether the server answers `stream: true` (it said 400 before streaming was built)."""
    async with client.stream("POST", url, json={**body, "max_tokens": 2, "stream": True}) as answer:
        await answer.aread()
        return answer.status_code == 200


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run(args: argparse.Namespace, model, tokenizer) -> tuple[dict[str, list[Burst]], GrammarClock, bool]:
    """Both servers up, every contender's warm-up and rounds; returns the bursts, the grammar clock, streaming."""
    kwargs = {"max_model_len": 2048, "max_batch_size": max(64, args.requests), "num_threads": args.threads}
    plain, constrained = HfGeneration(model, tokenizer, **kwargs), HfGeneration(model, tokenizer, **kwargs)
    plain._eos_ids = frozenset({-1})  # every plain request generates exactly max_tokens
    clock = GrammarClock()
    clock.install()
    messages = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.requests)]
    base = [{"model": "policy", "messages": m, "max_tokens": args.tokens, "temperature": 1.0, "seed": i}
            for i, m in enumerate(messages)]
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    schema_bodies = [{**b, "max_tokens": 512, "response_format": fmt} for b in base]
    results: dict[str, list[Burst]] = {name: [] for name in BASELINES}
    loop = asyncio.new_event_loop()
    with PolicyServer(plain, tokenizer) as plain_srv, PolicyServer(constrained, tokenizer) as schema_srv:
        client = httpx.AsyncClient(timeout=600)
        plain_url, schema_url = f"{plain_srv.base_url}/chat/completions", f"{schema_srv.base_url}/chat/completions"
        lengths = loop.run_until_complete(burst(client, schema_url, schema_bodies, stream=False)).tokens  # warm-up
        same_lengths = [{**b, "max_tokens": n} for b, n in zip(base, lengths, strict=True)]
        contenders = {
            "non-streaming": lambda: burst(client, plain_url, base, stream=False),
            "streaming": lambda: burst(client, plain_url, base, stream=True),
            "same lengths, no grammar": lambda: burst(client, plain_url, same_lengths, stream=False),
            "json_schema": lambda: burst(client, schema_url, schema_bodies, stream=False),
        }
        can_stream = loop.run_until_complete(streams(client, plain_url, base[0]))
        if not can_stream:
            del contenders["streaming"]
        names = list(contenders)
        for name in names:  # warm-up
            loop.run_until_complete(contenders[name]())
        clock.seconds, clock.tokens = 0.0, 0
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                results[name].append(loop.run_until_complete(contenders[name]()))
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {results[n][-1].requests_per_s:.2f} req/s" for n in names), flush=True)
        loop.run_until_complete(client.aclose())
    loop.close()
    plain.shutdown()
    constrained.shutdown()
    return results, clock, can_stream


def main() -> None:
    args = ARGS
    torch.set_num_threads(args.threads)
    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.models.policy import resolve_model_path

    path = resolve_model_path(PolicyConfig(model_name=args.model))
    model, tokenizer = load_model_and_tokenizer(path, dtype=torch.float32, device="cpu")
    n_params = sum(p.numel() for p in model.parameters())
    print(machine_line("device cpu"))
    print(f"model {args.model} ({n_params / 1e6:.1f}M params, fp32, vocab {len(tokenizer):,}); bursts of "
          f"{args.requests} requests, {args.tokens} tokens each (json_schema: until the grammar ends); "
          f"{args.rounds} rounds")
    results, clock, can_stream = run(args, model, tokenizer)

    table = []
    for name, runs in results.items():
        baseline = results[BASELINES[name]]
        if not runs:
            table.append([name, BASELINES[name], *[NOT_BUILT] * 8])
            continue
        ttft = [t for b in runs for t in b.ttft_s]
        rate_ratios = [b.requests_per_s / a.requests_per_s for a, b in zip(baseline, runs, strict=True)]
        token_ratios = [b.ms_per_token / a.ms_per_token for a, b in zip(baseline, runs, strict=True)]
        cpu_ratios = [b.cpu_ms_per_token / a.cpu_ms_per_token for a, b in zip(baseline, runs, strict=True)]
        table.append([name, BASELINES[name], f"{median([b.requests_per_s for b in runs]):.2f}", f"{1000 * percentile(ttft, 50):.0f}",
                      f"{1000 * percentile(ttft, 95):.0f}", f"{median([b.ms_per_token for b in runs]):.2f}",
                      f"{median([b.cpu_ms_per_token for b in runs]):.2f}",
                      f"{median(rate_ratios):.2f} ({spread(rate_ratios)})",
                      f"{median(token_ratios):.2f} ({spread(token_ratios)})",
                      f"{median(cpu_ratios):.2f} ({spread(cpu_ratios)})"])
    print_table(["contender", "against", "requests/s", "TTFT p50 ms", "TTFT p95 ms", "ms / decoded token",
                 "CPU ms / token", "requests/s ratio (min-max)", "ms/token ratio (min-max)",
                 "CPU ms/token ratio (min-max)"],
                table, title=f"Policy server over HTTP, {args.model} (medians of {args.rounds} rounds)")
    schema_cpu_ms = median([b.cpu_ms_per_token for b in results["json_schema"]])
    per_token_us = 1e6 * clock.seconds / max(clock.tokens, 1)
    print(f"grammar mask + matcher advance: {per_token_us:.0f} us of engine-thread CPU per constrained token "
          f"({clock.tokens:,} tokens; {per_token_us / 10 / schema_cpu_ms:.1f}% of the json_schema contender's "
          f"CPU time per decoded token)")
    if not can_stream:
        print("streaming: not built (the server answers 400 to stream: true)")


if __name__ == "__main__":
    main()
