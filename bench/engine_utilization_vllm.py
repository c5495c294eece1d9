"""Engine utilization on vLLM: RolloutManager over VllmGeneration vs raw vLLM AsyncLLM (the same engine), same prompts and lengths.

    python bench/engine_utilization_vllm.py [--model tiny|smollm2] [--rounds 5]   (GPU: the vllm extra;
    CPU: VENV=$(scripts/setup_vllm_cpu.sh | tail -n1); VLLM_CPU_KVCACHE_SPACE=1 $VENV/bin/python ...)

Contenders (each runs all rows concurrently; every row produces exactly T tokens: ignore_eos on every side):
- raw AsyncLLM.generate: the engine's own coroutine for every row, gathered ON the engine loop (one thread hop
  per batch), SamplingParams identical to the backend's (temperature 1, seed per row, logprobs=0, FINAL_ONLY).
- VllmGeneration.generate_async: our backend (per-request thread hop, output conversion).
- RolloutManager.run_rollouts over VllmGeneration: single-turn rollouts, instant environment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    import vllm
    from _common import QUESTIONS, alternate_rounds, machine_line, median, print_table, spread
    from engine_utilization import full_length_runs
    from vllm.inputs import TokensPrompt

    from nemo_rl_ext.data.datasets import datum_from_messages
    from nemo_rl_ext.experience.rollout_manager import RolloutManager
    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.generation.interfaces import GenerationConfig
    from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration
    from nemo_rl_ext.models.loading import load_tokenizer
    from nemo_rl_ext.models.policy import resolve_model_path
    from nemo_rl_ext.testing import ScriptedEnvironment

    path = resolve_model_path(PolicyConfig(model_name=args.model))
    tokenizer = load_tokenizer(path)
    rows, T = args.prompts * args.samples, args.max_new_tokens
    datums = [
        datum_from_messages(tokenizer, i, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "bench")
        for i in range(args.prompts)
    ]
    prompts = [[t for m in d.message_log for t in m.token_ids] for d in datums]
    row_prompts = [q for q in prompts for _ in range(args.samples)]
    width = max(len(q) for q in row_prompts)
    print(machine_line(f"vllm {vllm.__version__} (CPU build), VLLM_CPU_KVCACHE_SPACE=1"))
    print(f"model {args.model}, fp32, {args.prompts} prompts x {args.samples} samples = {rows} rows x {T} new "
          f"tokens, temperature 1.0, {args.rounds} rounds; prompt lengths {[len(q) for q in prompts]}")

    t0 = time.perf_counter()
    gen = VllmGeneration(path, max_model_len=width + T + 8, dtype="float32", enforce_eager=True)
    print(f"engine up in {time.perf_counter() - t0:.1f} s")
    make_params = gen.sampling_params

    def params_ignore_eos(config, max_tokens):
        sp = make_params(config, max_tokens)
        sp.ignore_eos = True  # every row runs to max_tokens, on every side
        return sp

    gen.sampling_params = params_ignore_eos
    config = GenerationConfig(max_new_tokens=T, temperature=1.0, top_p=1.0, seed=1)
    row_configs = [config.model_copy(update={"seed": i}) for i in range(rows)]
    manager = RolloutManager(
        tokenizer, task_to_env={"bench": ScriptedEnvironment(turns=1)}, num_generations_per_prompt=args.samples,
        max_seq_len=width + T + 8, max_rollout_turns=1, policy_generation=gen, generation_config=config,
    )

    async def raw_on_engine_loop() -> int:
        async def one(prompt, cfg):
            final = None
            async for out in gen._engine.generate(TokensPrompt(prompt_token_ids=prompt),
                                             params_ignore_eos(cfg, T), f"raw-{uuid.uuid4().hex}"):
                final = out
            return final

        outs = await asyncio.gather(*(one(q, c) for q, c in zip(row_prompts, row_configs, strict=True)))
        assert all(len(o.outputs[0].token_ids) == T == len(o.outputs[0].logprobs) for o in outs)
        return rows * T

    def raw_async_llm() -> int:
        return asyncio.run_coroutine_threadsafe(raw_on_engine_loop(), gen._loop).result()

    loop = asyncio.new_event_loop()

    engine_async, manager_async = full_length_runs(gen, manager, datums, row_prompts, row_configs, T)

    contenders = {
        "raw vLLM AsyncLLM.generate (the limit)": raw_async_llm,
        "VllmGeneration.generate_async (engine only)": lambda: loop.run_until_complete(engine_async()),
        "RolloutManager over VllmGeneration": lambda: loop.run_until_complete(manager_async()),
    }
    names = list(contenders)
    rates, cpu = alternate_rounds(contenders, args.rounds)
    loop.close()
    gen.shutdown()
    limit = rates[names[0]]
    table = []
    for name in names:
        ratios = [a / b for a, b in zip(rates[name], limit, strict=True)]
        table.append([name, f"{rows} x {T}", f"{rows * T / median(rates[name]):.3f}", f"{median(cpu[name]):.3f}",
                      f"{median(rates[name]):,.0f}", f"{median(ratios):.2f} ({spread(ratios)})"])
    print_table(["contender", "rows x new tokens", "wall s", "main-process CPU s", "tokens/s",
                 "ratio to raw AsyncLLM, tokens/s (min-max)"], table,
                title=f"Engine utilization on vLLM, {args.model} (medians of {args.rounds} rounds; target >= 0.9)")


if __name__ == "__main__":
    main()
