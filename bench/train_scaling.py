"""What `trainer.workers` 1 and 2, LoRA and bf16 cost per rank: state bytes, peak RSS and step time, in one run.

    python bench/train_scaling.py             # every combination, 1 warm-up + 2 timed steps each, 2 rounds
    python bench/train_scaling.py --quick     # 1 round, 1 timed step (a smoke run)

The workload: SmolLM2-135M-Instruct (converted once, `python -m nemo_rl_ext.models.smollm2`) loaded in float32 on
the CPU, one torch thread per process (per rank), the trainer alone (no engine, no rollouts): 8 completions, each
its own chat prompt (the engine benches' eight questions) plus 32 reply tokens drawn at random from the vocabulary,
advantages +-1, loss on the replies, no KL term (so no reference model), one AdamW step per train step,
micro-batches of 4 (so at 2 workers each rank runs one micro-batch per step). Combinations: `trainer.workers` 1
and 2, the full fine-tune against LoRA (r 16, alpha 32, on q/k/v/o_proj), and the policy's dtype (fp32) against
`trainer.mixed_precision: bf16` (bf16 compute, fp32 master weights). A combination the config refuses ("is not
built yet") prints "not built" with the config's reason, and runs once it lands.

Each combination runs in its own fresh process (with 2 workers: that process drives two Ray actor ranks on a local
Ray). Measured in each process that holds a rank (the workers=1 process itself, or each rank actor):
- params: the bytes of the parameters this rank holds (its FSDP2 shards' local tensors; frozen base weights of a
  LoRA policy included), after the steps;
- grads: the bytes of the gradients present when the optimizer steps (a global optimizer step pre-hook);
- optimizer: the bytes of the AdamW state after the step (exp_avg, exp_avg_sq, step; local shards);
- peak RSS: the process's VmHWM, and its VmRSS before the model was loaded (Python, torch, Ray's worker).
Step time: the median of the timed `train_step` calls (wall seconds), and of the refit gather (`refit_weights()`
where the trainer has it, else `state_dict()`: the weights a refit hands the engine, gathered to the driver with 2
workers; with 1 worker the trainer's own tensors, LoRA's targets merged). The load average is
printed with every row: the machine is shared, so wall times are as measured under that load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import QUESTIONS, machine_line, median, print_table  # noqa: E402

SAMPLES = 8
REPLY_TOKENS = 32
MICRO_BATCH = 4
LR = 1e-5
SEED = 0
LORA = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
STATE_GOAL = 0.55
"""Per-rank params + grads + optimizer state at 2 workers, as a fraction of 1 worker's: at most this."""
LORA_OPTIMIZER_GOAL = 0.05
"""LoRA's optimizer state as a fraction of the full fine-tune's (same workers, same precision): at most this."""
COMBOS = [(w, lora, prec) for w in (1, 2) for lora in (False, True) for prec in ("fp32", "bf16")]
"""(workers, LoRA, precision) of every row."""


# ---- the accounting (also run inside each rank) ------------------------------------------------------------


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes this process holds for `tensors`: a DTensor counts its local shard, a tensor shared (tied) or listed
    twice counts once, None is skipped."""
    held = [t for t in tensors if t is not None]  # alive while their ids are compared (ids of freed objects recur)
    seen: set[int] = set()
    total = 0
    for tensor in held:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a fresh view: never compare its id
        total += local.numel() * local.element_size()
    return total


def optimizer_state_bytes(optimizer: Any) -> int:
    """The bytes of every tensor in the optimizer's per-parameter state (local shards)."""
    return local_bytes(v for state in optimizer.state.values() for v in state.values() if hasattr(v, "numel"))


def gradient_bytes(optimizer: Any) -> int:
    """The bytes of the gradients of the optimizer's parameters (local shards), as they are now."""
    return local_bytes(p.grad for group in optimizer.param_groups for p in group["params"])


