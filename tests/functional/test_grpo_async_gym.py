"""Asynchronous GRPO in nemo_gym mode (real NeMo Gym 0.7.0 servers, the tiny model, per-agent counts).

Gym's records carry no per-token weight versions, so a group's lag is judged by the version it started at
(no token of it can be older): the bound holds all the same.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.grpo.metrics_logger import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gym, pytest.mark.timeout(900)]


@pytest.mark.usefixtures("local_ray", "one_torch_thread")
def test_async_grpo_in_nemo_gym_mode_on_two_trainer_ranks_keeps_the_bound_and_the_agent_counts(
    gym_venv, tmp_path, monkeypatch
):
    """Asynchronous GRPO in nemo_gym mode with `trainer.workers: 2` (FSDP2 ranks on the session's Ray), in one
    4-step run: the lag bound holds and each group has its agent's count; the steps train on Gym's records (token
    ids and engine logprobs from our policy server), and each refit hands the ranks' gathered weights to the
    engine that serves Gym. (One run proves both: the loop's interface to the trainer is the same at 1 worker.)"""
    from nemo_rl_ext.grpo import loop as grpo_module
    from nemo_rl_ext.models.tiny import build_tiny_model
    from nemo_rl_ext.training.distributed_trainer import DistributedTrainer

    trained = []  # the records of every step, as the trainer gets them
    build = grpo_module.build_training_batch

    def recording_build_training_batch(records, **kwargs):
        trained.append(list(records))
        return build(records, **kwargs)

    monkeypatch.setattr(grpo_module, "build_training_batch", recording_build_training_batch)
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
            # micro-batches of 4: both ranks train on real samples (6 to 8 per step)
            "optimizer": {"lr": 1.0e-3, "micro_batch_size": 4},
            "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},
            "trainer": {"workers": 2, "worker": {"num_cpus": 1}},
            "rollouts": {
                "mode": "nemo_gym",
                "num_generations_per_prompt": {"agent_alpha": 4, "agent_beta": 3},
                "max_seq_len": 256,
                "gym": {"launch": {"gym_venv": str(gym_venv), "config_paths": [
                    str(REPO / "tests/functional/gym_configs/dense_arithmetic_agents.yaml")]}, "row_timeout_s": 120},
            },
            "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
            "output_dir": str(tmp_path / "run"),
        }
    )
    with GRPO(cfg) as grpo:
        assert isinstance(grpo.trainer, DistributedTrainer) and len(grpo.trainer.workers) == 2
        engine = grpo.generation.inner.model  # the hf engine that serves Gym's model calls
        before = {k: v.detach().clone() for k, v in engine.state_dict().items()}
        grpo.run()
        after = engine.state_dict()
        gathered = grpo.trainer.state_dict()  # the ranks' weights now
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) > len(before) // 2, changed  # trained and refitted
    assert all(torch.equal(after[k], gathered[k]) for k in after)  # the engine holds the ranks' weights, bit for bit
    metrics = read_metrics(Path(cfg.output_dir) / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    groups = {"agent_alpha": 0.0, "agent_beta": 0.0}
    for m in metrics:
        assert m["rollout/errors"] == 0 and m["train/num_sequences"] == m["rollout/num_samples"] > 0
        assert m["train/optimizer_steps"] == 1 and m["train/grad_norm"] > 0 and math.isfinite(m["train/loss"])
        assert m["refit/gathered_bytes"] > 0 and m["refit/buckets"] >= 1 and m["timing/refit/gather_seconds"] > 0
        assert m["async/lag/max"] <= 1.0 and m["async/lag/0"] + m["async/lag/1"] == 2.0
        # each trained group has its agent's count: 4 samples for agent_alpha, 3 for agent_beta
        alpha, beta = m.get("agent/agent_alpha/num_samples", 0.0), m.get("agent/agent_beta/num_samples", 0.0)
        assert alpha + beta == m["rollout/num_samples"] and alpha / 4 + beta / 3 == 2.0, (alpha, beta)
        groups["agent_alpha"] += alpha / 4
        groups["agent_beta"] += beta / 3
    assert min(groups.values()) >= 1.0, groups  # both agents' rows (they alternate in the file) were trained
    assert max(m["async/lag/max"] for m in metrics) == 1.0  # groups did run across a weight update
    assert len(trained) == 4
    for records in trained:  # Gym's agents rolled them out through our policy server: token ids and logprobs
        # two groups a step, whichever finished first; each with its agent's count (4 for alpha, 3 for beta)
        counts = {"agent_alpha": 4, "agent_beta": 3}
        assert len(records) == 2 and all(len(r.completions) == counts[r.agent_name] for r in records), records
        for completion in (c for r in records for c in r.completions):
            assert completion.error is None and completion.message_log[0].token_ids
            generated = [m for m in completion.message_log if m.role == "assistant"]
            assert generated and all(m.token_ids and len(m.generation_logprobs) == len(m.token_ids) for m in generated)
