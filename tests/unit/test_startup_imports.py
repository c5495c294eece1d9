"""What a CLI imports to check a config or print `--help`: neither transformers, torch nor httpx (seconds of
start-up; the eval's config reaches the environments, whose row adapters only annotate with a tokenizer type).
What a CLI phase imports at start-up: the modules behind the GRPO loop, its checkpoints and export, the eval and
the environments load neither peft (only a LoRA model needs it) nor math-verify (only math grading needs it).
Each is half a second or so of every process start (the learning bench starts seven), and users start these CLIs
too."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MODULES = ("nemo_rl_ext.grpo.loop", "nemo_rl_ext.training.export", "nemo_rl_ext.training.checkpoint",
           "nemo_rl_ext.training.trainer", "nemo_rl_ext.training.lora", "nemo_rl_ext.evals.driver",
           "nemo_rl_ext.environments")
"""What `run_grpo.py`, `run_grpo.py export` and `run_eval.py` import to run (a full fine-tuning run, a string_match
eval)."""
DEFERRED = ("peft", "math_verify", "latex2sympy2_extended")
"""Heavy modules those imports must leave for first use."""


CONFIG_MODULES = ("nemo_rl_ext.evals.config", "nemo_rl_ext.grpo.config", "nemo_rl_ext.gym.errors",
                  "nemo_rl_ext.config", "nemo_rl_ext.plugins")
"""What `run_eval.py` and `run_grpo.py` import before they load a model (`--help`, config errors)."""


def _left_out(modules: tuple[str, ...], heavy: tuple[str, ...]) -> list[str]:
    """Which of `heavy` a new interpreter has imported after importing `modules`."""
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.timeout(120)
def test_a_config_check_imports_no_model_library() -> None:
    assert _left_out(CONFIG_MODULES, ("transformers", "torch", "httpx")) == []


@pytest.mark.timeout(120)
def test_the_phases_modules_defer_peft_and_math_verify() -> None:
    assert _left_out(MODULES, DEFERRED) == []


def test_math_grading_and_lora_still_load_them_when_used() -> None:
    from nemo_rl_ext.environments.math_grading import grade_answer, math_vote_key

    assert grade_answer("The answer is \\boxed{\\frac{1}{2}}", "0.5").reward == 1.0
    assert math_vote_key("\\frac{1}{2}") == "1/2" and "math_verify" in sys.modules
