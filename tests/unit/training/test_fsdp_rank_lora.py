"""One FSDP2 rank at world size 1 (gloo, in this process, no Ray) with LoRA on a decoder projection and the LM
head, and a KL term: the rank's update equals the in-process trainer's. The KL reference switches the adapters off
without peft's `disable_adapter()`, which also flips their `requires_grad` and, under FSDP2, left the root unit's
(the LM head's) adapters untrained (`fsdp_wrap.adapters_off`)."""

from __future__ import annotations

import socket

import pytest
import torch
from safetensors.torch import load_file
from tolerances import AdamRecord, assert_adam_moments_close, assert_trained_weights_close

from nemo_rl_ext.models.loading import load_model_and_tokenizer
from nemo_rl_ext.objectives.aggregation import minibatch_count
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, CompletionTensors
from nemo_rl_ext.training.config import LoraSettings, OptimizerSettings
from nemo_rl_ext.training.fsdp_workers import RankSpec, TrainerRank
from nemo_rl_ext.training.lora import with_lora
from nemo_rl_ext.training.trainer import PolicyTrainer

SEED = 7


def _items() -> tuple[list[CompletionTensors], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(4):
        ids = torch.randint(0, 500, (8 + 2 * i,), generator=g)
        mask = torch.zeros(ids.numel())
        mask[5:] = 1.0
        items.append(CompletionTensors(ids, mask, -torch.rand(ids.numel(), generator=g) * mask))
    return items, torch.tensor([1.0, -0.5, 2.0, -1.0])


LOSS_OPTIONS = {  # every loss option with LoRA at least once, each with the KL term. The items' engine logprobs
    # are far below the tiny model's (IS weights ~1e-3 a token): the bands are set so that some tokens train
    "default": {},
    "gspo-tis": {"sequence_level_importance_ratios": True, "aggregation": "seq-mean-token-mean",
                 "importance_sampling_correction": True, "truncated_importance_sampling_type": "tis",
                 "truncated_importance_sampling_ratio": 2.0, "truncated_importance_sampling_ratio_min": 0.5},
    "cispo-icepop": {"policy_loss": "cispo", "aggregation": "seq-mean-token-sum", "importance_sampling_correction": True,
                     "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 3e-3,
                     "truncated_importance_sampling_ratio_min": 1e-4},
    "entropy": {"entropy_coef": 0.05},
    "seq-mask-tis-dr-grpo": {"aggregation": "seq-mean-token-sum-norm", "max_tokens_norm": 8,
                             "importance_sampling_correction": True, "truncated_importance_sampling_type":
                             "seq-mask-tis", "truncated_importance_sampling_ratio": 1e-1,
                             "truncated_importance_sampling_ratio_min": 1e-4},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option", sorted(LOSS_OPTIONS))
def test_a_lora_rank_with_a_kl_term_trains_the_lm_head_adapters_as_one_process_does(tmp_path, option):
    from nemo_rl_ext.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "model", seed=0, initializer_range=0.05, tie_word_embeddings=False)
    lora = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "lm_head"))
    optimizer = OptimizerSettings(lr=1e-2, micro_batch_size=2, share_prompt_prefix=False)
    loss = ClippedPGLossConfig(kl_coef=0.1, **LOSS_OPTIONS[option])
    items, advantages = _items()
    model, _ = load_model_and_tokenizer(path)
    torch.manual_seed(SEED)
    local = PolicyTrainer(with_lora(model, lora), optimizer=optimizer, loss=loss, temperature=1.0, pad_token_id=0)
    adapters = {k: p for k, p in local.model.named_parameters() if p.requires_grad}
    initial = {k: p.detach().clone() for k, p in adapters.items()}
    record = AdamRecord(local.optimizer, adapters)  # the reference path: the in-process trainer
    rank = TrainerRank(0, 1, torch_threads=None)  # leaves this process's thread count alone
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = RankSpec(model_path=str(path), reference_path=None, dtype="float32", device="cpu", optimizer=optimizer,
                    loss=loss, temperature=1.0, pad_token_id=0, lora=lora, init_seed=SEED)
    try:
        loaded = rank.setup("127.0.0.1", port, spec)
        assert loaded["reference_loaded"] is False
        count = minibatch_count([x.loss_mask for x in items], loss)
        for _ in range(2):
            expected = local.train_step(items, advantages)
            assert expected["is/masked_tokens"] < expected["num_tokens"]  # the policy-gradient term trains
            ref = [lp for chunk in rank.logprobs([items[:2], items[2:]], reference=True) for lp in chunk]
            slots = [(items[:2], advantages[:2], None, ref[:2]), (items[2:], advantages[2:], None, ref[2:])]
            _, norm = rank.train_minibatch(slots, count)
            assert norm == pytest.approx(expected["grad_norm"], rel=1e-4)
        names = [name for name, *_ in rank.tensor_sizes()]
        got = rank.gather(names)
        rank_adapters = {k: _full(p) for k, p in rank.model.named_parameters() if p.requires_grad}
        rank_state = rank.optimizer_state()["state"]
    finally:
        rank.shutdown()
    # the adapters themselves, by Adam's rule for two paths (tests/tolerances.py): B starts at 0, so A's
    # gradient is 0 at step 1 and A is held to the noise box alone; B's real gradients are held to their rounding
    assert rank_adapters.keys() == adapters.keys() and any(".lm_head." in k for k in adapters)
    trained = {k: p.detach() for k, p in adapters.items()}
    power = assert_trained_weights_close(trained, rank_adapters, initial=initial, record=record.at(2), lr=1e-2)
    assert power > 0, power  # some elements are held to 1% of a step (3.8% of them here: A is box-only)
    local_state = {name: local.optimizer.state[p] for name, p in adapters.items()}
    assert_adam_moments_close(local_state, rank_state, noise=record.at(2).noise, steps=2)
    want, base = local.state_dict(), load_file(path / "model.safetensors")
    for name in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert float((got[name] - base[name]).abs().max()) > 1e-4, name  # its adapters trained
        assert float((want[name] - base[name]).abs().max()) > 1e-4, name


