"""Real NeMo Gym 0.7.0 in its completions mode: the shipped nemo_gym eval on Gym's own MCQA config, once with
Gym's vllm_model calling our `/v1/chat/completions` (the default) and once, with the launcher's `policy_model`
block set to `use_completions_api: true, render_chat_template: true, tokenizer: <the policy's folder>`, calling
our `/v1/completions` with the messages rendered by Gym. The rows are three of Gym's MCQA examples, the last made
multi-turn (system, user, assistant, user: what raw completions mode refuses and the chat template renders). A
scripted policy answers by a per-row pattern, so both modes must earn the same known rewards, and every model
call must come back with its token ids and logprobs."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from nemo_rl_ext.config import load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.gym.config import gym_site_packages
from nemo_rl_ext.serving.policy_server import PolicyService
from nemo_rl_ext.testing import ScriptedGeneration, ScriptedRequest

REPO = Path(__file__).resolve().parents[2]
CONFIG = "resources_servers/mcqa/configs/mcqa.yaml"
DATA = "resources_servers/mcqa/data/example.jsonl"
PATTERN = [["R", "W"], ["N", "R"], ["R", "R"]]
"""Per row, its two samples' answers: "R" the right letter, "W" a wrong one, "N" no \\boxed{} (reward 0)."""
pytestmark = [pytest.mark.gym, pytest.mark.timeout(900)]


class MCQAPolicy(ScriptedGeneration):
    """Answers row i's j-th call by PATTERN[i][j]; finds the row by the end of its question in the prompt."""

    def __init__(self, tokenizer, questions: list[str], answers: list[str]) -> None:
        super().__init__(tokenizer, self._answer, max_model_len=4096)
        self.questions, self.answers = questions, answers
        self.seen: dict[int, int] = {}

    def _answer(self, request: ScriptedRequest) -> str:
        (row,) = [i for i, q in enumerate(self.questions) if q[-200:] in request.prompt_text]
        j = self.seen.get(row, 0)
        self.seen[row] = j + 1
        right = self.answers[row]
        return {"R": f"\\boxed{{{right}}}", "W": f"\\boxed{{{'A' if right != 'A' else 'B'}}}",
                "N": f"I think it is {right}"}[PATTERN[row][j]] + "<|im_end|>"


def _rows(gym_venv: Path) -> list[dict]:
    site = gym_site_packages(gym_venv)
    assert site is not None
    shipped = [orjson.loads(x) for x in (site / DATA).read_bytes().splitlines()][:3]
    question = shipped[2]["responses_create_params"]["input"][0]["content"]
    shipped[2]["responses_create_params"]["input"] = [
        {"role": "system", "content": "You are a careful expert."},
        {"role": "user", "content": "I will ask you a question."},
        {"role": "assistant", "content": "Go ahead."},
        {"role": "user", "content": question},
    ]
    return shipped


def test_gym_completions_mode_earns_the_chat_modes_rewards_with_ids_and_logprobs(
    gym_venv, tiny_model_dir, tiny_model_and_tokenizer, tmp_path, monkeypatch
):
    _, tokenizer = tiny_model_and_tokenizer
    rows = _rows(gym_venv)
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    questions = [r["responses_create_params"]["input"][-1]["content"] for r in rows]
    answers = [r["expected_answer"] for r in rows]
    text_completions: list[tuple[dict, dict]] = []
    original = PolicyService.text_completion

    async def spy(self, body, received_at=None):  # which route Gym called, what it sent and got back
        answer = await original(self, body, received_at)
        text_completions.append((body, answer))
        return answer

    monkeypatch.setattr(PolicyService, "text_completion", spy)
    rewards, records = {}, {}
    for mode, policy_model in (
        ("chat", "{}"),
        ("completions", f"{{use_completions_api: true, render_chat_template: true, tokenizer: '{tiny_model_dir}'}}"),
    ):
        cfg = load_config(REPO / "examples" / "configs" / "evals" / "nemo_gym_eval.yaml", [
            f"eval.save_path={tmp_path / mode}", f"eval.dataset_path={data}", "rollouts.num_generations_per_prompt=2",
            "eval.ks=[1]", "eval.save_token_ids=true", f"rollouts.gym.launch.gym_venv={gym_venv}",
            f"rollouts.gym.launch.config_paths=[{CONFIG}]", f"rollouts.gym.launch.policy_model={policy_model}",
            "rollouts.gym.agent_name=mcqa_simple_agent",
        ], EvalConfig)
        policy = MCQAPolicy(tokenizer, questions, answers)
        calls_before = len(text_completions)
        result = run_eval(cfg, generation=policy, progress=False)
        assert result.complete and result.summary["status"] == "ok", mode
        assert policy.seen == {0: 2, 1: 2, 2: 2}, mode
        assert len(text_completions) - calls_before == (6 if mode == "completions" else 0)
        lines = [orjson.loads(x) for x in (tmp_path / mode / "completions.jsonl").read_bytes().splitlines()]
        rewards[mode] = {i: sorted(x["reward"] for x in lines if x["prompt_idx"] == i) for i in range(3)}
        records[mode] = lines
    expected = {i: sorted(1.0 if a == "R" else 0.0 for a in pattern) for i, pattern in enumerate(PATTERN)}
    assert rewards["completions"] == rewards["chat"] == expected

    # what Gym sent to /v1/completions: its rendered chat prompt, asking for ids and the sampled token's logprob;
    # what it got back: the ids and logprobs of the one choice
    for body, answer in text_completions:
        assert isinstance(body["prompt"], str) and body["prompt"].endswith("<|im_start|>assistant\n")
        assert body["logprobs"] == 0 and body["return_token_ids"] and body["return_tokens_as_token_ids"]
        (choice,) = answer["choices"]
        assert choice["logprobs"]["token_logprobs"] == choice["generation_log_probs"]
        assert choice["token_ids"] == choice["generation_token_ids"] and choice["prompt_token_ids"]
    assert sum("<|im_start|>assistant\nGo ahead.<|im_end|>" in b["prompt"] for b, _ in text_completions) == 2
    # every model call reached the records with its ids and logprobs (a Gym output item becomes an assistant
    # message only when it carries prompt ids, generation ids and as many logprobs), in both modes
    generated = sorted(tuple(a["choices"][0]["generation_token_ids"]) for _, a in text_completions)
    for mode in ("chat", "completions"):
        assistant = [[m for m in line["message_log"] if m["role"] == "assistant"] for line in records[mode]]
        assert all(len(a) == 1 and a[0]["num_tokens"] > 0 for a in assistant), mode
        if mode == "completions":
            assert sorted(tuple(a[0]["token_ids"]) for a in assistant) == generated
    # Gym rendered the messages with the same chat template our chat route uses: the same prompt ids
    prompts = {mode: sorted(tuple(m["token_ids"]) for line in records[mode] for m in line["message_log"]
                            if m["role"] != "assistant") for mode in records}
    assert prompts["completions"] == prompts["chat"]
