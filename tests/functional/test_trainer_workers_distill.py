"""Two FSDP2 ranks against the in-process trainer with on-policy distillation: the teacher's scores travel in each
rank's shard, and the step's metrics (the reverse KL per token and per agent, the forward KL over the teacher's
top-k) and gradient norm are those of one process (1e-4 relative, as `test_trainer_workers.py`). The teacher is a
second tiny model, loaded where each setting loads it: on the two ranks (`RankTeacher`, as GRPO does with
`trainer.workers: 2`) and in this process for the one-process trainer (`LocalTeacher`); its scores reach the items
as the rollout layer attaches them (`attach_scores`, `teacher_tensors`). One pair of trainers runs reverse, then
mixed (one Ray start); lr 1e-6 keeps both sides' weights within rounding."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from test_trainer_workers import config_file, uneven_items  # noqa: F401  (config_file: the module-scoped say-"yes" config fixture)

from nemo_rl_ext.config import load_config
from nemo_rl_ext.data.records import Completion, Message, StopReason
from nemo_rl_ext.distillation.local_teacher import LocalTeacher
from nemo_rl_ext.distillation.rank_teacher import RankTeacher
from nemo_rl_ext.distillation.scoring import attach_scores
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.models.loading import load_model_and_tokenizer
from nemo_rl_ext.objectives.distillation import DistillationLoss
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, teacher_tensors
from nemo_rl_ext.training.distributed_trainer import DistributedTrainer, rank_spec
from nemo_rl_ext.training.trainer import PolicyTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread", "local_ray")


def with_teacher(items, teacher, k: int = 3):
    """Each item as a completion (its first 5 ids a user message, the rest one assistant message; agents alternating
    between two names) scored by `teacher` with its top-k, attached as the rollout layer attaches scores and read
    back as training reads them; the teacher mask kept to the item's loss mask (sample 4 trains no token)."""
    agents = [("math", "code")[i % 2] for i in range(len(items))]
    completions = [
        Completion((Message("user", "", tuple(x.token_ids[:5].tolist())),
                    Message("assistant", "", tuple(x.token_ids[5:].tolist()),
                            tuple(x.generation_logprobs[5:].tolist()))),
                   reward=0.0, truncated=False, stop_reason=StopReason.NATURAL, num_turns=1, agent_name=agent)
        for x, agent in zip(items, agents, strict=True)
    ]
    scores = asyncio.run(teacher.score([c.token_ids for c in completions], k))
    out = []
    for x, c, s, agent in zip(items, completions, scores, agents, strict=True):
        fields = teacher_tensors(attach_scores(c, s))
        fields["teacher_mask"] = fields["teacher_mask"] * x.loss_mask
        out.append(dataclasses.replace(x, **fields, agent_name=agent))
    return out


@pytest.mark.timeout(400)
def test_two_ranks_distill_as_one_process_does(config_file, tmp_path) -> None:  # noqa: F811
    import ray

    from nemo_rl_ext.models.tiny import build_tiny_model

    cfg = load_config(config_file, ["trainer.workers=2", "optimizer.micro_batch_size=4", "optimizer.lr=1e-6",
                                    "optimizer.minibatches_per_step=1", "loss.kl_coef=0.0"], GRPOConfig)
    path = cfg.policy.model_name
    teacher_dir = str(build_tiny_model(tmp_path / "teacher", seed=7, initializer_range=0.05))  # not the policy
    items, advantages = uneven_items()  # 3 micro-batches of 4: rank 1 runs a dummy one; sample 4 trains no token
    model, _ = load_model_and_tokenizer(path)
    loss = ClippedPGLossConfig(kl_coef=0.0)
    first = DistillationLoss("reverse", reward_weight=0.5)
    local = PolicyTrainer(model, optimizer=cfg.optimizer, loss=loss, temperature=1.0, pad_token_id=0,
                          distillation=first)
    ranks = DistributedTrainer(dataclasses.replace(rank_spec(cfg, path, None, 0), loss=loss, distillation=first),
                               cfg.trainer, cfg.policy.cluster)

    def set_distillation(rank, settings) -> None:  # runs inside a rank (pickled by value)
        rank.spec = __import__("dataclasses").replace(rank.spec, distillation=settings)

    local_teacher, rank_teacher = LocalTeacher.load(teacher_dir), RankTeacher(ranks, teacher_dir)
    try:
        local_items, rank_items = with_teacher(items, local_teacher), with_teacher(items, rank_teacher)
        assert all(x.teacher_mask.sum() > 0 for i, x in enumerate(rank_items) if i != 4)
        for settings in (first, DistillationLoss("mixed", mixed_kl_weight=0.3, reward_weight=0.5)):
            local.distillation = settings
            ray.get([r.__ray_call__.remote(set_distillation, settings) for r in ranks._ranks])
            expected = local.train_step(local_items, advantages)
            got = ranks.train_step(rank_items, advantages)
            assert expected["optimizer_steps"] == 1.0 and expected["grad_norm"] > 0, settings
            assert {"distill/reverse_kl", "distill/reverse_kl/math", "distill/reverse_kl/code"} <= set(got)
            assert ("distill/forward_kl" in got) == (settings.kl_type == "mixed")
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-7), settings
    finally:
        local_teacher.close()
        rank_teacher.close()
        ranks.close()
