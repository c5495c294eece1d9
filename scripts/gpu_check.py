"""The trainer's device checks, one report file: the hf engine, then a GRPO step with each trainer setting.

    python scripts/gpu_check.py [--device cuda|cpu] [--report PATH]      # scripts/gpu_check.sh wraps it

Runs on a lent GPU image (torch with CUDA, transformers, peft, accelerate; no vLLM, no Ray) on the tiny Qwen2 built
at run time (nothing is downloaded). Each check reports PASS, FAIL or NOT BUILT with its figures in one markdown
file ($OUT/gpu_report.md when $OUT is set, else ./gpu_report.md):

- engine: the hf backend on the device serves concurrent requests by continuous batching (a second wave of
  requests joins the running batch) and its logprobs equal a transformers forward pass over the same tokens.
- grpo: two GRPO steps (rollouts, update, refit) on the device in fp32; then the same with
  `trainer.mixed_precision: bf16`, `trainer.activation_checkpointing: true`, `trainer.lora`, and FSDP2 at world
  size 1 (NCCL on CUDA, gloo on the CPU; on CUDA once more with `trainer.cpu_offload`). A setting whose feature is
  not built yet is refused by the config (`training/config.UNBUILT`): that check says NOT BUILT, and runs unchanged
  once the feature lands.
- teacher: a local distillation teacher built from a GRPO config (`trainer.workers: 1`) lives on the device and
  scores a three-turn tool record; its logprobs equal a CPU float32 forward pass of the same model
  (scripts/gpu_check_teacher.py).
- learning bench: `bench/learning.py --device DEVICE` (eval before -> GRPO -> export -> eval after, an lr-0
  control) on CUDA with SmolLM2 when its package is installed, else (and always on the CPU) on the tiny model's
  say_yes task, with a larger batch on CUDA; its results table goes into the report (scripts/gpu_check_learning.py).

`--device cpu` runs the same logic on the CPU (tests/functional/test_gpu_check.py). Exit status: 0 when no check
failed, 1 otherwise. Nothing here imports Ray (the report says so).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository's nemo_rl_ext, installed or not
sys.path.insert(0, str(REPO / "scripts"))  # gpu_check_learning, however this file is run
ABSENT_ON_THE_IMAGE = ("ray", "vllm")
"""Not on the lent GPU image: blocked here too (`import ray` raises ImportError), so that a code path reaching for
them fails its check on any machine, the CPU test's included, never only on the GPU."""
for _name in ABSENT_ON_THE_IMAGE:
    sys.modules[_name] = None  # type: ignore[assignment]
NEEDED_MODULES = ("nemo_rl_ext.models.tiny", "nemo_rl_ext.models.generation.hf_backend", "nemo_rl_ext.grpo.loop")
"""What the checks import: a missing package (a wheel not carried) is one FAIL naming it, before any check runs."""

import torch  # noqa: E402
from gpu_check_learning import check_learning  # noqa: E402
from gpu_check_teacher import teacher_check  # noqa: E402

ENGINE_RTOL, ENGINE_ATOL = 1e-4, 1e-4
"""Engine logprobs (KV-cache decode, rows padded in a batch) against one fp32 forward pass over the whole sequence:
float rounding of other shapes, measured up to 8e-5 on CPU; a wrong token or stale weight moves a logprob by 1e-2."""
RATIO_TOL = {"fp32": 1e-3, "bf16": 5e-2}
"""How far the trainer's and the engine's probabilities of the sampled tokens may disagree after a refit
(|train/importance_ratio/mean - 1|): float rounding in fp32; bf16 compute (8 mantissa bits, ~4e-3 relative per
logit) against the fp32 engine in bf16."""
LEARNING_BENCH_MAX_S = 300.0
"""The most the learning bench (the last check) may take, however long the deadline."""
WORDS = ("apple", "river", "blue", "seven", "cat", "hello", "tree", "water")


@dataclass
class Result:
    """One check's outcome."""

    name: str
    """What was checked."""
    status: str = "FAIL"
    """PASS, FAIL or NOT BUILT."""
    figures: dict[str, Any] = field(default_factory=dict)
    """What was measured (seconds, counts, differences, memory)."""
    detail: str = ""
    """Why it failed or is not built (an error's traceback, a refused setting's message)."""
    section: str = ""
    """Markdown the report carries after the table (the learning bench's results table)."""


