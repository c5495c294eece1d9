"""The nemo_gym eval on a NeMo Gym resources server as it ships: Gym's own MCQA config
(`resources_servers/mcqa/configs/mcqa.yaml`, which calls a `policy_model` it does not define) and its own
`data/example.jsonl` (rows without agent_ref), both read from the Gym install unchanged. MCQA grades by
rule (the letter in the last \\boxed{...} against `expected_answer`), so a scripted policy that answers
some samples right, some wrong and some without a box earns rewards known in advance."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import pytest

from nemo_rl_ext.config import load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.gym.config import gym_site_packages
from nemo_rl_ext.testing import ScriptedGeneration, ScriptedRequest

REPO = Path(__file__).resolve().parents[2]
CONFIG = "resources_servers/mcqa/configs/mcqa.yaml"
DATA = "resources_servers/mcqa/data/example.jsonl"
pytestmark = [pytest.mark.gym, pytest.mark.timeout(900)]

# Per example row (in file order), the answer of its 1st and 2nd call: "R" the right letter, "W" a wrong
# letter, "N" no \boxed{} at all (MCQA finds no answer: reward 0).
PATTERN = [["R", "R"], ["W", "W"], ["R", "W"], ["N", "R"], ["R", "R"]]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class MCQAPolicy(ScriptedGeneration):
    """Answers each shipped MCQA question by PATTERN: the j-th call for a row gives its j-th answer."""

    def __init__(self, tokenizer, rows: list[dict]) -> None:
        super().__init__(tokenizer, self._answer, max_model_len=8192)
        self.rows = rows
        self.seen: dict[int, int] = {}

    def _answer(self, request: ScriptedRequest) -> str:
        prompt = request.prompt_text
        (row,) = [i for i, r in enumerate(self.rows) if r["responses_create_params"]["input"][0]["content"][-200:]
                  in prompt]
        j = self.seen.get(row, 0)
        self.seen[row] = j + 1
        right = self.rows[row]["expected_answer"]
        answer = {"R": f"\\boxed{{{right}}}", "W": f"\\boxed{{{'A' if right != 'A' else 'B'}}}",
                  "N": f"I think it is {right}"}[PATTERN[row][j]]
        return f"{answer}<|im_end|>"


def test_eval_on_gym_mcqa_config_and_example_data_as_shipped(gym_venv, tiny_model_and_tokenizer, tmp_path,
                                                              monkeypatch):
    _, tokenizer = tiny_model_and_tokenizer
    site = gym_site_packages(gym_venv)
    shipped_config, shipped_data = site / CONFIG, site / DATA
    before = (_sha(shipped_config), _sha(shipped_data))
    rows = [orjson.loads(line) for line in shipped_data.read_bytes().splitlines()]
    assert len(rows) == len(PATTERN) and not any("agent_ref" in r for r in rows)  # as Gym ships them
    monkeypatch.chdir(tmp_path)  # relative paths: not found here, so looked up in the Gym install
    cfg = load_config(
        REPO / "examples" / "configs" / "evals" / "nemo_gym_eval.yaml",
        [
            f"eval.save_path={tmp_path / 'eval'}",
            f"eval.dataset_path={DATA}",
            "rollouts.num_generations_per_prompt=2",
            "eval.ks=[1,2]",
            f"rollouts.gym.launch.gym_venv={gym_venv}",
            f"rollouts.gym.launch.config_paths=[{CONFIG}]",
            "rollouts.gym.agent_name=mcqa_simple_agent",
        ],
        EvalConfig,
    )
    policy = MCQAPolicy(tokenizer, rows)
    result = run_eval(cfg, generation=policy, progress=False)

    assert result.complete and result.summary["status"] == "ok"
    assert (_sha(shipped_config), _sha(shipped_data)) == before  # used unchanged
    assert policy.seen == dict.fromkeys(range(5), 2)
    lines = [orjson.loads(x) for x in (tmp_path / "eval" / "completions.jsonl").read_bytes().splitlines()]
    by_prompt: dict[int, list[float]] = {}
    for line in lines:
        assert line["agent"] == "mcqa_simple_agent"
        by_prompt.setdefault(line["prompt_idx"], []).append(line["reward"])
    # MCQA's own verify gave these rewards: 1 exactly for a boxed right letter
    assert {i: sorted(r) for i, r in by_prompt.items()} == {
        i: sorted(1.0 if a == "R" else 0.0 for a in pattern) for i, pattern in enumerate(PATTERN)
    }
    metrics = result.summary["metrics"]
    assert metrics["mean_reward"] == pytest.approx(0.6)
    assert metrics["pass@1"] == pytest.approx(0.6) and metrics["pass@2"] == pytest.approx(0.8)

    # the rows sent, materialized before sending: every example row twice, with Gym's indices
    sent = [orjson.loads(x) for x in (tmp_path / "eval" / "gym_rows.jsonl").read_bytes().splitlines()]
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in sent] == [(t, s) for t in range(5) for s in (0, 1)]
    assert all(r["agent_ref"] == {"name": "mcqa_simple_agent"} for r in sent)
    assert [r["expected_answer"] for r in sent[::2]] == [r["expected_answer"] for r in rows]

    # Gym's own /aggregate_metrics over these results, in the summary and the report
    gym = result.summary["gym_metrics"]["mcqa_simple_agent"]
    assert "error" not in gym
    assert gym["agent_metrics"]["mean/reward"] == pytest.approx(0.6)
    assert gym["key_metrics"]["mean/reward"] == pytest.approx(0.6)
    summary_file = orjson.loads((tmp_path / "eval" / "summary.json").read_bytes())
    assert summary_file["gym_metrics"] == result.summary["gym_metrics"]
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "NeMo Gym's aggregate metrics" in report and "`mcqa_simple_agent`: mean/reward: 0.6" in report