class StateProbe:
    """Records the largest gradient bytes seen as any optimizer steps, and its state bytes after the step, in this
    process (global optimizer hooks: the trainer's code is left as it is)."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.grads = 0
        self.optimizer = 0
        self.steps = 0
        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]

    def _pre(self, optimizer: Any, *_: Any) -> None:
        self.grads = max(self.grads, gradient_bytes(optimizer))

    def _post(self, optimizer: Any, *_: Any) -> None:
        self.optimizer = max(self.optimizer, optimizer_state_bytes(optimizer))
        self.steps += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def proc_status_kib(field: str) -> int:
    """A KiB field of /proc/self/status (VmRSS, VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def memory_row(params: int, probe: StateProbe, rss_before_kib: int) -> dict[str, float]:
    """One rank's figures (bytes, KiB) as the driver prints them."""
    return {"params": params, "grads": probe.grads, "optimizer": probe.optimizer, "optimizer_steps": probe.steps,
            "peak_rss_kib": proc_status_kib("VmHWM"), "rss_before_kib": rss_before_kib}


# ---- the workers (one process per combination and round) ----------------------------------------------------


def _bench_rank_class() -> type:
    """`TrainerRank` with a probe and a `bench_memory` call (DistributedTrainer builds this instead)."""
    from nemo_rl_ext.training.fsdp_workers import TrainerRank

    class BenchRank(TrainerRank):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._rss_before = proc_status_kib("VmRSS")
            super().__init__(*args, **kwargs)
            self._probe = StateProbe()

        def bench_memory(self) -> dict[str, float]:
            return memory_row(local_bytes(self.policy.parameters()), self._probe, self._rss_before)

    return BenchRank


def config(workdir: Path, workers: int, lora: bool, precision: str) -> Any:
    """The GRPOConfig of a combination; ConfigError when the config refuses it."""
    from nemo_rl_ext.config import load_config
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.models.smollm2 import smollm2_path

    data = workdir / "prompts.jsonl"
    data.write_text(json.dumps({"question": QUESTIONS[0], "answer": "x"}) + "\n")
    trainer: dict[str, Any] = {"workers": workers, "worker": {"num_cpus": 1}}
    if lora:
        trainer["lora"] = LORA
    if precision == "bf16":
        trainer["mixed_precision"] = "bf16"
    cfg = {
        "policy": {"model_name": str(smollm2_path()), "dtype": "float32", "device": "cpu", "max_model_len": 512},
        "data": {"train_path": str(data)},
        "optimizer": {"lr": LR, "micro_batch_size": MICRO_BATCH, "max_grad_norm": 1.0, "minibatches_per_step": 1},
        "loss": {"kl_coef": 0.0},
        "trainer": trainer,
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
        "output_dir": str(workdir / "run"),
    }
    path = workdir / "cfg.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return load_config(path, [], GRPOConfig)


def batch(tokenizer: Any) -> tuple[list[Any], Any]:
    """SAMPLES completions (distinct prompts + REPLY_TOKENS random reply tokens) and their advantages."""
    import torch

    from nemo_rl_ext.objectives.loss import CompletionTensors

    g = torch.Generator().manual_seed(SEED)
    items = []
    for i in range(SAMPLES):
        question = QUESTIONS[i % len(QUESTIONS)] + " Answer briefly." * (i // len(QUESTIONS))
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=True,
                                               add_generation_prompt=True, return_dict=True)["input_ids"]
        reply = torch.randint(0, len(tokenizer), (REPLY_TOKENS,), generator=g)
        ids = torch.cat([torch.tensor(list(prompt)), reply])
        mask = torch.cat([torch.zeros(len(prompt)), torch.ones(REPLY_TOKENS)])
        items.append(CompletionTensors(ids, mask, -torch.rand(ids.numel(), generator=g) * 5 * mask))
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(SAMPLES)])
    return items, advantages


def in_process_trainer(cfg: Any) -> Any:
    """The workers=1 trainer as GRPO builds it (float32 master weights under bf16; LoRA via peft)."""
    import torch

    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.training.lora import with_lora
    from nemo_rl_ext.training.trainer import PolicyTrainer

    model, tokenizer = load_model_and_tokenizer(cfg.policy.model_name, dtype=torch.float32)
    if cfg.trainer.lora is not None:
        model = with_lora(model, cfg.trainer.lora)
    trainer = PolicyTrainer(model, optimizer=cfg.optimizer, loss=cfg.loss.to_loss_config(), temperature=1.0,
                            pad_token_id=int(tokenizer.pad_token_id), mixed_precision=cfg.trainer.mixed_precision,
                            activation_checkpointing=cfg.trainer.activation_checkpointing)
    return trainer, tokenizer