def run_check(name: str, fn: Callable[[Result], None]) -> Result:
    """Run one check; an exception is its FAIL with the traceback (the other checks still run)."""
    result = Result(name)
    start = time.perf_counter()
    try:
        fn(result)
    except Exception:  # noqa: BLE001 - a check's failure is reported, never fatal to the others
        result.status, result.detail = "FAIL", traceback.format_exc(limit=8)
    result.figures["wall_s"] = round(time.perf_counter() - start, 2)
    print(f"[gpu_check] {result.status:9s} {name} {json.dumps(result.figures)}", flush=True)
    return result


def _peak_memory(device: str, result: Result) -> None:
    if device.startswith("cuda"):
        result.figures["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        torch.cuda.reset_peak_memory_stats()


def check_imports(result: Result) -> None:
    """Every module the checks import imports; a missing package is named with the wheel to carry."""
    import importlib

    missing = []
    for module in NEEDED_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as err:
            missing.append(f"{module}: {type(err).__name__}: {err}")
    result.status = "FAIL" if missing else "PASS"
    if missing:
        result.detail = ("\n".join(missing) + "\ncarry the missing packages as wheels in wheels/ "
                         "(docs/training.md, 'Checking on a GPU')")


# ---- the engine ------------------------------------------------------------------------------------------------

def check_engine(device: str, model_dir: Path, result: Result) -> None:
    """Continuous batching of concurrent requests on the device; logprobs equal to a forward pass."""
    from nemo_rl_ext.models.generation.hf_backend import HfGeneration
    from nemo_rl_ext.models.generation.interfaces import GenerationConfig
    from nemo_rl_ext.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_dir, device=device)
    engine = HfGeneration(model, tokenizer, max_model_len=512, scheduler="continuous")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {w}."}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"]
               for w in WORDS]

    async def waves() -> tuple[list[Any], int]:
        first = [asyncio.ensure_future(engine.generate_async(
            prompts[i], GenerationConfig(max_new_tokens=96, temperature=1.0, seed=i))) for i in range(6)]
        while engine.num_decode_steps < 4:  # the first wave is decoding: the second must join its batch
            await asyncio.sleep(0.0005)
        running_when_joined = engine.engine_load().running
        second = [asyncio.ensure_future(engine.generate_async(
            prompts[i % len(prompts)], GenerationConfig(max_new_tokens=16, temperature=1.0, seed=100 + i)))
            for i in range(4)]
        return await asyncio.gather(*first, *second), running_when_joined

    try:
        start = time.perf_counter()
        outputs, running_when_joined = asyncio.run(asyncio.wait_for(waves(), timeout=180))
        seconds = time.perf_counter() - start
        figures = {
            "requests": len(outputs), "generated_tokens": engine.num_generated_tokens,
            "tokens_per_s": round(engine.num_generated_tokens / seconds, 1), "decode_steps": engine.num_decode_steps,
            "prefills": engine.num_prefills, "batches_from_empty": engine.num_batches,
            "rows_running_when_wave_2_came": running_when_joined,
        }
    finally:
        engine.shutdown()
    worst_abs, worst_excess = 0.0, -math.inf
    with torch.no_grad():
        for i, out in enumerate(outputs):
            prompt = prompts[i] if i < 6 else prompts[(i - 6) % len(prompts)]
            ids = torch.tensor([list(prompt) + list(out.output_ids)], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()
            got = torch.tensor(out.logprobs, dtype=torch.float32)
            diff = (got - expected).abs()
            worst_abs = max(worst_abs, float(diff.max()))
            worst_excess = max(worst_excess, float((diff - ENGINE_ATOL - ENGINE_RTOL * expected.abs()).max()))
    figures.update({"logprob_max_abs_diff": f"{worst_abs:.2e}", "tolerance": f"rtol {ENGINE_RTOL} + atol {ENGINE_ATOL}"})
    result.figures.update(figures)
    _peak_memory(device, result)
    problems = []
    if worst_excess > 0:
        problems.append(f"engine logprobs differ from the forward pass by up to {worst_abs:.2e}")
    if running_when_joined > 0 and not (engine.num_batches == 1 and engine.num_prefills >= 2):
        problems.append("the second wave came while rows were decoding but did not join their batch")
    if running_when_joined == 0:
        problems.append("inconclusive: the first wave had finished before the second came")
    result.status, result.detail = ("FAIL", "; ".join(problems)) if problems else ("PASS", "")


# ---- GRPO steps ------------------------------------------------------------------------------------------------

def grpo_config(device: str, model_dir: Path, work: Path, name: str, trainer: dict[str, Any],
                extra: dict[str, Any] | None = None) -> Path:
    """A 2-step GRPO config of the say-"yes" task on `device` with this `trainer:` section (and `extra` sections)."""
    data = work / "say_yes.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n" for w in WORDS))
    cfg = {
        "policy": {"model_name": str(model_dir), "device": device, "max_model_len": 256,
                   "generation": {"max_new_tokens": 8, "temperature": 1.0, "stop_strings": ["yes"]}},
        "env": {"name": "string_match", "kwargs": {"mode": "similarity"}},
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 8, "max_num_steps": 2, "max_seq_len": 128,
                 "seed": 42, "save_period": 0},
        "optimizer": {"lr": 3.0e-3, "micro_batch_size": 16, "max_grad_norm": 1.0},
        "loss": {"kl_coef": 0.01},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
        "trainer": trainer,
        "output_dir": str(work / name),
        **(extra or {}),
    }
    path = work / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def check_grpo(device: str, model_dir: Path, work: Path, name: str, trainer: dict[str, Any], result: Result,
               precision: str = "fp32") -> None:
    """Two GRPO steps with this trainer section: finite metrics, an update, engine and trainer agree after the refit;
    NOT BUILT when the config refuses a setting whose feature is not built yet."""
    from nemo_rl_ext.config import ConfigError, load_config
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.loop import GRPO

    try:
        cfg = load_config(grpo_config(device, model_dir, work, name, trainer), [], GRPOConfig)
    except ConfigError as err:
        if "is not built yet" in str(err):
            result.status, result.detail = "NOT BUILT", str(err).strip()
            return
        raise
    start = time.perf_counter()
    with GRPO(cfg) as grpo:
        history = grpo.run()
    result.figures["seconds"] = round(time.perf_counter() - start, 2)
    last = history[-1]
    keys = ("rollout/reward/mean", "train/loss", "train/grad_norm", "train/importance_ratio/mean", "train/kl/mean",
            "timing/train_s", "timing/refit_s", "timing/step_s")
    result.figures.update({k: round(float(last[k]), 6) for k in keys if k in last})
    _peak_memory(device, result)
    problems = [f"{k} = {last[k]}" for k in keys if k in last and not math.isfinite(float(last[k]))]
    if len(history) != 2:
        problems.append(f"{len(history)} steps ran, 2 expected")
    if not last.get("train/optimizer_steps", 0) >= 1 or not last.get("train/grad_norm", 0) > 0:
        problems.append("no optimizer step (grad norm 0 or no step taken)")
    ratio = float(last.get("train/importance_ratio/mean", math.nan))
    if not abs(ratio - 1.0) <= RATIO_TOL[precision]:
        problems.append(f"engine and trainer disagree after the refit: importance ratio {ratio} (tolerance "
                        f"{RATIO_TOL[precision]})")
    result.status, result.detail = ("FAIL", "; ".join(problems)) if problems else ("PASS", "")


