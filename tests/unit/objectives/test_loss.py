"""Clipped policy-gradient loss and loss masks: hand-computed values, clipping, KL, IS, masking, normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_ext.data.records import Completion, Message, StopReason
from nemo_rl_ext.objectives.loss import (
    ClippedPGLossConfig,
    build_loss_mask,
    clipped_pg_loss,
    completion_to_tensors,
    kl_penalty,
    pad_completion_tensors,
)

NO_IS = ClippedPGLossConfig(kl_coef=0.0)  # the policy-gradient term alone (the IS correction is off by default)
WITH_IS = ClippedPGLossConfig(kl_coef=0.0, importance_sampling_correction=True, importance_sampling_cap=2.0)


def one_token(ratio: float, advantage: float, config: ClippedPGLossConfig = NO_IS):
    """Loss and d loss / d logprob for a single token whose ratio pi/pi_old is `ratio`."""
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    loss, metrics = clipped_pg_loss(logprobs, old, torch.tensor([advantage]), torch.ones(1, 1), config)
    loss.backward()
    return loss.item(), logprobs.grad.item(), metrics


# ---- clipping -----------------------------------------------------------------------------------------


def test_positive_advantage_clipped_above() -> None:
    # A=+1, r=1.5: max(-1 * 1.5, -1 * clip(1.5, .8, 1.2)) = max(-1.5, -1.2) = -1.2 -> clipped, no gradient
    loss, grad, m = one_token(1.5, 1.0)
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert m["clip_fraction"] == 1.0 and m["clip_fraction/high"] == 1.0 and m["clip_fraction/low"] == 0.0
    assert m["policy_ratio/mean"] == pytest.approx(1.5)


def test_positive_advantage_not_clipped_below() -> None:
    # A=+1, r=0.5: max(-0.5, -0.8) = -0.5 -> unclipped; d(-r)/d logp = -r = -0.5
    loss, grad, m = one_token(0.5, 1.0)
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx(-0.5)
    assert m["clip_fraction"] == 0.0


def test_negative_advantage_clipped_below() -> None:
    # A=-1, r=0.5: max(0.5, 0.8) = 0.8 -> clipped at 1 - clip_low, no gradient
    loss, grad, m = one_token(0.5, -1.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert m["clip_fraction/low"] == 1.0 and m["clip_fraction/high"] == 0.0


def test_negative_advantage_not_clipped_above() -> None:
    # A=-1, r=1.5: max(1.5, 1.2) = 1.5 -> unclipped; d(r)/d logp = r = 1.5
    loss, grad, m = one_token(1.5, -1.0)
    assert loss == pytest.approx(1.5)
    assert grad == pytest.approx(1.5)
    assert m["clip_fraction"] == 0.0


def test_asymmetric_clip_higher() -> None:
    cfg = ClippedPGLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.0)
    # A=+1, r=1.25 < 1.28: unclipped -1.25 (with symmetric 0.2 it would be clipped to -1.2)
    assert one_token(1.25, 1.0, cfg)[0] == pytest.approx(-1.25)
    assert one_token(1.25, 1.0)[0] == pytest.approx(-1.2)
    # A=+1, r=1.5: clipped at 1.28
    assert one_token(1.5, 1.0, cfg)[0] == pytest.approx(-1.28)
    # low side is still 0.8: A=-1, r=0.5 -> 0.8
    assert one_token(0.5, -1.0, cfg)[0] == pytest.approx(0.8)


def test_dual_clip() -> None:
    cfg = ClippedPGLossConfig(clip_c=3.0, kl_coef=0.0)
    # A=-1, r=5: max(5, 1.2) = 5, dual clip min(5, -A * c = 3) = 3, no gradient
    loss, grad, m = one_token(5.0, -1.0, cfg)
    assert loss == pytest.approx(3.0) and grad == 0.0
    assert m["dual_clip_fraction"] == 1.0 and m["clip_fraction"] == 0.0
    # A=-1, r=2 < c: unaffected, 2
    loss, grad, m = one_token(2.0, -1.0, cfg)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0) and m["dual_clip_fraction"] == 0.0
    # A=+1, r=5: dual clip does not apply to positive advantages -> ordinary clip -1.2
    assert one_token(5.0, 1.0, cfg)[0] == pytest.approx(-1.2)
    # without dual clip the A=-1, r=5 loss is 5
    assert one_token(5.0, -1.0)[0] == pytest.approx(5.0)


# ---- KL -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        # k1 = log pi - log ref = log .5 - log .25 = log 2
        ("k1", math.log(2)),
        # k2 = (ref - pi)^2 / 2 = (log 2)^2 / 2
        ("k2", math.log(2) ** 2 / 2),
        # k3 = exp(ref - pi) - (ref - pi) - 1 = .5 - log .5 - 1 = log 2 - .5
        ("k3", math.log(2) - 0.5),
    ],
)
def test_kl_estimators(estimator: str, expected: float) -> None:
    cfg = ClippedPGLossConfig(kl_coef=0.1, kl_estimator=estimator, importance_sampling_correction=False)
    logprobs = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    # A = 0 and ratio 1 -> pg = 0; loss = 0.1 * kl
    loss, m = clipped_pg_loss(
        logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 1), cfg, reference_logprobs=ref
    )
    assert loss.item() == pytest.approx(0.1 * expected)
    assert m["kl/mean"] == pytest.approx(expected)
    assert m["loss/kl"] == pytest.approx(0.1 * expected) and m["loss/pg"] == 0.0
    assert m["loss"] == pytest.approx(m["loss/pg"] + m["loss/kl"])


@pytest.mark.parametrize("kl_gradient", ["score_function", "pathwise"])
def test_kl_term_is_not_importance_weighted(kl_gradient: str) -> None:
    # NeMo-RL's ClippedPGLossFn (token-level loss, use_on_policy_kl_approximation off):
    #   loss = masked_mean(w * clip_loss, mask) + beta * masked_mean(kl, mask),  w = exp(prev - gen) truncated
    # so the truncated IS weight multiplies only the policy-gradient term.
    cfg = ClippedPGLossConfig(
        kl_coef=0.1, kl_estimator="k1", importance_sampling_correction=True, importance_sampling_cap=2.0,
        kl_gradient=kl_gradient,
    )
    logprobs = torch.tensor([[math.log(0.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    old = logprobs.detach()  # ratio 1: clip_loss = -A
    gen = old - torch.tensor([[math.log(1.5), math.log(4.0)]], dtype=torch.float64)  # w = 1.5, min(4, 2) = 2
    ref = torch.tensor([[math.log(0.25), math.log(0.125)]], dtype=torch.float64)  # k1 = log 2, log 4
    loss, m = clipped_pg_loss(
        logprobs, old, torch.tensor([1.0]), torch.ones(1, 2), cfg, generation_logprobs=gen, reference_logprobs=ref
    )
    expected_pg = (1.5 * -1.0 + 2.0 * -1.0) / 2
    expected_kl = 0.1 * (math.log(2) + math.log(4)) / 2
    assert m["loss/pg"] == pytest.approx(expected_pg)
    assert m["loss/kl"] == pytest.approx(expected_kl)  # was 0.1 * (1.5 log 2 + 2 log 4) / 2 before
    assert loss.item() == pytest.approx(expected_pg + expected_kl)
    loss.backward()
    # d/d logp: pg = -w * A * r (r = exp(logp - old)) -> -w / 2 per token; k1 = logp - ref -> d k1 = 1, and the
    # score-function term adds k1 itself (the KL weight's value is 1 and unaffected by w either way)
    k1 = [math.log(2), math.log(4)]
    kl_grad = [0.1 * (1 + k) / 2 for k in k1] if kl_gradient == "score_function" else [0.1 / 2] * 2
    assert logprobs.grad[0].tolist() == pytest.approx([-1.5 / 2 + kl_grad[0], -2.0 / 2 + kl_grad[1]], rel=1e-12)


@pytest.mark.parametrize(
    ("estimator", "x", "clamps", "expected"),
    [
        # NeMo-RL calculate_kl: x = log ref - log pi; x = clamp(x, -in, in); k1 = -x, k2 = x^2 / 2,
        # k3 = exp(x) - 1 - x; kl = clamp(kl, -out, out)
        ("k3", -30.0, (None, None), math.exp(-30.0) - 1 + 30.0),
        ("k3", -30.0, (20.0, None), math.exp(-20.0) - 1 + 20.0),
        ("k3", -30.0, (20.0, 10.0), 10.0),  # NeMo-RL's defaults
        ("k3", 1.0, (20.0, 10.0), math.e - 2.0),  # inside both clamps: untouched
        ("k1", 30.0, (None, None), -30.0),
        ("k1", 30.0, (20.0, None), -20.0),
        ("k1", 30.0, (20.0, 10.0), -10.0),  # the output clamp is two-sided
        ("k2", -3.0, (None, None), 4.5),
        ("k2", -3.0, (2.0, None), 2.0),
        ("k2", -3.0, (None, 4.0), 4.0),
    ],
)
def test_kl_input_and_output_clamps(estimator: str, x: float, clamps: tuple, expected: float) -> None:
    in_clamp, out_clamp = clamps
    pi = torch.tensor([[-1.0]], dtype=torch.float64)
    assert kl_penalty(pi, pi + x, estimator, in_clamp, out_clamp).item() == pytest.approx(expected)
    cfg = ClippedPGLossConfig(
        kl_coef=0.5,
        kl_estimator=estimator,
        kl_input_clamp_value=in_clamp,
        kl_output_clamp_value=out_clamp,
        importance_sampling_correction=False,
    )
    lp = pi.clone().requires_grad_()
    loss, m = clipped_pg_loss(lp, pi, torch.zeros(1), torch.ones(1, 1), cfg, reference_logprobs=pi + x)
    assert m["kl/mean"] == pytest.approx(expected) and loss.item() == pytest.approx(0.5 * expected)
    loss.backward()
    clamped = (in_clamp is not None and abs(x) > in_clamp) or (out_clamp is not None and abs(expected) == out_clamp)
    assert (lp.grad.item() == 0.0) == clamped  # a clamped KL passes no gradient


def test_kl_clamp_defaults_are_nemo_rl_ones() -> None:
    cfg = ClippedPGLossConfig()
    assert (cfg.kl_input_clamp_value, cfg.kl_output_clamp_value) == (20.0, 10.0)
    pi = torch.zeros(1, 1)
    _, m = clipped_pg_loss(
        pi, pi, torch.zeros(1), torch.ones(1, 1), ClippedPGLossConfig(kl_coef=1.0, importance_sampling_correction=False),
        reference_logprobs=pi - 50.0,
    )
    assert m["kl/mean"] == pytest.approx(10.0)  # exp(-20) - 1 + 20 = 19.0..., clamped to 10


def test_kl_is_zero_when_policy_equals_reference() -> None:
    lp = torch.log(torch.tensor([[0.3, 0.6]]))
    for estimator in ("k1", "k2", "k3"):
        cfg = ClippedPGLossConfig(kl_coef=1.0, kl_estimator=estimator, importance_sampling_correction=False)
        _, m = clipped_pg_loss(lp, lp, torch.zeros(1), torch.ones(1, 2), cfg, reference_logprobs=lp)
        assert m["kl/mean"] == 0.0


# ---- importance sampling ------------------------------------------------------------------------------


def test_identical_logprobs_give_unit_ratio_and_weight() -> None:
    torch.manual_seed(0)
    lp = -torch.rand(3, 6, dtype=torch.float32) * 5
    mask = (torch.rand(3, 6) > 0.3).float()
    _, m = clipped_pg_loss(
        lp.clone().requires_grad_(), lp, torch.randn(3), mask, WITH_IS, generation_logprobs=lp.clone()
    )
    assert m["importance_ratio/mean"] == 1.0 and m["importance_ratio/max"] == 1.0
    assert m["is_weight/mean"] == 1.0 and m["is_weight/truncated_fraction"] == 0.0
    assert m["policy_ratio/mean"] == 1.0 and m["policy_ratio/max"] == 1.0
    assert m["clip_fraction"] == 0.0


def test_truncated_importance_weight() -> None:
    cfg = WITH_IS
    old = torch.zeros(1, 2)
    # token 0: exp(old - gen) = exp(log 3) = 3 -> truncated to 2; token 1: exp(log 1.5) = 1.5 -> kept
    gen = torch.tensor([[-math.log(3.0), -math.log(1.5)]])
    logprobs = old.clone().requires_grad_()
    loss, m = clipped_pg_loss(
        logprobs, old, torch.tensor([1.0]), torch.ones(1, 2), cfg, generation_logprobs=gen
    )
    # ratio 1, A=1: pg = -1 per token; weighted -2 and -1.5; token mean = -1.75
    assert loss.item() == pytest.approx(-1.75)
    assert m["importance_ratio/max"] == pytest.approx(3.0)
    assert m["importance_ratio/mean"] == pytest.approx(2.25)
    assert m["is_weight/mean"] == pytest.approx(1.75)
    assert m["is_weight/truncated_fraction"] == 0.5
    loss.backward()
    # the weight is detached: d/dlogp (-w * r) = -w * r = -w, divided by 2 tokens
    assert logprobs.grad[0].tolist() == pytest.approx([-1.0, -0.75])


def test_importance_weight_is_untruncated_by_default() -> None:
    # NeMo-RL's default with the correction on: truncated_importance_sampling_type null, so w = exp(prev - gen)
    cfg = ClippedPGLossConfig(kl_coef=0.0, importance_sampling_correction=True)
    assert cfg.importance_sampling_cap is None
    old = torch.zeros(1, 2, dtype=torch.float64)
    gen = torch.tensor([[-math.log(3.0), -math.log(1.5)]], dtype=torch.float64)
    loss, m = clipped_pg_loss(old.clone(), old, torch.tensor([1.0]), torch.ones(1, 2), cfg, generation_logprobs=gen)
    assert loss.item() == pytest.approx(-(3.0 + 1.5) / 2, rel=1e-12)
    assert m["is_weight/mean"] == pytest.approx(2.25) and m["is_weight/truncated_fraction"] == 0.0


def test_importance_sampling_needs_generation_logprobs() -> None:
    with pytest.raises(ValueError, match="generation_logprobs"):
        clipped_pg_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), WITH_IS)


# ---- masking and normalisation ------------------------------------------------------------------------


def test_masked_tokens_get_exactly_zero_gradient() -> None:
    torch.manual_seed(1)
    base = -torch.rand(4, 7, dtype=torch.float64) * 3
    mask = torch.tensor(
        [[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 0, 1]]
    )
    base = torch.where(mask.bool(), base, torch.full_like(base, -math.inf))  # garbage where masked
    logprobs = base.clone().requires_grad_()
    old = torch.where(mask.bool(), base + 0.05 * torch.randn_like(base), base)
    gen = old - 0.1
    ref = old + 0.2
    for normalization in ("token", "sequence"):
        cfg = ClippedPGLossConfig(
            clip_c=3.0, kl_coef=0.05, normalization=normalization, importance_sampling_correction=True,
            importance_sampling_cap=2.0, on_policy_kl_approximation=True,
        )
        logprobs.grad = None
        loss, m = clipped_pg_loss(
            logprobs,
            old,
            torch.tensor([1.0, -0.5, 2.0, -1.0]),
            mask,
            cfg,
            generation_logprobs=gen,
            reference_logprobs=ref,
        )
        loss.backward()
        assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in m.values())
        grad = logprobs.grad
        assert bool(torch.isfinite(grad).all())
        assert bool((grad[mask == 0] == 0).all())
        assert bool((grad[mask == 1] != 0).any())
        assert m["num_tokens"] == 13.0 and m["num_sequences"] == 3.0


def test_token_vs_sequence_normalization_on_uneven_lengths() -> None:
    # seq 0: 1 token, A=+1 -> token loss -1; seq 1: 3 tokens, A=-1 -> token loss +1 (ratio 1)
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    token, _ = clipped_pg_loss(lp, lp, adv, mask, NO_IS)
    seq, _ = clipped_pg_loss(
        lp, lp, adv, mask, ClippedPGLossConfig(normalization="sequence", kl_coef=0.0)
    )
    assert token.item() == pytest.approx((-1 + 3 * 1) / 4)  # 0.5
    assert seq.item() == pytest.approx((-1 + 1) / 2)  # 0.0


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_global_normalization_count_makes_micro_batches_add_up(normalization: str) -> None:
    torch.manual_seed(2)
    cfg = ClippedPGLossConfig(
        normalization=normalization, kl_coef=0.1, clip_c=2.5, importance_sampling_correction=True,
        importance_sampling_cap=2.0, on_policy_kl_approximation=True,
    )
    lp = (-torch.rand(4, 5, dtype=torch.float64) * 2).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(4, 5, dtype=torch.float64)
    gen, ref = old - 0.2, old + 0.1
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    full, _ = clipped_pg_loss(lp, old, adv, mask, cfg, generation_logprobs=gen, reference_logprobs=ref)
    (full_grad,) = torch.autograd.grad(full, lp)
    count = float(mask.sum()) if normalization == "token" else 4.0
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 1), slice(1, 4)):
        part, _ = clipped_pg_loss(
            lp[rows],
            old[rows],
            adv[rows],
            mask[rows],
            cfg,
            generation_logprobs=gen[rows],
            reference_logprobs=ref[rows],
            global_normalization_count=count,
        )
        total = total + part
    (acc_grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(acc_grad, full_grad, atol=1e-12)


def test_all_masked_batch_gives_zero_loss() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, m = clipped_pg_loss(lp, lp.detach(), torch.ones(2), torch.zeros(2, 3), NO_IS)
    loss.backward()
    assert loss.item() == 0.0 and m["num_tokens"] == 0.0 and m["clip_fraction"] == 0.0
    assert lp.grad.abs().sum().item() == 0.0


def test_invalid_config_and_shapes() -> None:
    with pytest.raises(ValueError, match="clip_low") as err:
        ClippedPGLossConfig(clip_low=1.0, clip_c=0.5)
    assert "clip_c" in str(err.value)  # every problem at once
    with pytest.raises(ValueError, match="kl_estimator"):
        ClippedPGLossConfig(kl_estimator="k4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kl_input_clamp_value") as err:
        ClippedPGLossConfig(kl_input_clamp_value=0.0, kl_output_clamp_value=-1.0)
    assert "kl_output_clamp_value" in str(err.value)
    with pytest.raises(ValueError, match="normalization"):
        ClippedPGLossConfig(normalization="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reference_logprobs"):
        clipped_pg_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.zeros(1),
            torch.ones(1, 2),
            ClippedPGLossConfig(kl_coef=0.1, importance_sampling_correction=False),
        )
    with pytest.raises(ValueError, match="mask"):
        clipped_pg_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 3), NO_IS)
    with pytest.raises(ValueError, match="advantages"):
        clipped_pg_loss(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(3), torch.ones(2, 2), NO_IS)


# ---- loss masks from completions ----------------------------------------------------------------------


def _completion(stop: StopReason = StopReason.NATURAL, truncated: bool = False) -> Completion:
    log = (
        Message("system", "s", (1, 2)),
        Message("user", "q", (3, 4, 5)),
        Message("assistant", "a1", (6, 7, 8), (-0.1, -0.2, -0.3)),
        Message("tool", "t", (9, 10)),
        Message("assistant", "a2", (11, 12), (-0.4, -0.5)),
    )
    return Completion(log, 1.0, truncated, stop, 2, "agent", {}, "boom" if stop == StopReason.ERROR else None)


def test_build_loss_mask_marks_generated_assistant_tokens() -> None:
    c = _completion()
    assert build_loss_mask(c).tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert build_loss_mask(c).dtype == torch.float32
    assert len(build_loss_mask(c)) == len(c.token_ids)


def test_build_loss_mask_errors_and_truncation() -> None:
    assert build_loss_mask(_completion(StopReason.ERROR)).tolist() == [0] * 12
    truncated = _completion(StopReason.TRUNCATED, truncated=True)
    assert build_loss_mask(truncated, overlong_filtering=True).tolist() == [0] * 12
    assert build_loss_mask(truncated, overlong_filtering=False).sum().item() == 5


def test_build_loss_mask_few_shot_assistant_in_prompt() -> None:
    log = (
        Message("user", "q", (1,)),
        Message("assistant", "shot", (2, 3)),
        Message("user", "q2", (4,)),
        Message("assistant", "a", (5,), (-0.1,)),
    )
    c = Completion(log, 0.0, False, StopReason.NATURAL, 1, "agent")
    assert build_loss_mask(c).tolist() == [0, 0, 0, 0, 1]
    assert build_loss_mask(c, only_generated=False).tolist() == [0, 1, 1, 0, 1]


def test_completion_to_tensors_and_padding() -> None:
    c = _completion()
    t = completion_to_tensors(c)
    assert t.token_ids.tolist() == list(range(1, 13)) and t.token_ids.dtype == torch.int64
    assert t.generation_logprobs.tolist() == pytest.approx(
        [0, 0, 0, 0, 0, -0.1, -0.2, -0.3, 0, 0, -0.4, -0.5]
    )
    assert t.loss_mask.tolist() == build_loss_mask(c).tolist()
    short = completion_to_tensors(
        Completion(
            (Message("user", "q", (1,)), Message("assistant", "a", (2,), (-1.0,))),
            0.0,
            False,
            StopReason.NATURAL,
            1,
            "agent",
        )
    )
    ids, mask, gen = pad_completion_tensors([t, short], pad_token_id=-7)
    assert ids.shape == mask.shape == gen.shape == (2, 12)
    assert ids[1].tolist() == [1, 2] + [-7] * 10
    assert mask[1].tolist() == [0, 1] + [0] * 10
    # the engine's own logprobs as trainer logprobs: ratio and IS weight are exactly 1
    _, m = clipped_pg_loss(gen, gen, torch.tensor([1.0, -1.0]), mask, WITH_IS, generation_logprobs=gen)
    assert m["importance_ratio/max"] == 1.0 and m["is_weight/mean"] == 1.0 and m["num_tokens"] == 6.0
