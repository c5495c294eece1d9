"""PolicyTrainer on the tiny model: logprobs match the generation backend, micro-batching is exact, refits."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from tolerances import (
    ENGINE_LOGPROBS,
    GRADIENT_OF_LARGEST,
    SAME_MODEL_LOGPROBS,
    AdamRecord,
    assert_trained_weights_close,
)

from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.models.generation.hf_backend import HfGeneration
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, CompletionTensors
from nemo_rl_ext.training.config import OptimizerSettings
from nemo_rl_ext.training.trainer import PolicyTrainer, token_logprobs

NO_IS = ClippedPGLossConfig(kl_coef=0.0)  # the policy-gradient term alone (the IS correction is off by default)


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts of different lengths."""
    out = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {i} + {i * 3}?" + " Be brief." * i}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def sample(model, tokenizer, temperature: float, n: int = 4, seed: int = 1) -> list[CompletionTensors]:
    """Generate with the backend; return completions as trainer inputs (mask on generated tokens)."""
    gen = HfGeneration(model, tokenizer, max_model_len=256)
    config = GenerationConfig(max_new_tokens=10, temperature=temperature, seed=seed)

    async def go():
        return await asyncio.gather(*(gen.generate_async(p, config) for p in prompts(tokenizer, n)))

    try:
        outs = asyncio.run(go())
    finally:
        gen.shutdown()
    items = []
    for p, out in zip(prompts(tokenizer, n), outs, strict=True):
        ids = torch.tensor(p + list(out.output_ids))
        mask = torch.cat([torch.zeros(len(p)), torch.ones(len(out.output_ids))])
        gen_lp = torch.cat([torch.zeros(len(p)), torch.tensor(out.logprobs)])
        items.append(CompletionTensors(ids, mask, gen_lp))
    return items


def make_trainer(model, loss=NO_IS, **settings) -> PolicyTrainer:
    return PolicyTrainer(
        model, optimizer=OptimizerSettings(**{"lr": 1e-3, **settings}), loss=loss, temperature=1.0, pad_token_id=0
    )


@pytest.fixture
def fresh_model(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    return copy.deepcopy(model)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_trainer_logprobs_equal_the_backend_logprobs(tiny_model_and_tokenizer, fresh_model, temperature):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, temperature, n=5)
    assert len({x.token_ids.numel() for x in items}) > 1  # a padded batch
    trainer = PolicyTrainer(
        fresh_model, optimizer=OptimizerSettings(micro_batch_size=3), loss=NO_IS, temperature=temperature
    )
    for x, lp in zip(items, trainer.logprobs(items), strict=True):
        generated = x.loss_mask.bool()
        torch.testing.assert_close(lp[generated], x.generation_logprobs[generated], **ENGINE_LOGPROBS)
        assert lp[0] == 0.0