def check_fsdp(device: str, model_dir: Path, work: Path, result: Result) -> None:
    """FSDP2 at world size 1 (NCCL on CUDA): one rank of the distributed trainer, in this process (no Ray), against
    the in-process trainer on the same batch; NOT BUILT while the config refuses `trainer.workers > 1`."""
    from nemo_rl_ext.config import ConfigError, load_config
    from nemo_rl_ext.grpo.config import GRPOConfig

    try:
        cfg = load_config(grpo_config(device, model_dir, work, "fsdp2", {"workers": 2, "sharding": "fsdp2"}), [],
                          GRPOConfig)
    except ConfigError as err:
        if "is not built yet" in str(err):
            result.status, result.detail = "NOT BUILT", str(err).strip()
            return
        raise
    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.training.fsdp_workers import RankSpec
    from nemo_rl_ext.training.trainer import PolicyTrainer

    model, tokenizer = load_model_and_tokenizer(model_dir, device=device)
    items, advantages = _batch(tokenizer)
    loss = dataclasses.replace(cfg.loss.to_loss_config(), kl_coef=0.0)  # no reference model on either side
    pad = int(tokenizer.pad_token_id)
    optimizer = cfg.optimizer.model_copy(update={"minibatches_per_step": 1})
    reference = PolicyTrainer(model, optimizer=optimizer, loss=loss, temperature=1.0, pad_token_id=pad)
    expected_norm = reference.train_step(items, advantages)["grad_norm"]
    spec = RankSpec(model_path=str(model_dir), reference_path=None, dtype="float32", device=device,
                    optimizer=optimizer, loss=loss, temperature=1.0, pad_token_id=pad)
    want = reference.state_dict()
    norm, worst, backend, where = _rank_step(spec, items, advantages, want)
    result.figures.update({"backend": backend, "grad_norm": norm, "grad_norm_in_process": expected_norm,
                           "weights_max_diff_of_largest": f"{worst:.2e}", "shards_on": where})
    problems = []
    if not (norm is not None and math.isclose(norm, expected_norm, rel_tol=1e-4) and worst <= 1e-4):
        problems.append("the world-size-1 FSDP2 step differs from the in-process trainer's")
    if device.startswith("cuda"):  # trainer.cpu_offload: FSDP2's CPUOffloadPolicy (refused on the CPU)
        from nemo_rl_ext.training.fsdp_wrap import WrapSettings

        offload = dataclasses.replace(spec, wrap=WrapSettings(cpu_offload=True))
        off_norm, off_worst, _, off_where = _rank_step(offload, items, advantages, want)
        result.figures.update({"cpu_offload_grad_norm": off_norm, "cpu_offload_weights_max_diff": f"{off_worst:.2e}",
                               "cpu_offload_shards_on": off_where})
        if not (off_norm is not None and math.isclose(off_norm, expected_norm, rel_tol=1e-4) and off_worst <= 1e-4):
            problems.append("with cpu_offload the step differs from the in-process trainer's")
        if off_where != "cpu":  # offloaded: the shards and AdamW's state stay in CPU memory between steps
            problems.append(f"cpu_offload: the shards and the optimizer state are on {off_where}, not cpu")
    else:
        result.figures["cpu_offload"] = "needs CUDA"
    _peak_memory(device, result)
    result.status, result.detail = ("FAIL", "; ".join(problems)) if problems else ("PASS", "")


