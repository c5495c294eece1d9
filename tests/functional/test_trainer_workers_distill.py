"""Two FSDP2 ranks against the in-process trainer with on-policy distillation: the teacher's scores travel in each
rank's shard, and the step's metrics (the reverse KL per token and per agent, the forward KL over the teacher's
top-k) and gradient norm are those of one process (1e-4 relative, as `test_trainer_workers.py`). One pair of
trainers runs reverse, then mixed (one Ray start); lr 1e-6 keeps both sides' weights within rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_trainer_workers import config_file, uneven_items  # noqa: F401  (config_file: the module-scoped say-"yes" config fixture)

from nemo_rl_ext.config import load_config
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.models.loading import load_model_and_tokenizer
from nemo_rl_ext.objectives.distillation import DistillationLoss
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig
from nemo_rl_ext.training.distributed_trainer import DistributedTrainer, rank_spec
from nemo_rl_ext.training.trainer import PolicyTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread", "local_ray")


def with_teacher(items, k: int = 3):
    """Seeded teacher scores on every trained token (logprobs in (-3, 0), k ids of the tiny vocabulary with their
    logprobs), agents alternating between two names."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, x in enumerate(items):
        n = x.token_ids.numel()
        out.append(dataclasses.replace(
            x, teacher_logprobs=-3 * torch.rand(n, generator=g) * x.loss_mask, teacher_mask=x.loss_mask.clone(),
            teacher_topk_ids=torch.randint(0, 1000, (n, k), generator=g),
            teacher_topk_logprobs=-3 * torch.rand(n, k, generator=g), agent_name=("math", "code")[i % 2]))
    return out


@pytest.mark.timeout(400)
def test_two_ranks_distill_as_one_process_does(config_file) -> None:  # noqa: F811
    import ray

    cfg = load_config(config_file, ["trainer.workers=2", "optimizer.micro_batch_size=4", "optimizer.lr=1e-6",
                                    "optimizer.minibatches_per_step=1", "loss.kl_coef=0.0"], GRPOConfig)
    path = cfg.policy.model_name
    items, advantages = uneven_items()  # 3 micro-batches of 4: rank 1 runs a dummy one; sample 4 trains no token
    items = with_teacher(items)
    model, _ = load_model_and_tokenizer(path)
    loss = ClippedPGLossConfig(kl_coef=0.0)
    first = DistillationLoss("reverse", reward_weight=0.5)
    local = PolicyTrainer(model, optimizer=cfg.optimizer, loss=loss, temperature=1.0, pad_token_id=0,
                          distillation=first)
    ranks = DistributedTrainer(dataclasses.replace(rank_spec(cfg, path, None, 0), loss=loss, distillation=first),
                               cfg.trainer, cfg.policy.cluster)

    def set_distillation(rank, settings) -> None:  # runs inside a rank (pickled by value)
        rank.spec = __import__("dataclasses").replace(rank.spec, distillation=settings)

    try:
        for settings in (first, DistillationLoss("mixed", mixed_kl_weight=0.3, reward_weight=0.5)):
            local.distillation = settings
            ray.get([r.__ray_call__.remote(set_distillation, settings) for r in ranks._ranks])
            expected, got = local.train_step(items, advantages), ranks.train_step(items, advantages)
            assert expected["optimizer_steps"] == 1.0 and expected["grad_norm"] > 0, settings
            assert {"distill/reverse_kl", "distill/reverse_kl/math", "distill/reverse_kl/code"} <= set(got)
            assert ("distill/forward_kl" in got) == (settings.kl_type == "mixed")
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-7), settings
    finally:
        ranks.close()
