"""Asynchronous GRPO in nemo_gym mode (real NeMo Gym 0.7.0 servers, the tiny model, per-agent counts).

Gym's records carry no per-token weight versions, so a group's lag is judged by the version it started at
(no token of it can be older): the bound holds all the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl_ext.algorithms.grpo import GRPO
from nemo_rl_ext.algorithms.grpo_config import GRPOConfig
from nemo_rl_ext.algorithms.metrics_logger import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gym, pytest.mark.timeout(900)]


def test_async_grpo_in_nemo_gym_mode_keeps_the_bound_and_the_agent_counts(gym_venv, tmp_path):
    from nemo_rl_ext.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0, initializer_range=0.05)
    rows = [json.loads(line) for line in (REPO / "examples/data/gym_arithmetic.jsonl").read_text().splitlines()]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({**r, "expected_answer": "what is the answer to it"}) + "\n" for r in rows))
    cfg = GRPOConfig.model_validate(
        {
            "policy": {"model_name": str(model_dir), "max_model_len": 512,
                       "generation": {"max_new_tokens": 8, "temperature": 1.0}},
            "data": {"train_path": str(data), "shuffle": False},
            "grpo": {"num_prompts_per_step": 2, "max_num_steps": 4, "seed": 3,
                     "async": {"enabled": True, "max_lag": 1, "in_flight": "abort"}},
            "optimizer": {"lr": 1.0e-3, "micro_batch_size": 8},
            # the loss before the defaults became NeMo-RL's (KL 0.01; IS on here anyway, untruncated by default)
            "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
            "rollouts": {
                "mode": "nemo_gym",
                "num_generations_per_prompt": {"agent_alpha": 4, "agent_beta": 3},
                "max_seq_len": 256,
                "gym": {"launch": {"gym_venv": str(gym_venv), "config_paths": [
                    str(REPO / "tests/functional/gym_configs/dense_arithmetic_agents.yaml")]}, "row_timeout_s": 120},
            },
            "logger": {"progress": False, "tensorboard": False, "print_steps": False},
            "output_dir": str(tmp_path / "run"),
        }
    )
    with GRPO(cfg) as grpo:
        grpo.run()
    metrics = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    groups = {"agent_alpha": 0.0, "agent_beta": 0.0}
    for m in metrics:
        assert m["rollout/errors"] == 0
        assert m["async/lag/max"] <= 1.0 and m["async/lag/0"] + m["async/lag/1"] == 2.0
        # each trained group has its agent's count: 4 samples for agent_alpha, 3 for agent_beta
        alpha, beta = m.get("agent/agent_alpha/num_samples", 0.0), m.get("agent/agent_beta/num_samples", 0.0)
        assert alpha + beta == m["rollout/num_samples"] and alpha / 4 + beta / 3 == 2.0, (alpha, beta)
        groups["agent_alpha"] += alpha / 4
        groups["agent_beta"] += beta / 3
    assert min(groups.values()) >= 1.0, groups  # both agents' rows (they alternate in the file) were trained
    assert max(m["async/lag/max"] for m in metrics) == 1.0  # groups did run across a weight update
