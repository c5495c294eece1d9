"""The in-process trainer's memory savers (`trainer.lora`, `trainer.activation_checkpointing`,
`trainer.mixed_precision: bf16`) on the tiny model: what trains, what the engine gets, and that each computes
the update it replaces (to a tolerance stated per test)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_grpo_trainer import sample
from tolerances import ENGINE_LOGPROBS, GRADIENT_OF_LARGEST, SAME_MODEL_LOGPROBS

from nemo_rl_ext.models.generation.hf_backend import HfGeneration
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig
from nemo_rl_ext.training.config import LoraSettings, OptimizerSettings
from nemo_rl_ext.training.lora import (
    adaptable_modules,
    lora_modules,
    lora_target_problem,
    merged_state_dict,
    with_lora,
)
from nemo_rl_ext.training.trainer import PolicyTrainer

NO_IS = ClippedPGLossConfig(kl_coef=0.0)
ADVANTAGES = torch.tensor([1.0, -0.5, 2.0, -0.25])  # a nonzero loss: completions have equal lengths


def trainer_for(model, loss=NO_IS, lr=1e-2, **kwargs) -> PolicyTrainer:
    return PolicyTrainer(model, optimizer=OptimizerSettings(lr=lr), loss=loss, temperature=1.0, **kwargs)


def sgd_gradient(trainer: PolicyTrainer, items) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One train_step with SGD at lr 1 (no clipping): (metrics, -gradient of every trainable weight)."""
    trainer.settings = trainer.settings.model_copy(update={"max_grad_norm": None})
    trainer.optimizer = torch.optim.SGD(trainer.parameters, lr=1.0)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    before = {names[id(p)]: p.detach().clone() for p in trainer.parameters}
    metrics = trainer.train_step(items, ADVANTAGES)
    return metrics, {names[id(p)]: p.detach() - before[names[id(p)]] for p in trainer.parameters}


def assert_same_gradients(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], factor: float) -> None:
    scale = max(float(g.abs().max()) for g in expected.values())
    assert scale > 1e-3  # the comparison is not between zeros
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=factor * scale, rtol=0, msg=key)


# ---- LoRA ---------------------------------------------------------------------------------------


def test_lora_target_modules_the_model_lacks_are_named_with_those_it_has(tiny_model_dir):
    available = adaptable_modules(tiny_model_dir)  # from config.json, built on the meta device
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= set(available)
    assert lora_target_problem(LoraSettings(), tiny_model_dir) is None
    problem = lora_target_problem(LoraSettings(target_modules=("q_proj", "qkv_proj", "c_attn")), tiny_model_dir)
    assert problem is not None
    assert "qkv_proj, c_attn" in problem and "q_proj, up_proj, v_proj" in problem


def test_lora_trains_the_adapters_alone(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    policy = with_lora(copy.deepcopy(model), LoraSettings(r=4, target_modules=("q_proj", "v_proj")))
    trainer = trainer_for(policy)
    adapters = [p for n, p in policy.named_parameters() if ".lora_" in n]
    assert len(adapters) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in held} == {id(p) for p in adapters}
    for _ in range(2):
        assert trainer.train_step(items, ADVANTAGES)["optimizer_steps"] == 1.0
    assert len(trainer.optimizer.state) == len(adapters)
    weights = trainer.state_dict()
    assert set(weights) == set(model.state_dict())  # the engine's names, no peft names
    changed = []
    for key, value in model.state_dict().items():
        if key.endswith(("q_proj.weight", "v_proj.weight")):
            changed.append(not torch.equal(weights[key], value))
        else:  # bit-exact: frozen, never touched by the optimizer
            assert torch.equal(weights[key], value), key
    assert len(changed) == 4 and all(changed)


