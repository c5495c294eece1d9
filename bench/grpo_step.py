"""Our synchronous GRPO step against TRL's `GRPOTrainer` on the same workload, in alternating runs.

    python bench/grpo_step.py             # 3 rounds; each contender: 1 warm-up + 2 timed steps per round
    python bench/grpo_step.py --quick     # 1 round, 1 timed step (a smoke run)

The workload: SmolLM2-135M-Instruct in fp32 on the CPU, one torch thread per process, 4 prompts x
4 samples x at most 32 new tokens (temperature 1.0), no KL, one AdamW optimizer step per GRPO step, the 16
samples in one forward/backward (our micro_batch_size 16; TRL's per_device_train_batch_size 16 with one
gradient-accumulation step, so one generation batch per optimizer step). The prompts ask for stories, so
most completions run to the 32-token limit on both sides (the table shows the mean). The reward, the same
function on both sides, is the `string_match` similarity of the response to a word; it is cheap.

Contenders, each round each in its own fresh process (the order rotates every round):
- `ours`: `GRPO.train_step` with the defaults: rollouts through the RolloutManager on the in-process HF
  backend (continuous batching), `PolicyTrainer.train_step` (logprobs only at the positions the loss reads,
  each group's prompt run once: `optimizer.share_prompt_prefix`), then the refit of the engine's copy.
- `ours-unshared`: the same with `optimizer.share_prompt_prefix: false` (every sample's full sequence
  through the decoder): what sharing the prompt saves.
- `ours-full-vocab`: the trainer before prompt sharing and the scored-positions-only LM head: no prompt sharing, and the LM head and a
  full-vocabulary log-softmax at every position, prompt included.
- `ours-async`: `grpo.async` with `max_lag: 1` (`in_flight: abort`, the default) on the same workload: generation (the
  engine thread) overlaps the previous step's training (the trainer thread), so this process may use two
  cores where the others use one; its steps/s is the asynchronous figure, its CPU s/step the whole
  process's CPU time over its timed steps.
- `trl`: `trl.GRPOTrainer` with its defaults otherwise (the `bench` extra: `pip install -e '.[bench]'`);
  TRL's configs turn gradient checkpointing on by default, which recomputes the forward in the backward.
- `trl-no-ckpt`: the same with `gradient_checkpointing=False`, as our trainer runs.
  Both TRL contenders are skipped, with the reason, when TRL is not installed.

Times per step: ours: generation = `timing/rollout_s` (rollouts incl. the reward), training =
`timing/train_s` + `timing/refit_s`. TRL: a step runs from `on_step_begin` to `on_step_end`, generation is
its `_generate_and_score_completions` (generation, reward, advantages), training the rest. steps/s is per
process (the median of its timed steps); ours/TRL is taken per round from the two processes of that round,
then the median over rounds. CPU s/step (process time) is shown too: a shared machine disturbs it less than
the wall clock. The asynchronous GRPO figure comes from bench/async_grpo.py and is not measured here.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line, median, print_table, spread  # noqa: E402

PROMPTS = 4
SAMPLES = 4
NEW_TOKENS = 32
LR = 1e-6
SEED = 42
TRL_VERSION = "1.16.0"
WORDS = ("river", "lantern", "orchard", "glacier", "violin", "harbor", "meadow", "comet")
CONTENDERS = ("ours", "ours-unshared", "ours-full-vocab", "ours-async", "trl", "trl-no-ckpt")
TRLS = ("trl", "trl-no-ckpt")


def rows() -> list[dict[str, str]]:
    """Eight prompts that call for long answers, each with the word its response is compared to."""
    return [{"question": f"Write a long story about a {w}, with many details.", "answer": w} for w in WORDS]


def trl_missing() -> str | None:
    """Why TRL cannot run here, or None."""
    if importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install -e '.[bench]')"
    return None


# ---- the workers (one process per contender and round) -------------------------------------------------


def full_vocab_token_logprobs(model, input_ids, attention_mask, temperature=1.0, score_mask=None):
    """The trainer's logprobs before the scored-positions-only LM head: LM head and log-softmax over every position (score_mask unused)."""
    import torch

    temperature = temperature if temperature > 0 else 1.0
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    scaled = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = scaled.gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def worker_ours(steps: int, variant: str, workdir: Path) -> list[dict[str, float]]:
    """Run `steps` GRPO steps of our trainer (`variant`: one of our contenders); per step: wall, CPU,
    generation and training seconds."""
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.loop import GRPO
    from nemo_rl_ext.training import trainer as trainer_module

    if variant == "ours-full-vocab":
        trainer_module.token_logprobs = full_vocab_token_logprobs
    data = workdir / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    cfg = GRPOConfig.model_validate({
        "policy": {
            "model_name": "smollm2", "backend": "hf", "dtype": "float32", "device": "cpu", "max_model_len": 512,
            "generation": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "seed": 0},
        },
        "rollouts": {
            "mode": "native", "num_generations_per_prompt": SAMPLES, "max_rollout_turns": 1, "max_seq_len": 512,
            "env": {"name": "string_match", "kwargs": {"mode": "similarity"}, "system_prompt": ""},
        },
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": PROMPTS, "max_num_steps": steps if variant == "ours-async" else 1000,
                 "seed": SEED, "async": {"enabled": variant == "ours-async", "max_lag": 1}},
        # the loss the rows in docs/benchmarks.md were measured with (before the defaults became NeMo-RL's: KL 0.01, IS off)
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
        "optimizer": {"lr": LR, "micro_batch_size": PROMPTS * SAMPLES, "max_grad_norm": 1.0,
                      "share_prompt_prefix": variant in ("ours", "ours-async")},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
        "output_dir": str(workdir / "run"),
    })
    out = []
    with GRPO(cfg) as grpo:
        if variant == "ours-async":
            return async_steps(grpo)
        for _ in range(steps):
            start, cpu = time.perf_counter(), time.process_time()
            m = grpo.train_step()
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            out.append(step_times(m, wall, cpu))
    return out


