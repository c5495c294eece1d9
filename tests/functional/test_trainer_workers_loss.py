"""Two FSDP2 ranks against the in-process trainer for each loss aggregation mode, GSPO, CISPO, the entropy bonus
and GDPO's advantages (computed on the driver, whitened over the step): the global normalisation count the
driver hands the ranks makes the step's metrics and gradient norm those of one process (1e-4 relative, as
`test_trainer_workers.py`). One pair of trainers runs the options one after another (the loss setting swapped on
both sides between steps: one Ray start for all of them, suite time); lr 1e-6 keeps the weights of both sides
within rounding of each other, so each step compares the gradients the option makes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_trainer_workers import config_file, uneven_items  # noqa: F401  (config_file: the module-scoped say-"yes" config fixture)

from nemo_rl_ext.config import load_config
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.objectives.advantages import compute_gdpo_advantages
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig
from nemo_rl_ext.training.distributed_trainer import DistributedTrainer, rank_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread", "local_ray")

OPTIONS = {
    "token-mean": {"aggregation": "token-mean"},
    "seq-mean-token-mean": {"aggregation": "seq-mean-token-mean"},
    "seq-mean-token-sum": {"aggregation": "seq-mean-token-sum"},
    "seq-mean-token-sum-norm": {"aggregation": "seq-mean-token-sum-norm", "max_tokens_norm": 16},
    "gspo": {"sequence_level_importance_ratios": True, "aggregation": "seq-mean-token-mean"},
    "cispo": {"policy_loss": "cispo", "clip_high": 0.28},
    "entropy": {"entropy_coef": 0.05},
    "gdpo": {},  # the default loss on GDPO's advantages (below)
}


def gdpo_advantages(n: int) -> torch.Tensor:
    """GDPO's advantages (`compute_gdpo_advantages`: per component, weighted, whitened over the step) of `n`
    samples in groups of 4 with two seeded 0/1 components: computed on the driver, so the ranks get them as
    they get any advantages; the step checks they train as one process does."""
    g = torch.Generator().manual_seed(1)
    draws = torch.randint(0, 2, (n, 2), generator=g).tolist()
    components = [{"correct": float(a), "format": float(b)} for a, b in draws]
    groups = [components[i:i + 4] for i in range(0, n, 4)]
    return torch.cat(compute_gdpo_advantages(groups, {"correct": 1.0, "format": 0.5})).to(torch.float32)


@pytest.mark.timeout(400)
def test_two_ranks_train_each_loss_option_as_one_process_does(config_file) -> None:  # noqa: F811
    import ray

    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.training.trainer import PolicyTrainer

    cfg = load_config(config_file, ["trainer.workers=2", "optimizer.micro_batch_size=4", "optimizer.lr=1e-6",
                                    "optimizer.minibatches_per_step=1", "loss.kl_coef=0.0"], GRPOConfig)
    path = cfg.policy.model_name
    items, advantages = uneven_items()  # 3 micro-batches of 4: rank 1 runs a dummy one; sample 4 trains no token
    model, _ = load_model_and_tokenizer(path)
    first = ClippedPGLossConfig(kl_coef=0.0)
    local = PolicyTrainer(model, optimizer=cfg.optimizer, loss=first, temperature=1.0, pad_token_id=0)
    ranks = DistributedTrainer(dataclasses.replace(rank_spec(cfg, path, None, 0), loss=first), cfg.trainer,
                               cfg.policy.cluster)
    def set_loss(rank, loss) -> None:  # runs inside a rank (defined here: pickled by value, no module of this file)
        rank.spec = __import__("dataclasses").replace(rank.spec, loss=loss)

    try:
        for name, option in OPTIONS.items():
            loss = ClippedPGLossConfig(kl_coef=0.0, **option)
            local.loss_config = ranks.loss_config = loss
            ray.get([r.__ray_call__.remote(set_loss, loss) for r in ranks._ranks])
            adv = gdpo_advantages(len(items)) if name == "gdpo" else advantages
            expected, got = local.train_step(items, adv), ranks.train_step(items, adv)
            assert expected["optimizer_steps"] == 1.0 and expected["grad_norm"] > 0, name
            assert got == pytest.approx(expected, rel=1e-4, abs=1e-7), name
    finally:
        ranks.close()


@pytest.mark.timeout(300)
def test_two_ranks_subtract_the_kl_from_the_reward_as_one_process_does(config_file, tmp_path) -> None:  # noqa: F811
    """Reinforce++ with `loss.use_kl_in_reward`: the driver subtracts the KL between the ranks' logprobs and the
    reference's (another tiny model, so the KL is not 0) from the advantages and whitens them; the ranks train on
    those per-token advantages as one process does."""
    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.models.tiny import build_tiny_model
    from nemo_rl_ext.training.trainer import PolicyTrainer

    cfg = load_config(config_file, ["trainer.workers=2", "optimizer.micro_batch_size=4", "optimizer.lr=1e-6",
                                    "optimizer.minibatches_per_step=1", "loss.kl_coef=0.5",
                                    "loss.use_kl_in_reward=true", "grpo.adv_estimator=reinforce_plus_plus"],
                      GRPOConfig)
    path = cfg.policy.model_name
    reference = build_tiny_model(tmp_path / "reference", seed=1, initializer_range=0.05)
    items, advantages = uneven_items()
    model, _ = load_model_and_tokenizer(path)
    ref_model, _ = load_model_and_tokenizer(reference)
    local = PolicyTrainer(model, optimizer=cfg.optimizer, loss=cfg.loss.to_loss_config(), temperature=1.0,
                          pad_token_id=0, reference_model=ref_model)
    ranks = DistributedTrainer(rank_spec(cfg, path, reference, 0), cfg.trainer, cfg.policy.cluster)
    try:
        expected, got = local.train_step(items, advantages), ranks.train_step(items, advantages)
    finally:
        ranks.close()
    assert expected["kl/mean"] > 0.0 and expected["loss/kl"] == 0.0 and expected["grad_norm"] > 0
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-7)