def test_lora_refit_hands_over_merged_target_modules_without_a_second_copy(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    policy = with_lora(copy.deepcopy(model), LoraSettings(r=4, alpha=8, target_modules=("q_proj", "down_proj")))
    trainer = trainer_for(policy, lr=3e-2)
    for _ in range(3):
        trainer.train_step(items, ADVANTAGES)
    weights = trainer.state_dict()
    base = {k.replace(".base_layer.", "."): v for k, v in policy.get_base_model().state_dict().items()}
    targets = {f"{name}.weight" for name in lora_modules(policy)}
    assert len(targets) == 4
    for key, value in weights.items():
        # the frozen tensors are the trainer's own storage; only the merged target modules are new tensors
        assert (value.data_ptr() == base[key].data_ptr()) == (key not in targets), key
    # a refit sends the merged target modules alone: the engine's other tensors are the base model's already
    refit = trainer.refit_weights()
    assert trainer.refit_partial and set(refit) == targets
    full_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert sum(t.numel() * t.element_size() for t in refit.values()) < full_bytes / 4
    engine = copy.deepcopy(model)
    untouched = {k: v.clone() for k, v in engine.state_dict().items() if k not in targets}
    backend = HfGeneration(engine, tokenizer)
    assert backend.accepts_partial_update
    with pytest.raises(ValueError, match="lacks"):  # without partial=True a subset is refused
        backend.update_weights(refit)
    with pytest.raises(ValueError, match=r"partial=True.*no weights named \['model.nope'\]"):
        backend.update_weights({**refit, "model.nope": refit[next(iter(targets))]}, partial=True)
    backend.update_weights(refit, partial=True)
    assert backend.weight_version == 1
    backend.shutdown()
    for key, value in engine.state_dict().items():
        if key in targets:
            assert torch.equal(value, refit[key]), key
        else:
            assert torch.equal(value, untouched[key]), key
    scored = sample(engine, tokenizer, 1.0, n=4, seed=3)
    for item, lp in zip(scored, trainer.logprobs(scored), strict=True):
        on = item.loss_mask.bool()
        # the engine runs W + s*B@A; the trainer W x + s*B(A x): equal up to float32 rounding (ENGINE_LOGPROBS)
        torch.testing.assert_close(lp[on], item.generation_logprobs[on], **ENGINE_LOGPROBS)
    moved = [float((weights[k] - model.state_dict()[k]).abs().max()) for k in targets]
    assert min(moved) > 1e-3  # the adapters moved the merged weights: the check above would see a stale merge


def test_a_lora_refit_makes_one_merged_module_at_a_time_as_the_engine_reads_it(tiny_model_and_tokenizer):
    """The engine copies a partial update tensor by tensor; the refit makes each merged weight when asked and drops
    the one before, so no copy of every target module exists at once (counted with weak references)."""
    import weakref

    model, tokenizer = tiny_model_and_tokenizer
    policy = with_lora(copy.deepcopy(model), LoraSettings(r=4, target_modules=("q_proj", "v_proj", "down_proj")))
    trainer = trainer_for(policy)
    trainer.train_step(sample(model, tokenizer, 1.0, n=4), ADVANTAGES)
    refit = trainer.refit_weights()
    made: list[weakref.ref] = []
    alive_at_fetch: list[int] = []
    fetch = refit._fetch

    def counted(names):
        alive_at_fetch.append(sum(1 for ref in made if ref() is not None))
        out = fetch(names)
        made.extend(weakref.ref(t) for t in out.values())
        return out

    refit._fetch = counted
    backend = HfGeneration(copy.deepcopy(model), tokenizer)
    backend.update_weights(refit, partial=True)
    engine = backend.model.state_dict()
    backend.shutdown()
    assert refit.fetches == len(refit) == 6  # 2 layers x 3 targets, one module per bucket
    assert alive_at_fetch == [0] * 6  # each bucket was gone before the next was made
    assert refit.nbytes == sum(engine[k].numel() * engine[k].element_size() for k in refit)
    expected = merged_state_dict(policy)
    for name in refit:
        assert torch.equal(engine[name], expected[name]), name


def test_lora_kl_reference_is_the_policy_with_its_adapters_disabled(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    policy = with_lora(copy.deepcopy(model), LoraSettings(r=4))
    kl = ClippedPGLossConfig(kl_coef=0.1)
    trainer = trainer_for(policy, loss=kl)
    assert trainer.reference_model is None
    # one model's parameters in all: the base weights and the adapters, no reference copy
    held = {id(p) for p in trainer.model.parameters()}
    assert sum(p.numel() for p in trainer.model.parameters()) == sum(
        p.numel() for p in model.parameters()
    ) + sum(p.numel() for n, p in policy.named_parameters() if ".lora_" in n)
    assert len(held) == len(list(trainer.model.parameters()))
    first = trainer.train_step(items, ADVANTAGES)
    second = trainer.train_step(items, ADVANTAGES)
    assert first["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # B = 0 at first: the policy is the base model
    assert second["kl/mean"] > 1e-6
    base_lp = trainer_for(copy.deepcopy(model)).logprobs(items)
    for got, expected in zip(trainer.reference_logprobs(items), base_lp, strict=True):
        torch.testing.assert_close(got, expected, **SAME_MODEL_LOGPROBS)  # the same weights by another path
    moved = trainer.logprobs(items)
    assert max(float((a - b).abs().max()) for a, b in zip(moved, base_lp, strict=True)) > 1e-4
    with pytest.raises(ValueError, match="own reference"):
        trainer_for(with_lora(copy.deepcopy(model), LoraSettings(r=4)), loss=kl, reference_model=model)


# ---- activation checkpointing -------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True])
def test_activation_checkpointing_computes_the_same_update(tiny_model_and_tokenizer, lora):
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)

    def policy():
        fresh = copy.deepcopy(model)
        return with_lora(fresh, LoraSettings(r=4)) if lora else fresh

    torch.manual_seed(0)
    plain = trainer_for(policy())
    torch.manual_seed(0)  # the same adapter initialisation
    checkpointed = trainer_for(policy(), activation_checkpointing=True)
    def layers_checkpoint(trainer) -> list[bool]:  # the layers' own flag: the same in every transformers 5.x
        inner = trainer.model.get_base_model() if lora else trainer.model
        return [layer.gradient_checkpointing for layer in inner.model.layers]

    assert all(layers_checkpoint(checkpointed)) and not any(layers_checkpoint(plain))
    if lora:  # B = 0 gives A no gradient on the first step: one step first, on both
        plain.train_step(items, ADVANTAGES)
        checkpointed.train_step(items, ADVANTAGES)
    calls = {id(plain): 0, id(checkpointed): 0}

    def counting(trainer):  # counts calls of the first layer's MLP (module hooks do not run in the recompute)
        mlp = (trainer.model.get_base_model() if lora else trainer.model).model.layers[0].mlp
        forward = mlp.forward

        def counted(*args, **kwargs):
            calls[id(trainer)] += 1
            return forward(*args, **kwargs)

        mlp.forward = counted

    counting(plain), counting(checkpointed)
    expected_metrics, expected = sgd_gradient(plain, items)
    metrics, got = sgd_gradient(checkpointed, items)
    assert calls[id(checkpointed)] == 2 * calls[id(plain)]  # the backward pass recomputed the layer
    # the same weights and kernels; where prompts repeat, the run without checkpointing shares their KV cache
    # (another matmul shape), so they agree to float32 rounding (GRADIENT_OF_LARGEST)
    assert abs(expected_metrics["loss"]) > 1e-2
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=1e-5, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=1e-5)
    assert_same_gradients(got, expected, GRADIENT_OF_LARGEST)


# ---- bf16 mixed precision -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def soft_model_and_tokenizer(tmp_path_factory):
    """The tiny Qwen2 with initializer_range 0.05 (the GRPO tests' model): logits of size ~2.5, as a trained LM's
    scaled-down ones. The default tiny model (0.3) has logits up to 15 whose bf16 errors its large weights
    amplify through the layers (measured: 0.31 on a logprob), a regime no real checkpoint is in."""
    from nemo_rl_ext.models.loading import load_model_and_tokenizer
    from nemo_rl_ext.models.tiny import build_tiny_model

    return load_model_and_tokenizer(build_tiny_model(tmp_path_factory.mktemp("soft"), seed=0, initializer_range=0.05))


def test_bf16_keeps_float32_weights_and_gradients_and_stays_close_to_float32(soft_model_and_tokenizer):
    model, tokenizer = soft_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    full = trainer_for(copy.deepcopy(model))
    mixed = trainer_for(copy.deepcopy(model), mixed_precision="bf16")
    grad_dtypes = set()
    for p in mixed.parameters:
        p.register_hook(lambda g: grad_dtypes.add(g.dtype))
    lp32, lp16 = full.logprobs(items), mixed.logprobs(items)
    # bf16 keeps 8 significant bits: each matmul input is rounded to within 2**-9 and each stored activation
    # is one ulp (2**-8 = 3.9e-3) coarse. A logprob (logit - logsumexp, logits ~2.5) after 2 decoder layers
    # carries a few such errors: measured at most 9.4e-3 absolute on logprobs of -6 to -8 (1.5e-3 relative).
    # Tolerance: rtol 1.6e-2 (4 bf16 ulps) + atol 2e-2, 4x and more above what was measured; a float32 path
    # would agree to 1e-5 (SAME_MODEL_LOGPROBS) and a wrong token or weight moves a logprob by far more.
    bf16_logprobs = {"rtol": 1.6e-2, "atol": 2e-2}
    differ = False
    for a, b, item in zip(lp16, lp32, items, strict=True):
        on = item.loss_mask.bool()
        torch.testing.assert_close(a[on], b[on], **bf16_logprobs)
        differ |= not torch.equal(a[on], b[on])
    assert differ  # the forward really ran in bf16
    expected_metrics, expected = sgd_gradient(full, items)
    metrics, got = sgd_gradient(mixed, items)
    assert grad_dtypes == {torch.float32}
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert abs(expected_metrics["loss"]) > 1e-2
    assert metrics["loss"] == pytest.approx(expected_metrics["loss"], rel=5e-2, abs=5e-3)
    # gradients: sums over many bf16 products, measured 1.0e-2 of the largest entry apart; tolerance 5e-2 of it
    # (13 bf16 ulps, 5x the measured); a float32 path agrees to 1e-4 (GRADIENT_OF_LARGEST)
    assert_same_gradients(got, expected, 5e-2)
    with pytest.raises(ValueError, match="float32 master weights"):
        trainer_for(copy.deepcopy(model).to(torch.bfloat16), mixed_precision="bf16")


def test_lora_on_tied_word_embeddings_is_refused(tiny_model_dir):
    problem = lora_target_problem(LoraSettings(target_modules=("q_proj", "lm_head")), tiny_model_dir)
    assert problem is not None and "lm_head" in problem and "ties its word embeddings" in problem