def distributed_trainer(cfg: Any) -> Any:
    """The workers>1 trainer as GRPO builds it, its ranks `BenchRank`s."""
    from nemo_rl_ext.models.loading import load_tokenizer
    from nemo_rl_ext.training import distributed_trainer as dt

    tokenizer = load_tokenizer(cfg.policy.model_name)
    dt.TrainerRank = _bench_rank_class()  # noqa: N806 - what DistributedTrainer hands to ray.remote
    spec = dt.rank_spec(cfg, cfg.policy.model_name, None, int(tokenizer.pad_token_id))
    return dt.DistributedTrainer(spec, cfg.trainer, cfg.policy.cluster), tokenizer


def worker(workers: int, lora: bool, precision: str, steps: int) -> dict[str, Any]:
    """Train 1 + `steps` steps of one combination; its per-rank figures, step and refit seconds, load averages."""
    import torch

    from nemo_rl_ext.config import ConfigError

    torch.set_num_threads(1)
    rss_before = proc_status_kib("VmRSS")
    with tempfile.TemporaryDirectory(prefix="train_scaling_") as tmp:
        try:
            cfg = config(Path(tmp), workers, lora, precision)
        except ConfigError as err:
            if "is not built yet" not in str(err):
                raise
            return {"not_built": " ".join(str(err).split())}
    probe = StateProbe()
    trainer, tokenizer = (in_process_trainer if workers == 1 else distributed_trainer)(cfg)
    items, advantages = batch(tokenizer)
    load_start = os.getloadavg()[0]
    train_s, refit_s = [], []
    # what a refit gathers: with LoRA (where the trainer knows it) the merged target weights alone, else all
    refit_weights = getattr(trainer, "refit_weights", trainer.state_dict)
    try:
        for _ in range(1 + steps):
            start = time.perf_counter()
            metrics = trainer.train_step(items, advantages)
            train_s.append(time.perf_counter() - start)
            assert metrics["optimizer_steps"] == 1.0, metrics
            start = time.perf_counter()
            for _ in refit_weights().values():  # a streamed mapping gathers (or merges) each tensor as it is read
                pass
            refit_s.append(time.perf_counter() - start)
        if workers == 1:
            ranks = [memory_row(local_bytes(trainer.model.parameters()), probe, rss_before)]
        else:
            import ray

            ranks = ray.get([rank.bench_memory.remote() for rank in trainer._ranks])
    finally:
        trainer.close()
    return {"ranks": ranks, "train_s": train_s[1:], "refit_s": refit_s[1:], "load": [load_start, os.getloadavg()[0]],
            "driver_peak_rss_kib": proc_status_kib("VmHWM")}


# ---- the driver ------------------------------------------------------------------------------------------


