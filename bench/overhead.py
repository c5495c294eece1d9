"""Rollout-layer overhead: the native RolloutManager against a bare asyncio loop doing the same calls.

    python bench/overhead.py            # 1k and 10k rollouts, 1 and 4 turns, 3 rounds (~5 min on 2 cores)
    python bench/overhead.py --quick    # smoke run: 200 and 1k rollouts, 1 round

Both contenders drive the same instant fakes, built here from `nemo_rl_ext.testing`'s doubles:

- `instant_generation` (a `ScriptedGeneration`) returns, after one `asyncio.sleep(0)` (a real engine
  always suspends the caller), a real token list: `--gen-tokens` ids drawn from the tokenizer's
  vocabulary, the last one EOS, with one logprob per id.
- `instant_environment` (a `ScriptedEnvironment`) reads the last assistant message (decoded text), and for
  `turns - 1` steps answers with a real tool observation of `--obs-tokens` tokens of text, which the loop
  frames with the chat template and tokenizes exactly as real observations are; the last step terminates
  with a reward.

The bare loop (the limit) makes the same calls with the same lengths and builds the same token lists:
per turn one `generate_async` on the running ids, a decode of the generated ids (the environment needs
the text), an assistant `Message`, one `env.step`, and the observation rendered and tokenized with the
same `ObservationFormatter`. It keeps every rollout's messages, ids and reward; it skips what the
manager adds (per-request config copies and seeds, fault-policy wrappers, records, metrics, preflight).

Each (contender, case, round) runs in its own subprocess: a warm-up on 80 rollouts, then the timed runs
(3 of them for 1k rollouts, 1 for 10k). Peak memory is the growth of the process's peak RSS (VmHWM, reset
after the warm-up) over its RSS before the first timed run; `--tracemalloc` adds the Python-heap peak from
a separate, untimed run. Rounds alternate the order of the contenders; the table shows medians, the ratio
of rollouts/s (wall clock, last column) and the ratio of CPU time (process time), which a shared machine
disturbs less than the wall clock.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line, median, print_table, spread  # noqa: E402

from nemo_rl_ext.data.chat import ObservationFormatter  # noqa: E402
from nemo_rl_ext.data.datasets import datum_from_messages  # noqa: E402
from nemo_rl_ext.data.records import DatumSpec, Message  # noqa: E402
from nemo_rl_ext.environments.interfaces import Observation  # noqa: E402
from nemo_rl_ext.lifecycle import freeze_startup_heap  # noqa: E402
from nemo_rl_ext.models.generation.interfaces import FinishReason, GenerationConfig  # noqa: E402
from nemo_rl_ext.testing import ScriptedEnvironment, ScriptedGeneration, ScriptedRequest  # noqa: E402

GENERATIONS_PER_PROMPT = 8
WARMUP_ROLLOUTS = 80
CONTENDERS = ("bare", "manager")
WORDS = (
    "the answer is result number sum product value equals plus minus times step think first then so "
    "final correct tool call calculator expression weather city today cold hot water river tree"
).split()


# ---- the instant fakes -------------------------------------------------------------------------------


def instant_generation(vocab_ids: Sequence[int], eos_id: int, gen_tokens: int, seed: int = 0) -> ScriptedGeneration:
    """Returns `gen_tokens` real vocabulary ids (EOS last) and their logprobs at once (calls are counted,
    not recorded, so the fake holds no memory of its own)."""
    rng = random.Random(seed)
    pool = tuple(rng.choice(vocab_ids) for _ in range(65536 + gen_tokens))
    logprobs = tuple(-rng.random() * 3 for _ in range(gen_tokens))
    offset = 0

    def reply(request: ScriptedRequest) -> tuple[int, ...]:
        nonlocal offset
        offset = (offset + 7919) % 65536
        return (*pool[offset : offset + gen_tokens - 1], eos_id)

    return ScriptedGeneration(None, reply, logprobs=lambda prompt, ids, config: logprobs[: len(ids)],
                              max_model_len=1 << 20, record=False)


def instant_environment(observations: Sequence[str], turns: int) -> ScriptedEnvironment:
    """`turns - 1` tool observations of real text, then termination with a reward."""
    texts = [Observation("tool", text) for text in observations]
    return ScriptedEnvironment(
        turns=turns,
        # the environment reads the assistant's text
        observation=lambda s: texts[(s.turn + len(s.message_log[-1].content)) % len(texts)],
        metadata=lambda s: {"turn": s.turn},
        reward=lambda s: 1.0 if s.turn >= turns else 0.0,
    )


# ---- the two contenders --------------------------------------------------------------------------------


async def bare_rollout(datum: DatumSpec, env, gen, config, tokenizer, formatter) -> tuple:
    """The same calls as the manager's turn loop, with nothing around them."""
    messages = list(datum.message_log)
    token_ids = [t for m in messages for t in m.token_ids]
    meta: Mapping[str, Any] = dict(datum.extra_env_info)
    reward = 0.0
    while True:
        out = await gen.generate_async(token_ids, config)
        text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
        messages.append(Message("assistant", text, out.output_ids, out.logprobs))
        token_ids.extend(out.output_ids)
        step = await env.step([messages], [meta])
        reward += step.rewards[0]
        meta = step.metadata[0]
        if step.terminateds[0]:
            return messages, token_ids, reward
        obs = step.observations[0]
        ids = formatter.tokenize(formatter.render(obs.role, obs.content, out.finish_reason is FinishReason.EOS))
        messages.append(Message(obs.role, obs.content, tuple(ids)))
        token_ids.extend(ids)