def step_times(m: dict[str, float], wall: float, cpu: float) -> dict[str, float]:
    """One step's row from our metrics: wall and CPU seconds, generation and training seconds, tokens, samples."""
    assert m["train/optimizer_steps"] == 1.0, m
    return {
        "wall_s": wall, "cpu_s": cpu, "gen_s": m["timing/rollout_s"],
        "train_s": m["timing/train_s"] + m["timing/refit_s"],
        "completion_tokens": m["rollout/tokens/generated/mean"], "samples": m["train/num_sequences"],
    }


def async_steps(grpo: Any) -> list[dict[str, float]]:
    """Run the asynchronous loop to `grpo.max_num_steps`; a step's wall and CPU time run from the end of the
    previous step (its `timing/step_s` starts when the trainer asks for groups), generation is the trainer's
    wait for them."""
    marks: list[tuple[float, float]] = [(time.perf_counter(), time.process_time())]
    log = grpo.logger.log

    def timed_log(step: int, metrics: dict[str, float]) -> None:
        marks.append((time.perf_counter(), time.process_time()))
        log(step, metrics)

    grpo.logger.log = timed_log
    history = grpo.run()
    assert len(history) == len(marks) - 1, (len(history), len(marks))
    return [
        {**step_times(m, wall1 - wall0, cpu1 - cpu0), "lag_max": m["async/lag/max"]}
        for m, (wall0, cpu0), (wall1, cpu1) in zip(history, marks[:-1], marks[1:], strict=True)
    ]