def check_teacher(device: str, model_dir: Path, work: Path, result: Result) -> None:
    """A local distillation teacher built from a GRPO config on the device: its logprobs equal a CPU float32 forward
    pass (scripts/gpu_check_teacher.py)."""
    distill = {"on_policy_distillation": {"enabled": True, "default_teacher_alias": str(model_dir)}}
    teacher_check(device, model_dir, grpo_config(device, model_dir, work, "teacher", {}, distill), result)
    _peak_memory(device, result)


def _rank_step(spec: Any, items: list[Any], advantages: torch.Tensor,
               want: dict[str, torch.Tensor]) -> tuple[float | None, float, str, str]:
    """One FSDP2 rank at world size 1 (in this process) takes one step: its grad norm, the largest weight difference
    from `want` (relative to each tensor's largest entry), the process group's backend, and the device types its
    parameter shards and AdamW state are on after the step (e.g. "cpu", or "cpu,cuda" if mixed)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from nemo_rl_ext.training.fsdp_workers import TrainerRank  # the rank a Ray actor hosts

    rank = TrainerRank(0, 1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    try:
        rank.setup("127.0.0.1", port, spec)
        backend = dist.get_backend()
        count = float(sum(float(x.loss_mask.sum()) for x in items))
        _, norm = rank.train_minibatch([(items, advantages, None, None)], count)
        held = [*rank.policy.parameters(), *(v for state in rank.optimizer.state.values()
                                             for k, v in state.items() if k != "step")]
        where = ",".join(sorted({(t.to_local() if isinstance(t, DTensor) else t).device.type for t in held}))
        got = rank.gather([name for name, *_ in rank.tensor_sizes()])
    finally:
        rank.shutdown()
    worst = max(float((got[k].to(want[k].device) - want[k]).abs().max() / (want[k].abs().max() + 1e-12))
                for k in got)
    return norm, worst, backend, where


def _batch(tokenizer: Any) -> tuple[list[Any], torch.Tensor]:
    """Four chat completions with advantages +-1 (the loss mask on the replies)."""
    from nemo_rl_ext.objectives.loss import CompletionTensors

    items = []
    for i, reply in enumerate(("yes", "no", "yes yes", "maybe")):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Say yes. {WORDS[i]}"}], tokenize=True,
                                               add_generation_prompt=True, return_dict=True)["input_ids"]
        answer = tokenizer(reply + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = torch.tensor(list(prompt) + list(answer))
        mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(answer))])
        items.append(CompletionTensors(token_ids=ids, loss_mask=mask, generation_logprobs=torch.zeros(len(ids))))
    return items, torch.tensor([1.0, -1.0, 1.0, -1.0])


# ---- the report --------------------------------------------------------------------------------------------------

def environment(device: str) -> dict[str, str]:
    """What ran the checks."""
    import transformers

    import nemo_rl_ext

    env = {"date (UTC)": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "host": platform.node(),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": device, "nemo_rl_ext": str(Path(nemo_rl_ext.__file__).parent)}
    for name in ("peft", "accelerate"):
        try:
            env[name] = __import__(name).__version__
        except ImportError:
            env[name] = "not installed"
    if device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = str(torch.version.cuda)
        env["gpu memory GiB"] = f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f}"
    return env


def write_report(path: Path, env: dict[str, str], results: list[Result], total_s: float,
                 pending: list[str] | None = None) -> None:
    """The markdown report: what ran, one table row per check, then each failure's detail; `pending`: the checks
    not finished yet (the first is running)."""
    lines = ["# GPU check report", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [f"- blocked (absent on the GPU image): {', '.join(ABSENT_ON_THE_IMAGE)}",
              f"- total seconds: {total_s:.1f}", ""]
    if pending:
        lines += [f"- INCOMPLETE: still running {pending[0]!r} when this was written; not run: {pending[1:]}", ""]
    lines += ["| check | result | figures |", "| --- | --- | --- |"]
    for r in results:
        figures = ", ".join(f"{k}={v}" for k, v in r.figures.items())
        lines.append(f"| {r.name} | {r.status} | {figures} |")
    for r in results:
        if r.section:
            lines += ["", f"## {r.name}", "", r.section.rstrip()]
    for r in results:
        if r.detail:
            lines += ["", f"## {r.name}: {r.status}", "", "```", r.detail.rstrip(), "```"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def bench_seconds(start: float) -> float:
    """The learning bench's time: what is left before gpu_check.sh's deadline (GPU_CHECK_DEADLINE_S, less a margin
    for the report), at most LEARNING_BENCH_MAX_S."""
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE_S", "inf"))
    return min(LEARNING_BENCH_MAX_S, deadline - (time.perf_counter() - start) - 20.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="torch device (default cuda; cpu runs the same logic)")
    parser.add_argument("--report", type=Path, help="report file (default $OUT/gpu_report.md, else ./gpu_report.md)")
    args = parser.parse_args(argv)
    report = args.report or Path(os.environ.get("OUT") or ".") / "gpu_report.md"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        message = "--device cuda but torch sees no CUDA device (use --device cpu to check the logic)"
        write_report(report, environment("cpu"), [Result("CUDA device", "FAIL", detail=message)], 0.0)
        print(f"error: {message}", file=sys.stderr)
        return 2
    import transformers

    transformers.utils.logging.disable_progress_bar()  # per-load weight bars would bury the check lines
    torch.set_num_threads(1)  # engines on the CPU use one thread; on a GPU the host thread only launches kernels
    torch.manual_seed(0)
    start = time.perf_counter()
    imports = run_check("imports: " + ", ".join(NEEDED_MODULES), check_imports)
    if imports.status != "PASS":
        write_report(report, environment(args.device), [imports], time.perf_counter() - start)
        return 1
    from nemo_rl_ext.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(work / "tiny", seed=0, initializer_range=0.05)
        dev = args.device
        checks: list[tuple[str, Callable[[Result], None]]] = [
            ("engine: continuous batching, logprobs = forward", lambda r: check_engine(dev, model_dir, r)),
            ("grpo: 2 steps, fp32", lambda r: check_grpo(dev, model_dir, work, "fp32", {}, r)),
            ("grpo: trainer.mixed_precision bf16",
             lambda r: check_grpo(dev, model_dir, work, "bf16", {"mixed_precision": "bf16"}, r, precision="bf16")),
            ("grpo: trainer.activation_checkpointing",
             lambda r: check_grpo(dev, model_dir, work, "ac", {"activation_checkpointing": True}, r)),
            ("grpo: trainer.lora (r 8 on q_proj, v_proj)",
             lambda r: check_grpo(dev, model_dir, work, "lora",
                                  {"lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}}, r)),
            ("trainer.workers: FSDP2 rank at world size 1 (and trainer.cpu_offload on CUDA)",
             lambda r: check_fsdp(dev, model_dir, work, r)),
            ("teacher: a local distillation teacher on the device, logprobs = CPU fp32 forward",
             lambda r: check_teacher(dev, model_dir, work, r)),
            ("learning bench: bench/learning.py --device " + dev.split(":")[0],
             lambda r: check_learning(dev, model_dir, work, r, bench_seconds(start))),
        ]
        env, results = environment(args.device), [imports]
        for number, (name, fn) in enumerate(checks):
            pending = [n for n, _ in checks[number:]]  # a report after each check: a deadline leaves one too
            write_report(report, env, results, time.perf_counter() - start, pending=pending)
            results.append(run_check(name, fn))
    write_report(report, env, results, time.perf_counter() - start)
    print(f"[gpu_check] report: {report}")
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