async def run_bare(datums, env, gen, config, tokenizer, formatter) -> list:
    return await asyncio.gather(
        *(
            bare_rollout(d, env, gen, config, tokenizer, formatter)
            for d in datums
            for _ in range(GENERATIONS_PER_PROMPT)
        )
    )


async def run_manager(datums, env, gen, config, tokenizer, turns) -> list:
    from nemo_rl_ext.experience.rollout_manager import RolloutManager

    manager = RolloutManager(
        tokenizer,
        task_to_env={"bench": env},
        num_generations_per_prompt=GENERATIONS_PER_PROMPT,
        max_seq_len=1 << 16,
        max_rollout_turns=turns,
        policy_generation=gen,
        generation_config=config,
    )
    records, _ = await manager.run_rollouts(datums, progress=False)
    return records


# ---- one worker process ------------------------------------------------------------------------------


def text_of_tokens(tokenizer, n: int, rng: random.Random) -> str:
    """Text whose tokenization has exactly `n` tokens (or the closest from below)."""
    words: list[str] = []
    while True:
        candidate = " ".join([*words, rng.choice(WORDS)])
        if len(tokenizer(candidate, add_special_tokens=False)["input_ids"]) > n:
            break
        words = candidate.split()
    return " ".join(words)


def read_status(field: str) -> int:
    """A `VmRSS`/`VmHWM` value of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def worker(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    if not args.no_freeze:  # as the CLIs do after start-up (lifecycle.freeze_startup_heap), for both contenders
        freeze_startup_heap()
    formatter = ObservationFormatter(tokenizer)
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    observations = [text_of_tokens(tokenizer, args.obs_tokens, rng) for _ in range(16)]
    prompts = [text_of_tokens(tokenizer, args.prompt_tokens, rng) for _ in range(16)]
    config = GenerationConfig(max_new_tokens=args.gen_tokens, temperature=1.0, seed=0)

    def make_datums(n_rollouts: int) -> list[DatumSpec]:
        n_prompts = n_rollouts // GENERATIONS_PER_PROMPT
        return [
            datum_from_messages(tokenizer, i, [{"role": "user", "content": prompts[i % len(prompts)]}], "bench")
            for i in range(n_prompts)
        ]

    cpu_times: list[float] = []

    def run_once(datums: list[DatumSpec]) -> tuple[float, ScriptedGeneration, ScriptedEnvironment, list]:
        gen = instant_generation(vocab, tokenizer.eos_token_id, args.gen_tokens)
        env = instant_environment(observations, args.turns)
        if args.contender == "bare":
            coro = run_bare(datums, env, gen, config, tokenizer, formatter)
        else:
            coro = run_manager(datums, env, gen, config, tokenizer, args.turns)
        start, cpu_start = time.perf_counter(), time.process_time()
        result = asyncio.run(coro)
        cpu_times.append(time.process_time() - cpu_start)
        return time.perf_counter() - start, gen, env, result

    run_once(make_datums(WARMUP_ROLLOUTS))
    cpu_times.clear()
    datums = make_datums(args.rollouts)
    gc.collect()
    rss_before = read_status("VmRSS")
    peak_ok = reset_peak_rss()
    seconds, gen, env, result = run_once(datums)
    peak_growth = read_status("VmHWM") - rss_before if peak_ok else None
    times = [seconds]
    for _ in range(args.reps - 1):
        del result
        gc.collect()
        t, _, _, result = run_once(datums)
        times.append(t)
    n_done = len(result) if args.contender == "bare" else sum(len(r.completions) for r in result)
    tokens = (
        sum(len(ids) for _, ids, _ in result)
        if args.contender == "bare"
        else sum(len(c.token_ids) for r in result for c in r.completions)
    )
    out = {
        "seconds": times,
        "cpu_seconds": cpu_times[: len(times)],
        "rollouts": n_done,
        "generate_calls": gen.num_calls,
        "env_steps": env.num_steps,
        "tokens": tokens,
        "peak_rss_growth": peak_growth,
    }
    del result, gen, env
    gc.collect()
    if args.tracemalloc:
        tracemalloc.start()
        _, _, _, result = run_once(datums)
        out["tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    print(json.dumps(out))


# ---- the driver ------------------------------------------------------------------------------------------


def spawn(args: argparse.Namespace, contender: str, turns: int, rollouts: int, trace: bool) -> dict:
    cmd = [
        sys.executable, __file__, "--worker", contender, "--turns", str(turns), "--rollouts", str(rollouts),
        "--reps", str(max(1, args.work_per_process // rollouts)),
        "--model-dir", args.model_dir, "--gen-tokens", str(args.gen_tokens),
        "--obs-tokens", str(args.obs_tokens), "--prompt-tokens", str(args.prompt_tokens),
    ]
    if trace:
        cmd.append("--tracemalloc")
    if args.no_freeze:
        cmd.append("--no-freeze")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {contender} turns={turns} rollouts={rollouts} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 200 and 1k rollouts, 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per case (default 3, quick 1)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="rollout counts (default 1000 10000)")
    parser.add_argument("--turn-counts", type=int, nargs="+", default=[1, 4], help="turns per rollout (default 1 4)")
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--obs-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--turns", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rollouts", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tracemalloc", action="store_true",
                        help="also measure the Python-heap peak with tracemalloc (an extra, slow run per case)")
    parser.add_argument("--reps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--no-freeze", action="store_true",
                        help="leave the start-up objects in the collector's scans (the CLIs freeze them)")
    parser.add_argument("--work-per-process", type=int, default=3000,
                        help="timed rollouts per process: 1k-rollout cases repeat 3 times in each process")
    args = parser.parse_args()
    if args.worker:
        args.contender = args.worker
        worker(args)
        return

    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.policy import resolve_model_path

    args.model_dir = str(resolve_model_path(PolicyConfig(model_name="tiny")))  # built once, then cached
    rounds = args.rounds or (1 if args.quick else 3)
    sizes = args.sizes or ([200, 1000] if args.quick else [1000, 10000])
    print(machine_line())
    print(
        f"workload: {GENERATIONS_PER_PROMPT} rollouts per prompt, prompt {args.prompt_tokens} tokens, "
        f"{args.gen_tokens} generated tokens per turn, {args.obs_tokens}-token observations; "
        f"instant fakes; {rounds} round(s), contenders alternate; each run in its own process"
    )
    cases = [(turns, n) for n in sizes for turns in args.turn_counts]
    results: dict[tuple, list[dict]] = {}
    start = time.perf_counter()
    for r in range(rounds):
        for turns, n in cases:
            order = CONTENDERS if (r + turns) % 2 == 0 else CONTENDERS[::-1]
            for contender in order:
                res = spawn(args, contender, turns, n, trace=args.tracemalloc and r == 0)
                results.setdefault((turns, n, contender), []).append(res)
                rates = " ".join(f"{res['rollouts'] / t:,.0f}" for t in res["seconds"])
                print(f"  round {r + 1}/{rounds} turns={turns} rollouts={n:>6} {contender:>7}: {rates} rollouts/s",
                      flush=True)
    rows = []
    per_rollout: dict[tuple[int, int, str], tuple[float, float]] = {}  # (turns, n, contender) -> (wall, CPU) µs
    for turns, n in cases:
        bare, mgr = results[(turns, n, "bare")], results[(turns, n, "manager")]
        for res in (*bare, *mgr):
            assert res["rollouts"] == n and res["generate_calls"] == n * turns and res["env_steps"] == n * turns
        assert {res["tokens"] for res in bare} == {res["tokens"] for res in mgr}, "contenders built different ids"
        # one rate per process (the median of its reps); a ratio per round, from the two processes of that round
        bare_rate = [median([n / t for t in res["seconds"]]) for res in bare]
        mgr_rate = [median([n / t for t in res["seconds"]]) for res in mgr]
        ratios = [m / b for m, b in zip(mgr_rate, bare_rate, strict=True)]
        bare_cpu = [median(res["cpu_seconds"]) for res in bare]
        mgr_cpu = [median(res["cpu_seconds"]) for res in mgr]
        cpu_ratios = [b / m for m, b in zip(mgr_cpu, bare_cpu, strict=True)]
        for name, rates, cpus in (("bare", bare_rate, bare_cpu), ("manager", mgr_rate, mgr_cpu)):
            per_rollout[(turns, n, name)] = (1e6 / median(rates), 1e6 * median(cpus) / n)

        def mib(key: str, runs: list[dict]) -> str:
            values = [res[key] for res in runs if res.get(key) is not None]
            return f"{median(values) / 2**20:.0f}" if values else "n/a"

        rows.append([
            turns, n, f"{median(bare_rate):,.0f}", f"{median(mgr_rate):,.0f}",
            f"{per_rollout[(turns, n, 'bare')][1]:.0f} / {per_rollout[(turns, n, 'manager')][1]:.0f}",
            f"{mib('peak_rss_growth', bare)} / {mib('peak_rss_growth', mgr)}",
            *([f"{mib('tracemalloc_peak', bare)} / {mib('tracemalloc_peak', mgr)}"] if args.tracemalloc else []),
            f"{median(cpu_ratios):.2f} ({spread(cpu_ratios)})",
            f"{median(ratios):.2f} ({spread(ratios)})",
        ])
    print_table(
        ["turns", "rollouts", "bare loop rollouts/s", "RolloutManager rollouts/s",
         "CPU µs per rollout (bare / manager)",
         "peak RSS growth MiB (bare / manager)",
         *(["tracemalloc peak MiB (bare / manager)"] if args.tracemalloc else []),
         "CPU-time ratio (min-max)", "ratio manager/bare, rollouts/s (min-max)"],
        rows,
        title=f"Native rollout overhead (medians over {rounds} round(s); target ratio >= 0.5)",
    )
    small, large = min(sizes), max(sizes)
    for turns in args.turn_counts:
        if small == large:
            break
        growth = []
        for name in CONTENDERS:
            (wall_s, cpu_s), (wall_l, cpu_l) = per_rollout[(turns, small, name)], per_rollout[(turns, large, name)]
            growth.append(f"{name} {wall_l / wall_s:.2f} wall, {cpu_l / cpu_s:.2f} CPU")
        print(f"cost per rollout at {large:,} over {small:,} ({turns} turn(s); target <= 1.2 for the manager): "
              + "; ".join(growth))
    print(f"total bench time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