def _full(param: torch.Tensor) -> torch.Tensor:
    """A rank's parameter, whole (an FSDP2 DTensor at world size 1 holds it all), detached."""
    from torch.distributed.tensor import DTensor

    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


ABLATIONS = {  # an option's keys, set back to their defaults together
    "sequence_level_importance_ratios": ("sequence_level_importance_ratios",),
    "policy_loss": ("policy_loss",),
    "aggregation": ("aggregation", "max_tokens_norm"),
    "entropy_coef": ("entropy_coef",),
    "truncated_importance_sampling_type": ("importance_sampling_correction", "truncated_importance_sampling_type",
                                           "truncated_importance_sampling_ratio",
                                           "truncated_importance_sampling_ratio_min"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("option", sorted(set(LOSS_OPTIONS) - {"default"}))
def test_each_loss_option_changes_a_lora_step(tmp_path, option):
    """Each option of a set takes effect with LoRA: the step's loss differs from the same set with that option
    back at its default. Two minibatches, so the second one's policy ratio is not 1 (GSPO's ratio equals the
    token-level one's gradient at ratio 1)."""
    from nemo_rl_ext.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "model", seed=0, initializer_range=0.05, tie_word_embeddings=False)
    lora = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "lm_head"))
    optimizer = OptimizerSettings(lr=1e-2, micro_batch_size=2, minibatches_per_step=2, share_prompt_prefix=False)
    items, advantages = _items()

    def step(settings: dict) -> dict[str, float]:
        model, _ = load_model_and_tokenizer(path)
        torch.manual_seed(SEED)
        trainer = PolicyTrainer(with_lora(model, lora), optimizer=optimizer,
                                loss=ClippedPGLossConfig(kl_coef=0.1, **settings), temperature=1.0, pad_token_id=0)
        return trainer.train_step(items, advantages)

    settings = LOSS_OPTIONS[option]
    got = step(settings)
    ablated = [key for key in ABLATIONS if key in settings]
    assert ablated
    for key in ablated:
        without = {k: v for k, v in settings.items() if k not in ABLATIONS[key]}
        assert step(without)["loss"] != got["loss"], (option, key)


@pytest.mark.timeout(120)
def test_the_kl_in_the_reward_takes_effect_with_lora(tmp_path):
    """Reinforce++'s KL in the reward with LoRA (the reference: the policy with its adapters off): no KL term in
    the loss, and a step that differs from the one with the KL in the loss and from the one without any KL."""
    from nemo_rl_ext.models.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "model", seed=0, initializer_range=0.05, tie_word_embeddings=False)
    lora = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "lm_head"))
    optimizer = OptimizerSettings(lr=1e-2, micro_batch_size=2, share_prompt_prefix=False)
    items, advantages = _items()

    def steps(loss: ClippedPGLossConfig) -> list[dict[str, float]]:
        model, _ = load_model_and_tokenizer(path)
        torch.manual_seed(SEED)
        trainer = PolicyTrainer(with_lora(model, lora), optimizer=optimizer, loss=loss, temperature=1.0, pad_token_id=0)
        return [trainer.train_step(items, advantages) for _ in range(2)]  # step 2: the adapters moved, KL != 0

    in_reward = steps(ClippedPGLossConfig(kl_coef=0.5, use_kl_in_reward=True))[-1]
    in_loss = steps(ClippedPGLossConfig(kl_coef=0.5))[-1]
    without = steps(ClippedPGLossConfig(kl_coef=0.0))[-1]
    assert in_reward["loss/kl"] == 0.0 and in_reward["kl/mean"] > 0.0 and in_loss["loss/kl"] > 0.0
    assert in_reward["loss"] not in (in_loss["loss"], without["loss"])
