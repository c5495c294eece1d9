"""gpu_check's "teacher" check: a local on-policy distillation teacher, built as a GRPO run builds it
(`grpo.build.teacher_scorer` with `trainer.workers: 1`: in the rollout process, on `policy.device`), has its weights on
the device in float32, scores every assistant turn of a three-turn tool rollout (two calculator tool turns between
them, two completions), and its logprobs equal a float32 forward pass of the same model on the CPU. A few seconds.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import torch

TEACHER_RTOL, TEACHER_ATOL = 1e-4, 1e-4
"""A teacher's logprobs on the device against a float32 forward pass on the CPU: tests/tolerances.py's
ENGINE_LOGPROBS, which gpu_check's engine check uses too (ENGINE_RTOL, ENGINE_ATOL). Both sides run the same float32
math in other kernels (cuBLAS's blocking and reduction order, CUDA's attention kernels; torch keeps TF32 off for
float32 matmuls unless asked), so they differ by rounding only, a few ulps of each reduction's terms: 9.5e-7 on the
tiny model CPU against CPU, and the engine check measured 1.4e-6 between two paths on an H100. A bug moves a
logprob by 1e-2 and up: a wrong token or position, a stale weight, bf16 weights or compute (8 mantissa bits;
measured here: 9.9e-3 with bf16 weights, 1.1e-2 with bf16 autocast), TF32 turned on (10 bits)."""
TEACHER_TURNS = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+5"}}\n</tool_call><|im_end|>',
    "So the answer is \\boxed{17}.<|im_end|>",
)
"""The record's scripted assistant turns (the tests' tool rollout, tests/teacher_checks.py)."""
ASSISTANT_TURNS = 6
"""Assistant turns the record has: two completions of three."""


def teacher_check(device: str, model_dir: Path, config: Path, result: Any) -> None:
    """The check on `device` with the GRPO config file `config` (distilling from `model_dir`, the tiny model);
    `result` gets the figures, PASS or FAIL and why."""
    from nemo_rl_ext.config import load_config
    from nemo_rl_ext.grpo.build import teacher_scorer
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.models.loading import load_model_and_tokenizer

    cfg = load_config(config, [], GRPOConfig)
    cpu_model, tokenizer = load_model_and_tokenizer(model_dir)  # the reference: float32 on the CPU
    scorer = teacher_scorer(cfg, trainer=None)
    try:
        params = scorer.teacher_for("calc").model.parameters()
        where = sorted({f"{p.device.type}/{str(p.dtype).removeprefix('torch.')}" for p in params})
    except BaseException:
        scorer.close()
        raise
    record = asyncio.run(_teacher_rollout(tokenizer, scorer))  # closes the scorer
    worst_abs, worst_excess, turns, tokens = _compare(record, cpu_model)
    assistant = sum(m.role == "assistant" for c in record.completions for m in c.message_log)
    result.figures.update({"teacher_on": ",".join(where), "completions": len(record.completions),
                           "assistant_turns_scored": f"{turns}/{assistant}", "scored_tokens": tokens,
                           "teacher_s": round(record.rollout_metrics.get("distill/teacher_time_s", math.nan), 3),
                           "logprob_max_abs_diff_vs_cpu_fp32": f"{worst_abs:.2e}",
                           "tolerance": f"rtol {TEACHER_RTOL} + atol {TEACHER_ATOL}"})
    problems = []
    if where != [f"{torch.device(device).type}/float32"]:
        problems.append(f"the teacher's weights are on {where}, not {device} in float32")
    if turns != assistant or assistant != ASSISTANT_TURNS:
        problems.append(f"{turns} of {assistant} assistant turns scored ({ASSISTANT_TURNS} expected, every one "
                        f"scored; stop reasons {[c.stop_reason.value for c in record.completions]})")
    if worst_excess > 0:
        problems.append(f"teacher logprobs differ from the CPU float32 forward pass by up to {worst_abs:.2e}")
    result.status, result.detail = ("FAIL", "; ".join(problems)) if problems else ("PASS", "")


def _compare(record: Any, cpu_model: Any) -> tuple[float, float, int, int]:
    """Each scored assistant message's teacher logprobs against `cpu_model`'s forward pass over the same ids: the
    largest difference, the largest excess over the tolerance (> 0: outside), the messages and tokens compared."""
    from nemo_rl_ext.testing import forward_logprobs

    worst_abs, worst_excess, turns, tokens = 0.0, -math.inf, 0, 0
    for c in record.completions:
        context: list[int] = []
        for m in c.message_log:
            if m.role == "assistant" and m.teacher_logprobs is not None:
                want = forward_logprobs(cpu_model, context, m.token_ids, 1.0).double()
                diff = (torch.tensor(m.teacher_logprobs, dtype=torch.float64) - want).abs()
                worst_abs = max(worst_abs, float(diff.max()))
                worst_excess = max(worst_excess, float((diff - TEACHER_ATOL - TEACHER_RTOL * want.abs()).max()))
                turns, tokens = turns + 1, tokens + len(m.token_ids)
            context += m.token_ids
    return worst_abs, worst_excess, turns, tokens


async def _teacher_rollout(tokenizer: Any, scorer: Any) -> Any:
    """Two completions of the scripted three-turn calculator rollout, scored by `scorer` (closed after)."""
    from nemo_rl_ext.data.datasets import datum_from_messages
    from nemo_rl_ext.environments.tool_env import ToolCalculatorEnvironment
    from nemo_rl_ext.experience.rollout_manager import RolloutManager
    from nemo_rl_ext.models.generation.interfaces import GenerationConfig
    from nemo_rl_ext.testing import ScriptedGeneration

    manager = RolloutManager(
        tokenizer=tokenizer, task_to_env={"calc": ToolCalculatorEnvironment()}, num_generations_per_prompt=2,
        max_seq_len=1024, policy_generation=ScriptedGeneration(tokenizer, TEACHER_TURNS),
        generation_config=GenerationConfig(max_new_tokens=64, seed=0), teachers=scorer,
    )
    datum = datum_from_messages(tokenizer, 0, [{"role": "user", "content": "What is 3*4 + 5?"}], task_name="calc",
                                extra_env_info={"ground_truth": "17"})
    try:
        return await asyncio.wait_for(manager.run_rollout(datum), timeout=60)
    finally:
        await manager.shutdown()
