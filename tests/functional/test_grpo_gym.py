"""One GRPO step in nemo_gym mode against real NeMo Gym 0.7.0 servers: rollouts come from Gym agents
calling our policy server on the tiny model, Gym's rule-based server scores them with a dense reward
(string similarity to the expected answer), and the step changes the trainer's and the engine's weights."""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

import pytest
import torch

from nemo_rl_ext.grpo.batch import build_training_batch
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.grpo.metrics_logger import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gym, pytest.mark.timeout(900)]


def nemo_rl_advantages(rewards: list[float]) -> list[float]:
    """NeMo-RL's GRPO advantages of one group (use_leave_one_out_baseline, normalize_rewards; all valid):
    A_i = r_i - mean(r_j, j != i), divided by (std + 1e-6) where std = sample std (ddof 1) of the r_j,
    j != i, is > 0 (0 with fewer than two others); a group of one gets 0."""
    if len(rewards) < 2:
        return [0.0] * len(rewards)
    out = []
    for i, r in enumerate(rewards):
        others = rewards[:i] + rewards[i + 1 :]
        std = statistics.stdev(others) if len(others) > 1 else 0.0
        a = r - statistics.fmean(others)
        out.append(a / (std + 1e-6) if std > 0 else a)
    return out


def gym_grpo_config(policy: dict, gym_venv: Path, tmp_path: Path, *, steps: int) -> GRPOConfig:
    """GRPO over NeMo Gym on the shipped Gym rows, two agents with 4 and 3 samples, Gym launched for the run.

    The rows' expected answer is made of common characters, so that the random tiny model's text gets partial
    credit from the similarity grader (rewards differ within a group)."""
    rows = [json.loads(line) for line in (REPO / "examples/data/gym_arithmetic.jsonl").read_text().splitlines()]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({**r, "expected_answer": "what is the answer to it"}) + "\n" for r in rows))
    return GRPOConfig.model_validate(
        {
            "policy": {**policy, "generation": {"max_new_tokens": 8, "temperature": 1.0}},
            "data": {"train_path": str(data), "shuffle": False},
            "grpo": {
                "num_prompts_per_step": 2,
                "max_num_steps": steps,
                "seed": 3,
            },
            "optimizer": {"lr": 1.0e-3, "micro_batch_size": 8},
            # the loss before the defaults became NeMo-RL's (KL 0.01, IS off)
            "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
            "rollouts": {
                "mode": "nemo_gym",
                "num_generations_per_prompt": {"agent_alpha": 4, "agent_beta": 3},
                "max_seq_len": 256,
                "gym": {
                    "launch": {
                        "gym_venv": str(gym_venv),
                        "config_paths": [str(REPO / "tests/functional/gym_configs/dense_arithmetic_agents.yaml")],
                    },
                    "row_timeout_s": 120,
                },
            },
            "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
            "output_dir": str(tmp_path / "run"),
        }
    )


def test_one_grpo_step_in_nemo_gym_mode(gym_venv, tmp_path, monkeypatch, caplog):
    from nemo_rl_ext.grpo import loop as grpo_module
    from nemo_rl_ext.models.tiny import build_tiny_model

    batches = []  # (records, batch) of every step, as the trainer gets them

    def recording_build_training_batch(records, **kwargs):
        batch = build_training_batch(records, **kwargs)
        batches.append((list(records), batch))
        return batch

    monkeypatch.setattr(grpo_module, "build_training_batch", recording_build_training_batch)

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0, initializer_range=0.05)
    cfg = gym_grpo_config({"model_name": str(model_dir), "max_model_len": 512}, gym_venv, tmp_path, steps=1)
    caplog.set_level(logging.INFO, logger="nemo_rl_ext.gym.launcher")
    with GRPO(cfg) as grpo:
        before = {k: v.detach().clone() for k, v in grpo.trainer.model.state_dict().items()}
        grpo.run()
        after = grpo.trainer.model.state_dict()
        engine = grpo.generation.inner.model.state_dict()  # the hf engine's own copy of the weights
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "the GRPO step left every weight unchanged"
    assert all(torch.equal(engine[k], after[k]) for k in changed)  # the engine got the new weights (a copy: bit-exact)
    (step,) = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    gym_logs = Path(cfg.output_dir) / "gym"  # the Gym servers' logs stay in the run's folder, and the log says so
    assert (gym_logs / "agent_alpha.log").is_file() and f"their logs in {gym_logs}" in caplog.text
    # the first two rows alternate agents: 4 + 3 completions, scored by Gym (dense, so they differ)
    assert step["rollout/num_samples"] == 7
    assert step["agent/agent_alpha/num_samples"] == 4 and step["agent/agent_beta/num_samples"] == 3
    assert step["rollout/errors"] == 0
    assert 0.0 < step["rollout/reward/mean"] < 1.0 and step["rollout/reward/std"] > 0

    # the batch of the step: two uneven groups (4 and 3 samples), in order, each with its advantages
    # and loss masks as NeMo-RL computes them, worked out here from the groups' rewards and messages
    ((records, batch),) = batches
    assert [(r.agent_name, len(r.completions)) for r in records] == [("agent_alpha", 4), ("agent_beta", 3)]
    assert batch.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1]
    start = 0
    for record in records:
        rewards = [c.reward for c in record.completions]
        assert len(set(rewards)) > 1, rewards  # a group with signal
        got = batch.advantages[start : start + len(rewards)].tolist()
        assert got == pytest.approx(nemo_rl_advantages(rewards), rel=1e-5, abs=1e-5), rewards
        for c, item in zip(record.completions, batch.items[start : start + len(rewards)], strict=True):
            # 1 exactly on the tokens the engine generated (assistant turns with logprobs), 0 on the rest
            expected_mask, expected_lp = [], []
            for m in c.message_log:
                generated = m.role == "assistant"
                assert not generated or len(m.generation_logprobs) == len(m.token_ids)
                expected_mask += [1.0 if generated else 0.0] * len(m.token_ids)
                expected_lp += list(m.generation_logprobs) if generated else [0.0] * len(m.token_ids)
            assert sum(expected_mask) > 0 and expected_mask[0] == 0.0
            assert item.token_ids.tolist() == [t for m in c.message_log for t in m.token_ids]
            assert item.loss_mask.tolist() == expected_mask
            assert item.generation_logprobs.tolist() == pytest.approx(expected_lp, rel=1e-6, abs=1e-6)
        start += len(rewards)