def spawn(combo: tuple[int, bool, str], steps: int, timeout_s: float) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "RAY_USAGE_STATS_ENABLED": "0"}
    workers, lora, precision = combo
    cmd = [sys.executable, __file__, "--worker", json.dumps([workers, lora, precision]), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {combo} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _key(combo: tuple[int, bool, str]) -> str:
    workers, lora, precision = combo
    return f"w{workers}-{'lora' if lora else 'full'}-{precision}"


def label(combo: tuple[int, bool, str]) -> str:
    workers, lora, precision = combo
    return f"workers {workers}, {'LoRA' if lora else 'full'}, {precision}"


def mib(nbytes: float) -> float:
    return nbytes / 2**20


def state(rank: Mapping[str, float]) -> int:
    """A rank's parameters + gradients + optimizer state, in bytes."""
    return int(rank["params"] + rank["grads"] + rank["optimizer"])


def memory_table(results: Mapping[tuple, list[dict]]) -> None:
    rows = []
    for combo, runs in results.items():
        if "not_built" in runs[0]:
            rows.append([label(combo), "-", "not built", "", "", "", "", "", ""])
            continue
        ranks = runs[0]["ranks"]
        for r, rank in enumerate(ranks):
            peak = max(run["ranks"][r]["peak_rss_kib"] for run in runs) / 1024
            rows.append([label(combo), r, f"{mib(rank['params']):.1f}", f"{mib(rank['grads']):.1f}",
                         f"{mib(rank['optimizer']):.1f}", f"{mib(state(rank)):.1f}", f"{peak:.0f}",
                         f"{rank['rss_before_kib'] / 1024:.0f}", "; ".join(_goals(results, combo, r))])
    print_table(["combination", "rank", "params MiB", "grads MiB", "optimizer MiB", "state MiB", "peak RSS MiB",
                 "RSS before load MiB", "goals"], rows,
                title="Per-rank memory (state = params + grads + AdamW state; peak RSS = the process's VmHWM)")


def _goals(results: Mapping[tuple, list[dict]], combo: tuple[int, bool, str], r: int) -> list[str]:
    """The goals rank `r` of this combination is measured against: 2 workers' state against 1 worker's, LoRA's
    optimizer state against the full fine-tune's (the same rank of the same worker count and precision)."""
    workers, lora, precision = combo
    rank = results[combo][0]["ranks"][r]
    out = []
    one = results.get((1, lora, precision), [{}])[0]
    if workers == 2 and "ranks" in one:
        ratio = state(rank) / state(one["ranks"][0])
        out.append(f"state {ratio:.3f}x of 1 worker (goal <= {STATE_GOAL}x: {'met' if ratio <= STATE_GOAL else 'MISSED'})")
    full = results.get((workers, False, precision), [{}])[0]
    if lora and "ranks" in full:
        ratio = rank["optimizer"] / full["ranks"][r]["optimizer"]
        goal = "met" if ratio <= LORA_OPTIMIZER_GOAL else "MISSED"
        out.append(f"optimizer {100 * ratio:.2f}% of full (goal <= {100 * LORA_OPTIMIZER_GOAL:.0f}%: {goal})")
    return out


def time_table(results: Mapping[tuple, list[dict]]) -> None:
    rows = []
    for combo, runs in results.items():
        if "not_built" in runs[0]:
            rows.append([label(combo), "not built", "", "", "", ""])
            continue
        train = [s for run in runs for s in run["train_s"]]
        refit = [s for run in runs for s in run["refit_s"]]
        loads = [x for run in runs for x in run["load"]]
        base = results.get((1, combo[1], combo[2]), [{}])
        ratio = ""
        if combo[0] == 2 and "train_s" in base[0]:
            ratio = f"{median([s for run in base for s in run['train_s']]) / median(train):.2f}x"
        rows.append([label(combo), f"{median(train):.2f}", f"{min(train):.2f}-{max(train):.2f}",
                     f"{median(refit):.3f}", ratio, f"{min(loads):.1f}-{max(loads):.1f}"])
    print_table(["combination", "train_step s", "range", "refit gather s", "speed vs 1 worker", "load avg"], rows,
                title="Step time (median of the timed steps over rounds; load average over the runs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 1 timed step per process")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 2, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per process (default 2, quick 1)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="deadline of one worker process")
    parser.add_argument("--combos", nargs="+", choices=[_key(c) for c in COMBOS], default=[_key(c) for c in COMBOS],
                        help="the combinations to run (default all), e.g. w1-full-fp32 w2-full-fp32")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        workers, lora, precision = json.loads(args.worker)
        print(json.dumps(worker(workers, lora, precision, args.steps)))
        return
    rounds = args.rounds or (1 if args.quick else 2)
    steps = args.steps or (1 if args.quick else 2)
    print(machine_line())
    print(f"workload: SmolLM2-135M loaded fp32, 1 torch thread per process, {SAMPLES} completions (distinct prompts "
          f"+ {REPLY_TOKENS} reply tokens), micro-batch {MICRO_BATCH}, no KL, 1 AdamW step per train step; LoRA r "
          f"{LORA['r']} on {', '.join(LORA['target_modules'])}; {rounds} round(s) x (1 warm-up + {steps} timed "
          "steps), order rotating", flush=True)
    combos = [c for c in COMBOS if _key(c) in args.combos]
    results: dict[tuple, list[dict]] = {c: [] for c in combos}
    for r in range(rounds):
        for combo in combos[r % len(combos):] + combos[: r % len(combos)]:
            if results[combo] and "not_built" in results[combo][0]:
                continue
            res = spawn(combo, steps, args.timeout_s)
            results[combo].append(res)
            if "not_built" in res:
                print(f"  {label(combo)}: not built ({res['not_built'][:200]})", flush=True)
                continue
            print(f"  round {r + 1}/{rounds} {label(combo)}: train_step "
                  + ", ".join(f"{s:.1f}s" for s in res["train_s"])
                  + f"; state {', '.join(f'{mib(state(k)):.0f}' for k in res['ranks'])} MiB per rank; load avg "
                  f"{res['load'][0]:.1f}-{res['load'][1]:.1f}", flush=True)
    memory_table(results)
    time_table(results)
    for combo, runs in results.items():
        if "not_built" in runs[0]:
            print(f"not built: {label(combo)}: {runs[0]['not_built']}")


if __name__ == "__main__":
    main()
