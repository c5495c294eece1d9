"""The nemo_gym eval mode end to end: the shipped nemo_gym_eval.yaml against real NeMo Gym 0.7.0 servers
(simple_agent graded by Gym's equivalence_rule server), with a policy whose samples answer by a known
per-sample pattern, so that pass@k, maj@k and mean reward per agent are known exactly."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest

from nemo_rl_ext.config import load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.testing import ScriptedGeneration, ScriptedRequest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gym, pytest.mark.timeout(900)]


# The answers each prompt's samples give, by the order the policy sees its calls ("R": the right answer).
# The metrics only depend on each prompt's multiset of answers, so the order of concurrent calls is moot.
PATTERN = {
    "What is 21 + 10?": ["R", "7", "7", "8"],  # row 0, agent_alpha (4 samples): 1 right, "7" twice
    "What is 42 - 26?": ["R", "7"],  # row 1, agent_beta (2 samples): 1 right
    "What is 2 * 3?": ["R", "R", "7", "7"],  # row 2, agent_alpha: 2 right, tied with "7"
    "What is 35 + 7?": ["R", "R"],  # row 3, agent_beta: both right
    "What is 38 - 24?": ["1", "2", "3", "4"],  # row 4, agent_alpha: none right, all different
    "What is 2 * 10?": ["9", "9"],  # row 5, agent_beta: none right
}


class ArithmeticPolicy(ScriptedGeneration):
    """Answers "What is a <op> b?" by PATTERN: the j-th call for a question gives its j-th answer."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, self._answer, max_model_len=2048)
        self.seen: dict[str, int] = {}

    def _answer(self, request: ScriptedRequest) -> str:
        a, op, b = re.findall(r"What is (\d+) ([-+*]) (\d+)\?", request.prompt_text)[-1]
        question = f"What is {a} {op} {b}?"
        j = self.seen.get(question, 0)
        self.seen[question] = j + 1
        right = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        answer = PATTERN[question][j]
        text = str(right) if answer == "R" else answer
        return f"{text}<|im_end|>"


def test_nemo_gym_eval_with_per_agent_counts(gym_venv, tiny_model_and_tokenizer, tmp_path):
    _, tokenizer = tiny_model_and_tokenizer
    cfg = load_config(
        REPO / "examples" / "configs" / "evals" / "nemo_gym_eval.yaml",
        [
            f"eval.save_path={tmp_path / 'eval'}",
            f"eval.dataset_path={REPO / 'examples' / 'data' / 'gym_arithmetic.jsonl'}",
            "eval.num_prompts=6",
            "rollouts.num_generations_per_prompt={agent_alpha: 4, _default: 2}",
            "eval.ks=[1,2,3,4]",  # 3 and 4 are more than agent_beta's 2 samples
            f"rollouts.gym.launch.gym_venv={gym_venv}",
            f"rollouts.gym.launch.config_paths=[{REPO / 'examples' / 'configs' / 'gym' / 'arithmetic_agents.yaml'}]",
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
        pattern = PATTERN[rows[idx]["question"]]
        assert len(samples) == len(pattern) == (4 if agent == "agent_alpha" else 2)
        # Gym's equivalence_rule server gave the reward: 1 exactly for the samples that answered right
        assert sorted(s["reward"] for s in samples) == sorted(1.0 if a == "R" else 0.0 for a in pattern)
        right = rows[idx]["expected_answer"]
        assert sorted(s["answer"] for s in samples) == sorted(right if a == "R" else a for a in pattern)
        assert {s["agent"] for s in samples} == {agent}
    assert policy.num_calls == len(lines) == 18

    # Worked by hand per prompt (n samples, c right): pass@k = 1 - C(n-c, k) / C(n, k); maj@k = the mean
    # over all k-subsets of the majority answer's correctness, a tie of t answers giving 1/t each.
    #   row 0 [R,7,7,8]  pass@1..4 = 1/4, 1/2, 3/4, 1   maj@1..4 = 1/4, 1/4 (3 R-ties of 6), 1/6 (2 3-way
    #                    ties of 4), 0 ("7" wins)
    #   row 2 [R,R,7,7]  pass@1..4 = 1/2, 5/6, 1, 1     maj@1..4 = 1/2, 1/2, 1/2, 1/2 (tie)
    #   row 4 [1,2,3,4]  all 0
    #   row 1 [R,7]      pass@1,2 = 1/2, 1              maj@1,2 = 1/2, 1/2 (tie)
    #   row 3 [R,R]      1, 1                           1, 1
    #   row 5 [9,9]      0, 0                           0, 0
    # Metrics average over the prompts with at least k samples (agent_beta's stop at k = 2).
    expected = {
        "agent/agent_alpha/pass@1": 1 / 4, "agent/agent_alpha/maj@1": 1 / 4,
        "agent/agent_alpha/pass@2": 4 / 9, "agent/agent_alpha/maj@2": 1 / 4,
        "agent/agent_alpha/pass@3": 7 / 12, "agent/agent_alpha/maj@3": 2 / 9,
        "agent/agent_alpha/pass@4": 2 / 3, "agent/agent_alpha/maj@4": 1 / 6,
        "agent/agent_beta/pass@1": 1 / 2, "agent/agent_beta/maj@1": 1 / 2,
        "agent/agent_beta/pass@2": 2 / 3, "agent/agent_beta/maj@2": 1 / 2,
        "pass@1": 3 / 8, "maj@1": 3 / 8, "mean_reward": 3 / 8,
        "pass@2": 5 / 9, "maj@2": 3 / 8,
        "pass@3": 7 / 12, "maj@3": 2 / 9,  # agent_alpha's prompts only
        "pass@4": 2 / 3, "maj@4": 1 / 6,
        "num_prompts@2": 6, "num_prompts@3": 3, "num_prompts@4": 3,
        "agent/agent_beta/num_prompts@3": 0, "agent/agent_beta/num_prompts@4": 0,
    }
    metrics = result.summary["metrics"]
    assert {key: metrics.get(key) for key in expected} == pytest.approx(expected, abs=1e-12)
    for k in (3, 4):
        assert f"agent/agent_beta/pass@{k}" not in metrics and f"agent/agent_beta/maj@{k}" not in metrics
    assert (tmp_path / "eval" / "pass_at_k.png").exists() and (tmp_path / "eval" / "report.md").exists()