def worker_trl(steps: int, workdir: Path, checkpointing: bool) -> list[dict[str, float]]:
    """Run `steps` steps of TRL's GRPOTrainer on the same workload; per step as `worker_ours`."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nemo_rl_ext.environments.string_match import match_reward
    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.models.smollm2 import smollm2_path

    model, tokenizer = load_model_and_tokenizer(smollm2_path(), dtype=torch.float32)
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]} for r in rows()]
    )

    def similarity(completions: list, answer: list[str], **_: Any) -> list[float]:
        return [match_reward(c[0]["content"].strip(), a) for c, a in zip(completions, answer, strict=True)]

    args = GRPOConfig(
        output_dir=str(workdir / "trl"), per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1, num_generations=SAMPLES, max_completion_length=NEW_TOKENS,
        temperature=1.0, beta=0.0, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=1.0,
        max_steps=steps, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=SEED, dataloader_num_workers=0, gradient_checkpointing=checkpointing,
    )
    out: list[dict[str, float]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start, self.cpu = time.perf_counter(), time.process_time()
            out.append({"gen_s": 0.0, "completion_tokens": 0.0, "samples": 0.0})

        def on_step_end(self, *_: Any, **__: Any) -> None:
            out[-1]["wall_s"] = time.perf_counter() - self.start
            out[-1]["cpu_s"] = time.process_time() - self.cpu
            out[-1]["train_s"] = out[-1]["wall_s"] - out[-1]["gen_s"]

    trainer = GRPOTrainer(model=model, reward_funcs=similarity, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    generate = trainer._generate_and_score_completions

    def timed_generate(*a: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        result = generate(*a, **kw)
        mask = result["completion_mask"]
        out[-1]["gen_s"] += time.perf_counter() - start
        out[-1]["completion_tokens"] = float(mask.sum()) / mask.shape[0]
        out[-1]["samples"] += float(mask.shape[0])
        return result

    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    return out


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="grpo_step_") as tmp:
        if args.worker in TRLS:
            steps = worker_trl(args.steps, Path(tmp), checkpointing=args.worker == "trl")
        else:
            steps = worker_ours(args.steps, args.worker, Path(tmp))
    print(json.dumps({"steps": steps, "threads": torch.get_num_threads()}))


# ---- the driver ----------------------------------------------------------------------------------------


def spawn(contender: str, steps: int, timeout_s: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, __file__, "--worker", contender, "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {contender} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 timed step per process")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per process (default 2, quick 1)")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of one worker process")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    rounds = args.rounds or (1 if args.quick else 3)
    timed = args.steps or (1 if args.quick else 2)
    contenders = list(args.contenders)
    skipped = trl_missing() if set(TRLS) & set(contenders) else None
    trl_version = None
    if skipped:
        contenders = [c for c in contenders if c not in TRLS]
        print(f"TRL skipped: {skipped}")
    if not contenders:
        print("nothing left to run")
        return
    elif set(TRLS) & set(contenders):
        trl_version = importlib.metadata.version("trl")
        if trl_version != TRL_VERSION:
            print(f"note: TRL {trl_version} installed; the issue measured TRL {TRL_VERSION}")
    print(machine_line(f"TRL {trl_version or 'n/a'}"))
    print(f"workload: SmolLM2-135M fp32, 1 torch thread per process, {PROMPTS} prompts x {SAMPLES} samples x "
          f"<= {NEW_TOKENS} new tokens, no KL, 1 optimizer step per GRPO step, micro-batch {PROMPTS * SAMPLES}; "
          f"{rounds} round(s) x (1 warm-up + {timed} timed steps) per contender, order rotating", flush=True)
    results: dict[str, list[list[dict]]] = {c: [] for c in contenders}
    for r in range(rounds):
        order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
        for contender in order:
            res = spawn(contender, 1 + timed, args.timeout_s)
            assert res["threads"] == 1, res
            steps = res["steps"][1:]  # the first step warms up
            assert len(steps) == timed and all(s["samples"] == PROMPTS * SAMPLES for s in steps), steps
            results[contender].append(steps)
            line = ", ".join(f"{s['wall_s']:.1f}s (gen {s['gen_s']:.1f} + train {s['train_s']:.1f}; CPU {s['cpu_s']:.1f}s)"
                             for s in steps)
            print(f"  round {r + 1}/{rounds} {contender:>15}: {line}", flush=True)

    def rate(steps: list[dict]) -> float:
        return median([1.0 / s["wall_s"] for s in steps])

    def per_step(key: str, name: str) -> float:
        return median([s[key] for run in results[name] for s in run])

    def ratio_to(name: str, trl: str) -> str:
        if trl not in results:
            return f"n/a ({skipped})" if skipped else "n/a"
        ratios = [rate(o) / rate(t) for o, t in zip(results[name], results[trl], strict=True)]
        return f"{median(ratios):.2f}x ({spread(ratios)})"

    trls = [t for t in TRLS if t in args.contenders]
    table = []
    for name in contenders:
        rates = [rate(run) for run in results[name]]
        table.append([
            name, f"{median(rates):.4f}", spread(rates), per_step("wall_s", name), per_step("cpu_s", name),
            per_step("gen_s", name), per_step("train_s", name), per_step("completion_tokens", name),
            *(ratio_to(name, t) for t in trls),
        ])
    print_table(
        ["contender", "steps/s", "spread", "s/step", "CPU s/step", "generation s", "training s",
         "completion tokens", *(f"steps/s vs {t}" for t in trls)],
        table,
        title="GRPO step (medians over rounds; the ratio per round, then its median and spread)",
    )
    for name in (c for c in contenders if c not in TRLS):
        for trl in (t for t in trls if t in results):
            cpu = [median([s["cpu_s"] for s in t]) / median([s["cpu_s"] for s in o])
                   for o, t in zip(results[name], results[trl], strict=True)]
            print(f"CPU time per step, {trl} / {name}, per round: " + ", ".join(f"{x:.2f}x" for x in cpu)
                  + f" (median {median(cpu):.2f}x)")
    for before, after in (("ours-full-vocab", "ours-unshared"), ("ours-unshared", "ours"), ("ours-full-vocab", "ours")):
        if before in results and after in results:
            ratios = [median([s["train_s"] for s in b]) / median([s["train_s"] for s in a])
                      for a, b in zip(results[after], results[before], strict=True)]
            print(f"training time, {before} / {after}, per round: "
                  + ", ".join(f"{x:.2f}x" for x in ratios) + f" (median {median(ratios):.2f}x)")
    if "ours-async" in results:
        lags = sorted({s["lag_max"] for run in results["ours-async"] for s in run})
        print(f"ours-async: policy lag of the timed steps' groups (max per step): {lags}")


if __name__ == "__main__":
    main()