def test_token_logprobs_shift_and_padding_do_not_leak(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        both = token_logprobs(model, ids, attention)
        alone = token_logprobs(model, ids[1:, :3], attention[1:, :3])
        logits = model(input_ids=ids[:1]).logits[0]
    torch.testing.assert_close(both[1, :3], alone[0], **SAME_MODEL_LOGPROBS)
    expected = torch.log_softmax(logits[1], -1)[7]  # token 2 is scored by the logits at position 1
    torch.testing.assert_close(both[0, 2], expected, **SAME_MODEL_LOGPROBS)


LOSS_OPTIONS = {  # each aggregation mode, GSPO and CISPO: every one must accumulate over micro-batches exactly
    "default": {},
    "seq-mean-token-mean": {"aggregation": "seq-mean-token-mean"},
    "seq-mean-token-sum": {"aggregation": "seq-mean-token-sum"},
    "seq-mean-token-sum-norm": {"aggregation": "seq-mean-token-sum-norm", "max_tokens_norm": 16},
    "gspo": {"sequence_level_importance_ratios": True, "aggregation": "seq-mean-token-mean"},
    "cispo": {"policy_loss": "cispo", "clip_high": 0.28},
    "entropy": {"entropy_coef": 0.05, "aggregation": "seq-mean-token-sum"},
}


@pytest.mark.parametrize("option", sorted(LOSS_OPTIONS))
def test_micro_batches_accumulate_to_the_full_batch_update(tiny_model_and_tokenizer, option):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=6)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    results = []
    loss = ClippedPGLossConfig(kl_coef=0.0, **LOSS_OPTIONS[option])
    for micro in (6, 4, 1):
        trainer = make_trainer(copy.deepcopy(model), loss=loss, micro_batch_size=micro, max_grad_norm=None)
        trainer.optimizer = torch.optim.SGD(trainer.parameters, lr=1.0)  # weight change = -gradient
        metrics = trainer.train_step(items, advantages)
        assert metrics["optimizer_steps"] == 1.0
        grads = {k: start[k] - v for k, v in trainer.state_dict().items()}
        results.append((metrics, grads))
    (full_m, full_g), *others = results
    scale = max(float(g.abs().max()) for g in full_g.values())
    assert scale > 1e-2
    for m, g in others:
        assert m["loss"] == pytest.approx(full_m["loss"], rel=1e-5, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(full_m["grad_norm"], rel=1e-5)
        assert m["num_tokens"] == full_m["num_tokens"]
        for key in full_g:  # fp32 summation order differs: agreement to 1e-4 of the largest gradient entry
            torch.testing.assert_close(g[key], full_g[key], atol=GRADIENT_OF_LARGEST * scale, rtol=0)


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_failed_rollouts_are_not_in_the_loss_denominator(tiny_model_and_tokenizer, normalization):
    # a failed rollout reaches the trainer with an all-zero loss mask (build_loss_mask): the update must be
    # exactly the update without it, i.e. its tokens are neither trained nor counted in the normalization
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    failed = CompletionTensors(items[2].token_ids, torch.zeros_like(items[2].loss_mask), items[2].generation_logprobs)
    loss = ClippedPGLossConfig(kl_coef=0.0, normalization=normalization)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    updates, metrics = [], []
    for batch, adv in (([items[0], items[1], failed, items[3]], [1.0, -1.0, 0.0, 0.5]),
                       ([items[0], items[1], items[3]], [1.0, -1.0, 0.5])):
        trainer = make_trainer(copy.deepcopy(model), loss=loss, micro_batch_size=2, max_grad_norm=None)
        trainer.optimizer = torch.optim.SGD(trainer.parameters, lr=1.0)  # weight change = -gradient
        metrics.append(trainer.train_step(batch, torch.tensor(adv)))
        updates.append({k: start[k] - v for k, v in trainer.state_dict().items()})
    with_failed, without = metrics
    assert with_failed["num_tokens"] == without["num_tokens"] == sum(float(items[i].loss_mask.sum()) for i in (0, 1, 3))
    assert with_failed["num_sequences"] == without["num_sequences"] == 3.0
    assert with_failed["loss"] == pytest.approx(without["loss"], rel=1e-5, abs=1e-6)
    scale = max(float(g.abs().max()) for g in updates[1].values())
    for key in updates[1]:  # SGD lr 1: the gradients, by the gradient rule (another micro-batch: other shapes);
        # a failed rollout counted in the denominator would scale every update by 3/4
        torch.testing.assert_close(updates[0][key], updates[1][key], atol=GRADIENT_OF_LARGEST * scale, rtol=0)


def test_grad_clipping_and_metrics(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = make_trainer(copy.deepcopy(model), micro_batch_size=2, max_grad_norm=1e-3)
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    metrics = trainer.train_step(items, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert metrics["grad_norm"] > 1e-3  # reported before clipping
    assert metrics["policy_ratio/mean"] == pytest.approx(1.0)  # one minibatch: old policy == current
    assert metrics["clip_fraction"] == 0.0
    assert metrics["importance_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["gen_kl/mean"] == pytest.approx(0.0, abs=1e-6)
    assert any(not torch.equal(before[k], v) for k, v in trainer.state_dict().items())


def test_several_minibatches_take_several_steps_against_the_old_policy(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = make_trainer(copy.deepcopy(model), micro_batch_size=4, minibatches_per_step=2, lr=1e-2)
    metrics = trainer.train_step(items, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert metrics["optimizer_steps"] == 2.0
    assert metrics["policy_ratio/max"] > 1.0  # the second minibatch sees the policy moved by the first


def test_nothing_to_train_takes_no_step(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    items = [CompletionTensors(x.token_ids, torch.zeros_like(x.loss_mask), x.generation_logprobs)
             for x in sample(model, tokenizer, 1.0, n=2)]
    trainer = make_trainer(copy.deepcopy(model))
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    metrics = trainer.train_step(items, torch.tensor([1.0, -1.0]))
    assert metrics["optimizer_steps"] == 0.0 and metrics["skipped_minibatches"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())  # bit-exact: no step, no arithmetic


def test_kl_needs_a_reference_and_is_reported(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    kl = ClippedPGLossConfig(kl_coef=0.1)
    with pytest.raises(ValueError, match="reference_model"):
        make_trainer(copy.deepcopy(model), loss=kl)
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = PolicyTrainer(
        copy.deepcopy(model), optimizer=OptimizerSettings(lr=1e-2), loss=kl, temperature=1.0,
        reference_model=copy.deepcopy(model),
    )
    first = trainer.train_step(items, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    second = trainer.train_step(items, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    assert first["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # identical to the reference at first
    assert second["kl/mean"] > 0.0


def test_refit_makes_the_backend_score_like_the_trainer(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = make_trainer(copy.deepcopy(model), lr=1e-2)
    trainer.train_step(items, torch.tensor([1.0, -1.0, 1.0, -1.0]))
    engine = copy.deepcopy(model)
    backend = HfGeneration(engine, tokenizer)
    backend.update_weights(trainer.state_dict())
    backend.shutdown()
    for key, value in trainer.state_dict().items():
        assert torch.equal(engine.state_dict()[key], value)  # bit-exact: update_weights copies, no arithmetic
    assert not torch.equal(engine.state_dict()["model.norm.weight"], model.state_dict()["model.norm.weight"])


def test_the_optimizer_is_fused_adamw_with_the_same_update(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = make_trainer(copy.deepcopy(model), lr=1e-2, weight_decay=0.1)
    assert trainer.optimizer.defaults["fused"] is True  # the CPU kernel, as TRL's default adamw_torch_fused
    reference = make_trainer(copy.deepcopy(model), lr=1e-2, weight_decay=0.1)
    reference.optimizer = torch.optim.AdamW(reference.parameters, lr=1e-2, weight_decay=0.1)  # the for-loop one
    named = {k: p for k, p in reference.model.named_parameters() if p.requires_grad}
    record = AdamRecord(reference.optimizer, named)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    trainer.train_step(items, advantages)
    reference.train_step(items, advantages)
    # the same forward and backward (equal gradients), two AdamW kernels: Adam's rule for two paths
    # (tests/tolerances.py) holds them, and more than rounding; a fused step with another lr or decay fails it
    fused = dict(trainer.model.named_parameters())
    power = assert_trained_weights_close({k: p.detach() for k, p in named.items()},
                                         {k: fused[k].detach() for k in named}, initial=record.initial,
                                         record=record.at(1), lr=1e-2)
    assert power > 0
    assert any(not torch.equal(p, record.initial[k]) for k, p in named.items())


def test_lr_zero_is_a_control_that_changes_no_weight(tiny_model_and_tokenizer):
    """optimizer.lr: 0 (bench/learning.py's control): the step computes the loss and gradients as any step does,
    but AdamW moves no weight (its step and its decoupled weight decay are both scaled by lr = 0)."""
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = make_trainer(copy.deepcopy(model), micro_batch_size=2, lr=0.0, weight_decay=0.1)
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    for _ in range(2):
        metrics = trainer.train_step(items, torch.tensor([1.0, -1.0, 1.0, -1.0]))
        assert metrics["optimizer_steps"] == 1.0 and metrics["grad_norm"] > 0.0  # a real step was taken
    # bit-exact: p - 0 * update is p in IEEE arithmetic (and p * (1 - 0 * wd) too)
    assert all(torch.equal(before[k], v) for k, v in trainer.state_dict().items())


@pytest.mark.parametrize("micro", [2, 3])
def test_zero_advantage_micro_batches_are_skipped_and_the_update_is_the_same(tiny_model_and_tokenizer, micro):
    """optimizer.skip_zero_advantage: a micro-batch whose every advantage is 0 adds exactly 0 to the gradient
    (every term of the loss is a multiple of the advantage when kl_coef is 0), so skipping its forward and backward
    leaves the update bit for bit the same as running it, over two Adam steps (the second with all-zero
    advantages: Adam's momentum still moves the weights, so the step must still be taken). With micro 3 the
    zero-advantage samples share a micro-batch with a trained one: that micro-batch runs. A step whose every
    micro-batch was skipped reports the same metric keys (0.0: measured over no trained token)."""
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=6)
    steps = [torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0]), torch.zeros(6)]
    runs = {}
    for skip in (False, True):
        trainer = make_trainer(copy.deepcopy(model), micro_batch_size=micro, skip_zero_advantage=skip)
        metrics = [trainer.train_step(items, adv) for adv in steps]
        runs[skip] = ({k: v.clone() for k, v in trainer.state_dict().items()}, metrics)
    (plain, plain_m), (skipped, skipped_m) = runs[False], runs[True]
    assert any(not torch.equal(plain[k], v) for k, v in model.state_dict().items())  # the steps moved weights
    assert all(torch.equal(plain[k], skipped[k]) for k in plain)  # the same kernels on the same inputs: bit-exact
    expect = [4.0 if micro == 2 else 0.0, 6.0]  # micro 2: [0,0] [1,-1] [0,0]; micro 3: [0,0,1] [-1,0,0]
    for p, s, n in zip(plain_m, skipped_m, expect, strict=True):
        assert s["zero_advantage_skipped"] == n and p["zero_advantage_skipped"] == 0.0
        assert set(s) == set(p)  # every metric reported, also on a step whose every micro-batch was skipped
        assert s["optimizer_steps"] == p["optimizer_steps"] == 1.0
        for key in ("num_tokens", "num_sequences", "loss", "grad_norm"):
            assert s[key] == p[key], key


def test_zero_advantage_micro_batches_run_when_the_loss_has_a_kl_term(tiny_model_and_tokenizer):
    """With kl_coef != 0 the KL penalty has a gradient whatever the advantage: nothing is skipped."""
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = PolicyTrainer(
        copy.deepcopy(model), optimizer=OptimizerSettings(lr=1e-2, micro_batch_size=2),
        loss=ClippedPGLossConfig(kl_coef=0.1), temperature=1.0, reference_model=copy.deepcopy(model),
    )
    trainer.train_step(items, torch.tensor([1.0, -1.0, 1.0, -1.0]))  # moves the policy away from its reference
    metrics = trainer.train_step(items, torch.zeros(4))
    assert metrics["zero_advantage_skipped"] == 0.0
    assert metrics["kl/mean"] > 0.0 and metrics["grad_norm"] > 0.0  # the KL term alone had a gradient


def test_a_step_whose_every_token_is_masked_trains_on_nothing_and_says_so(tiny_model_and_tokenizer, caplog):
    # icepop with a band no engine/trainer ratio of a sampled token is in (the ratio is ~1 here): every token
    # masked; with SGD the weights must not move, the loss is 0 (no NaN), and the step says so
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    loss = ClippedPGLossConfig(kl_coef=0.0, importance_sampling_correction=True, truncated_importance_sampling_type=
                               "icepop", truncated_importance_sampling_ratio=20.0,
                               truncated_importance_sampling_ratio_min=10.0)
    trainer = make_trainer(copy.deepcopy(model), loss=loss, micro_batch_size=2, max_grad_norm=None)
    trainer.optimizer = torch.optim.SGD(trainer.parameters, lr=1.0)
    start = {k: v.clone() for k, v in trainer.state_dict().items()}
    with caplog.at_level("WARNING"):
        metrics = trainer.train_step(items, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert metrics["is/masked_tokens"] == metrics["num_tokens"] > 0
    assert metrics["is/masked_sequences"] == metrics["num_sequences"] == 4.0
    assert metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    assert all(torch.equal(v, start[k]) for k, v in trainer.state_dict().items())
    assert "trained on nothing" in caplog.text


def test_kl_in_the_reward_trains_on_the_advantages_with_the_kl_subtracted(tiny_model_and_tokenizer):
    # Reinforce++ (use_kl_in_reward): the step must be the plain policy-gradient step (no KL term) on the
    # per-token advantages `kl_in_reward_advantages` makes from the trainer's and the reference's logprobs
    from nemo_rl_ext.objectives.kl_reward import kl_in_reward_advantages

    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    reference = copy.deepcopy(model)
    with torch.no_grad():  # a reference away from the policy, so the KL is not 0
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    advantages = torch.tensor([1.0, -0.5, 0.25, -0.75])
    loss = ClippedPGLossConfig(kl_coef=0.5, kl_estimator="k3", use_kl_in_reward=True)
    in_reward = PolicyTrainer(copy.deepcopy(model), optimizer=OptimizerSettings(lr=1e-3, minibatches_per_step=2),
                              loss=loss, temperature=1.0, pad_token_id=0, reference_model=reference)
    plain = make_trainer(copy.deepcopy(model), minibatches_per_step=2)
    tokens = kl_in_reward_advantages(advantages, [x.loss_mask for x in items], plain.logprobs(items),
                                     in_reward.reference_logprobs(items), loss)
    assert tokens.shape[0] == 4 and float(tokens.abs().sum()) > 0
    got, expected = in_reward.train_step(items, advantages), plain.train_step(items, tokens)
    assert got["loss/kl"] == 0.0 and got["kl/mean"] > 0.0  # no KL term; the KL is measured all the same
    # the same kernels on the same inputs (both take their old logprobs from a no-grad pass): equal to the bit
    assert {k: got[k] for k in expected} == expected
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in in_reward.state_dict().items())
    kept = make_trainer(copy.deepcopy(model), minibatches_per_step=2).train_step(items, advantages)
    assert kept["loss"] != got["loss"]  # the KL changed the advantages
