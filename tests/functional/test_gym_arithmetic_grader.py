"""The project's own NeMo Gym resources server, arithmetic_grader (nemo_rl_ext/gym/servers): started by the
project's launcher from the shipped config (examples/configs/gym/arithmetic_grader.yaml) in real NeMo Gym 0.7.0
on 127.0.0.1, found without NEMO_GYM_EXTRA_ROOTS and from a working directory that does not hold it; its /verify
grades the number an answer gives (reward) and whether the whole answer is the number (strict), and refuses a
row whose expected answer is no number."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from nemo_rl_ext.gym.config import GymLaunchConfig
from nemo_rl_ext.gym.launcher import GymLauncher

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "configs" / "gym" / "arithmetic_grader.yaml"
SERVER = "arithmetic_grading"
pytestmark = [pytest.mark.gym, pytest.mark.timeout(240)]


def verify_body(answer: str, expected: str) -> dict:
    """What a simple_agent POSTs to /verify: the row (with expected_answer) and the model's response."""
    return {
        "responses_create_params": {"input": [{"role": "user", "content": "What is 12 - 44?"}]},
        "expected_answer": expected,
        "response": {
            "id": "resp_1", "created_at": 0.0, "model": "policy", "object": "response", "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [],
            "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": answer, "annotations": []}]}],
        },
    }


def test_the_shipped_grader_reads_the_number_and_the_strict_answer(gym_venv, tmp_path, monkeypatch):
    monkeypatch.delenv("NEMO_GYM_EXTRA_ROOTS", raising=False)
    monkeypatch.chdir(tmp_path)  # not the repo: the launcher finds the project's server itself
    config = tmp_path / "grader.yaml"  # the shipped config's resources server alone (no agents, no model server)
    config.write_text(yaml.safe_dump({SERVER: yaml.safe_load(CONFIG.read_text())[SERVER]}))
    gym = GymLauncher(GymLaunchConfig(gym_venv=gym_venv, config_paths=(config,), work_dir=tmp_path / "work",
                                      startup_timeout_s=120),
                      policy_base_url="http://127.0.0.1:9/v1", policy_model_name="unused")
    try:
        assert gym.start() == {}
        url = gym.servers[SERVER].url
        assert url.startswith("http://127.0.0.1:")
        cases = {"-32": (1.0, 1.0, "-32"), "The answer is -32.": (1.0, 0.0, "-32"), "12 - 44 = -31": (0.0, 0.0, "-31"),
                 "To find 12 - 44, we": (0.0, 0.0, "44"), "I cannot say.": (0.0, 0.0, None)}
        with httpx.Client(timeout=30) as http:
            for answer, (reward, strict, read) in cases.items():
                resp = http.post(f"{url}/verify", json=verify_body(answer, "-32"))
                assert resp.status_code == 200, resp.text
                got = resp.json()
                assert (got["reward"], got["strict"], got["extracted_answer"]) == (reward, strict, read), answer
                assert got["expected_answer"] == "-32"  # the row comes back, as Gym's servers return it
            refused = http.post(f"{url}/verify", json=verify_body("-32", "minus 32"))
            assert refused.status_code == 422, refused.text
            assert "expected_answer 'minus 32' is not a number" in refused.json()["detail"]
    finally:
        gym.stop()
    assert gym.pids == {}
