"""The nemo_gym eval mode end to end: the shipped nemo_gym_eval.yaml against real NeMo Gym 0.7.0 servers
(simple_agent graded by Gym's equivalence_rule server), with a policy that answers by a known rule so the
metrics are predictable."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from nemo_rl_ext.config import load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.models.generation import (
    FinishReason,
    GenerationConfig,
    GenerationInterface,
    GenerationOutput,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gym, pytest.mark.timeout(900)]


class ArithmeticPolicy(GenerationInterface):
    """Answers "What is a + b?" correctly when the question contains "+", else with a wrong number."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls = 0

    max_model_len = 2048
    tokenizer = None  # set per instance

    def update_weights(self, state_dict) -> None:
        raise NotImplementedError("a rule-based policy has no weights to update")

    async def generate_async(self, prompt_token_ids, config: GenerationConfig) -> GenerationOutput:
        self.calls += 1
        question = re.findall(r"What is (\d+) ([-+*]) (\d+)\?", self.tokenizer.decode(prompt_token_ids))[-1]
        a, op, b = int(question[0]), question[1], int(question[2])
        answer = a + b if op == "+" else -1
        ids = self.tokenizer(f"{answer}<|im_end|>", add_special_tokens=False)["input_ids"]
        return GenerationOutput(tuple(ids), tuple(-0.5 for _ in ids), FinishReason.EOS)

    def shutdown(self) -> None:
        pass


def test_nemo_gym_eval_with_per_agent_counts(gym_venv, tiny_model_and_tokenizer, tmp_path):
    _, tokenizer = tiny_model_and_tokenizer
    cfg = load_config(
        REPO / "examples" / "configs" / "evals" / "nemo_gym_eval.yaml",
        [
            f"eval.save_path={tmp_path / 'eval'}",
            f"eval.dataset_path={REPO / 'examples' / 'data' / 'gym_arithmetic.jsonl'}",
            "eval.num_prompts=6",
            "eval.num_tests_per_prompt={agent_alpha: 3, _default: 1}",
            "eval.ks=[1,2,3]",
            f"gym.launch.gym_venv={gym_venv}",
            f"gym.launch.config_paths=[{REPO / 'examples' / 'configs' / 'gym' / 'arithmetic_agents.yaml'}]",
        ],
        EvalConfig,
    )
    policy = ArithmeticPolicy(tokenizer)
    result = run_eval(cfg, generation=policy, progress=False)

    assert result.complete
    lines = [orjson.loads(line) for line in (tmp_path / "eval" / "completions.jsonl").read_bytes().splitlines()]
    rows = [orjson.loads(line) for line in (REPO / "examples/data/gym_arithmetic.jsonl").read_bytes().splitlines()]
    by_prompt: dict[int, list[dict]] = {}
    for line in lines:
        by_prompt.setdefault(line["prompt_idx"], []).append(line)
    assert sorted(by_prompt) == list(range(6))
    for idx, samples in by_prompt.items():
        agent = rows[idx]["agent_ref"]["name"]
        assert len(samples) == (3 if agent == "agent_alpha" else 1)
        # Gym's equivalence_rule server gave the reward: 1 exactly when our policy answered right
        expected = 1.0 if "+" in rows[idx]["question"] else 0.0
        assert {s["reward"] for s in samples} == {expected}, (rows[idx]["question"], samples)
        assert {s["agent"] for s in samples} == {agent}
    assert policy.calls == len(lines)
    plus = [i for i in range(6) if "+" in rows[i]["question"]]
    metrics = result.summary["metrics"]
    assert metrics["pass@1"] == pytest.approx(len(plus) / 6)
    assert metrics["num_prompts@3"] == sum(rows[i]["agent_ref"]["name"] == "agent_alpha" for i in range(6))
    assert "agent/agent_alpha/pass@3" in metrics and "agent/agent_beta/pass@3" not in metrics
    assert (tmp_path / "eval" / "pass_at_k.png").exists() and (tmp_path / "eval" / "report.md").exists()
