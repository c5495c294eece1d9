"""A local distillation teacher on two FSDP2 trainer ranks (`trainer.workers: 2`, `distillation/rank_teacher.py`):
its scores equal a local teacher's forward pass over the same ids, frozen and never in the driver; a rank that dies
makes the teacher fail (the fault policy's business), never hang."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_trainer_workers import config_file  # noqa: F401  (the module-scoped say-"yes" config fixture)
from tolerances import SAME_MODEL_LOGPROBS

from nemo_rl_ext.config import load_config
from nemo_rl_ext.distillation.local_teacher import LocalTeacher
from nemo_rl_ext.distillation.rank_teacher import RankTeacher
from nemo_rl_ext.distillation.teacher import TeacherError
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.training.distributed_trainer import DistributedTrainer, rank_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread", "local_ray")


def sequences() -> list[list[int]]:
    """Seven id sequences of lengths 5, 9, ..., 29 (seeded, in the tiny vocabulary)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 1000, (5 + 4 * i,), generator=g).tolist() for i in range(7)]


@pytest.mark.timeout(400)
def test_two_ranks_score_as_a_local_teacher_and_hold_it_frozen(config_file, tmp_path) -> None:  # noqa: F811
    import ray

    from nemo_rl_ext.models.tiny import build_tiny_model

    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=7, initializer_range=0.05)  # not the policy
    cfg = load_config(config_file, ["trainer.workers=2", "loss.kl_coef=0.0"], GRPOConfig)
    ranks = DistributedTrainer(rank_spec(cfg, cfg.policy.model_name, None, 0), cfg.trainer, cfg.policy.cluster)
    local = LocalTeacher.load(str(teacher_dir), max_batch_tokens=60)
    try:
        # 60 padded tokens a batch: 5 batches, so rank 1 runs a dummy forward in the last round
        teacher = RankTeacher(ranks, str(teacher_dir), max_batch_tokens=60)
        for top_k in (0, 3):
            got = asyncio.run(teacher.score(sequences(), top_k))
            want = asyncio.run(local.score(sequences(), top_k))
            assert len(got) == len(want) == 7
            for g, w, seq in zip(got, want, sequences(), strict=True):
                assert len(g.logprobs) == len(seq) - 1
                # FSDP all-gathers the whole weights: the same math, sums possibly in another order
                torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), **SAME_MODEL_LOGPROBS)
                assert (g.topk_ids is None) == (top_k == 0)
                if top_k:
                    assert g.topk_ids == w.topk_ids
                    torch.testing.assert_close(torch.tensor(g.topk_logprobs), torch.tensor(w.topk_logprobs),
                                               **SAME_MODEL_LOGPROBS)

        def frozen(rank, key):  # runs inside a rank (pickled by value)
            model = rank.teachers[key]
            return ([p.requires_grad for p in model.parameters()], model.training,
                    sum(len(s) for s in rank.optimizer.state.values()), len(rank.optimizer.param_groups[0]["params"]),
                    sum(1 for _ in rank.policy.parameters()))

        for grads, training, _, in_optimizer, policy_params in ray.get(
                [r.__ray_call__.remote(frozen, teacher.key) for r in ranks._ranks]):
            assert grads and not any(grads) and not training
            assert in_optimizer == policy_params  # the optimizer holds the policy's parameters, none of the teacher's
        ray.kill(ranks._ranks[1], no_restart=True)
        with pytest.raises(TeacherError, match="trainer ranks: TrainerWorkerError.*rank 1"):
            asyncio.run(teacher.score(sequences()[:2]))
        teacher.close()
    finally:
        local.close()
        ranks.close()
