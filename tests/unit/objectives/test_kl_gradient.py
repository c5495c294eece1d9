"""The KL term's gradient, checked against the formula written out here (never against our own outputs).

NeMo-RL's `ClippedPGLossFn` (PR #2506, June 2026) multiplies the per-token KL estimate by
u = exp(logp - sg(logp)): the value is unchanged (u = 1), but since the token was sampled from the policy
being trained, the gradient gains the score-function term:

    d/dlogp [beta * u * k(x)] / N = beta * (k(x) + dk/dlogp) / N,      x = log ref - logp,

where ours was beta * (dk/dlogp) / N before (`kl_gradient: pathwise` keeps it). With NeMo-RL's
`use_on_policy_kl_approximation` the weight is u = exp(logp - gen) instead (value pi / pi_gen).
Float64 throughout, so tolerances are relative (1e-9 or tighter) plus a tiny absolute floor.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, clipped_pg_loss, kl_penalty, kl_weight

RTOL, ATOL = 1e-9, 1e-12


def estimator(name: str, x: torch.Tensor) -> torch.Tensor:
    """Schulman's estimators of KL(pi || ref) at x = log ref - log pi, written out afresh."""
    return {"k1": -x, "k2": 0.5 * x * x, "k3": torch.exp(x) - x - 1.0}[name]


def estimator_grad(name: str, x: torch.Tensor) -> torch.Tensor:
    """d k / d logp (= -dk/dx), by hand."""
    return {"k1": torch.ones_like(x), "k2": -x, "k3": 1.0 - torch.exp(x)}[name]


def kl_only_gradient(cfg: ClippedPGLossConfig, lp, old, gen, ref, adv=None, mask=None) -> torch.Tensor:
    """d loss / d logprobs of `clipped_pg_loss` minus that of the same call with kl_coef 0: the KL term's share."""
    adv = torch.zeros(lp.shape[0], dtype=lp.dtype) if adv is None else adv
    mask = torch.ones_like(lp) if mask is None else mask
    grads = []
    for coef in (cfg.kl_coef, 0.0):
        x = lp.detach().clone().requires_grad_(True)
        c = dataclasses.replace(cfg, kl_coef=coef)
        loss, _ = clipped_pg_loss(x, old, adv, mask, c, generation_logprobs=gen, reference_logprobs=ref)
        loss.backward()
        grads.append(x.grad)
    return grads[0] - grads[1]


# ---- the numbers in the issue -------------------------------------------------------------------------------


def test_the_issue_example_gives_nemo_rl_gradient_by_default() -> None:
    """kl_coef 0.3, no IS correction, current [-1.2, -0.7], previous = generation [-1.0, -0.8], A = 0, mask 1,
    reference [-0.9, -1.1]: NeMo-RL's gradient [-0.0450, 0.0600]; ours was [-0.0525, 0.0495]."""
    beta, n = 0.3, 2
    cur = torch.tensor([[-1.2, -0.7]], dtype=torch.float64)
    prev = torch.tensor([[-1.0, -0.8]], dtype=torch.float64)
    ref = torch.tensor([[-0.9, -1.1]], dtype=torch.float64)
    x = ref - cur  # [0.3, -0.4]
    # k3 + dk3/dlogp = (e^x - x - 1) + (1 - e^x) = -x: the score-function gradient is beta * (logp - ref) / N
    expected = beta * (estimator("k3", x) + estimator_grad("k3", x)) / n
    expected_pathwise = beta * estimator_grad("k3", x) / n
    for cfg, want, printed in (
        (ClippedPGLossConfig(kl_coef=beta), expected, [-0.0450, 0.0600]),
        (ClippedPGLossConfig(kl_coef=beta, kl_gradient="pathwise"), expected_pathwise, [-0.0525, 0.0495]),
    ):
        assert cfg.importance_sampling_correction is False  # the default, as the issue's example has it
        lp = cur.clone().requires_grad_(True)
        loss, m = clipped_pg_loss(
            lp, prev, torch.zeros(1, dtype=torch.float64), torch.ones(1, 2), cfg,
            generation_logprobs=prev, reference_logprobs=ref,
        )
        loss.backward()
        torch.testing.assert_close(lp.grad, want, rtol=RTOL, atol=ATOL)
        # the issue's figures are rounded to 4 decimals: within half a unit of the last one
        torch.testing.assert_close(lp.grad, torch.tensor([printed], dtype=torch.float64), rtol=0, atol=5e-5)
        # the forward value is the same either way: beta * mean(k3)
        assert loss.item() == pytest.approx(beta * float(estimator("k3", x).mean()), rel=RTOL)
        assert m["kl/mean"] == pytest.approx(float(estimator("k3", x).mean()), rel=RTOL)
    torch.testing.assert_close(expected, torch.tensor([[-0.045, 0.06]], dtype=torch.float64), rtol=1e-12, atol=0)


# ---- a hand-written reference and finite differences ----------------------------------------------------------


def random_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3 - 0.05
    ref = lp + 0.8 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    gen = lp + 0.3 * torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.float64)
    return lp, ref, gen, mask


def reference_surrogate(lp, lp0, ref, gen, mask, beta, name, normalization, on_policy) -> torch.Tensor:
    """beta * reduce(u * k(ref - lp)) with u = exp(lp - lp0) (or exp(lp - gen)); lp0 a constant, so autograd and
    finite differences of this function give the score-function gradient at lp = lp0."""
    u = torch.exp(lp - (gen if on_policy else lp0))
    per_token = u * estimator(name, ref - lp) * mask
    if normalization == "token":
        return beta * per_token.sum() / mask.sum()
    seq = per_token.sum(-1) / mask.sum(-1)
    return beta * seq.mean()


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
@pytest.mark.parametrize("normalization", ["token", "sequence"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_gradient_equals_a_hand_written_reference_and_finite_differences(name, normalization, on_policy) -> None:
    lp, ref, gen, mask = random_batch(7)
    beta = 0.25
    cfg = ClippedPGLossConfig(
        kl_coef=beta, kl_estimator=name, normalization=normalization, on_policy_kl_approximation=on_policy,
        kl_input_clamp_value=None, kl_output_clamp_value=None,
    )
    ours = kl_only_gradient(cfg, lp, lp.detach(), gen, ref, mask=mask)

    x = lp.clone().requires_grad_(True)
    reference_surrogate(x, lp, ref, gen, mask, beta, name, normalization, on_policy).backward()
    torch.testing.assert_close(ours, x.grad, rtol=RTOL, atol=ATOL)

    h = 1e-6  # central differences of the same surrogate, one coordinate at a time
    fd = torch.zeros_like(lp)
    for idx in torch.nonzero(torch.ones_like(lp)):
        i, j = int(idx[0]), int(idx[1])
        e = torch.zeros_like(lp)
        e[i, j] = h
        up = reference_surrogate(lp + e, lp, ref, gen, mask, beta, name, normalization, on_policy)
        down = reference_surrogate(lp - e, lp, ref, gen, mask, beta, name, normalization, on_policy)
        fd[i, j] = (up - down) / (2 * h)
    torch.testing.assert_close(ours, fd, rtol=1e-6, atol=1e-9)  # O(h^2) truncation and float64 rounding
    assert bool((ours[mask == 0] == 0).all()) and bool((ours[mask == 1] != 0).all())


@pytest.mark.parametrize("on_policy", [False, True])
def test_nemo_rl_kl_gradient_test_case(on_policy: bool) -> None:
    """NeMo-RL's test_clipped_pg_loss_kl_gradient_includes_sampling_term inputs: the KL share of the gradient is
    beta * u * (k3 + dk3/dlogp) / N, u = 1, or pi / pi_gen with the on-policy approximation."""
    cur = torch.tensor([[-1.2, -0.7]], dtype=torch.float64)
    prev = torch.tensor([[-1.0, -0.8]], dtype=torch.float64)
    gen = torch.tensor([[-1.5, -0.4]], dtype=torch.float64)
    ref = torch.tensor([[-0.9, -1.1]], dtype=torch.float64)
    adv = torch.tensor([[0.4, -0.2]], dtype=torch.float64)
    beta = 0.3
    x = ref - cur
    u = torch.exp(cur - gen) if on_policy else torch.ones_like(cur)
    expected = beta * u * (estimator("k3", x) + estimator_grad("k3", x)) / cur.numel()
    for correction in (False, True):  # the IS correction weights the pg term only: the KL share is the same
        cfg = ClippedPGLossConfig(kl_coef=beta, on_policy_kl_approximation=on_policy,
                                  importance_sampling_correction=correction)
        got = kl_only_gradient(cfg, cur, prev, gen, ref, adv=adv)
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    pathwise = ClippedPGLossConfig(kl_coef=beta, on_policy_kl_approximation=on_policy, kl_gradient="pathwise")
    got = kl_only_gradient(pathwise, cur, prev, gen, ref, adv=adv)
    torch.testing.assert_close(got, beta * u * estimator_grad("k3", x) / cur.numel(), rtol=RTOL, atol=ATOL)


def test_on_policy_approximation_weights_the_kl_value() -> None:
    cur = torch.tensor([[-1.2, -0.7]], dtype=torch.float64)
    gen = torch.tensor([[-1.5, -0.4]], dtype=torch.float64)
    ref = torch.tensor([[-0.9, -1.1]], dtype=torch.float64)
    cfg = ClippedPGLossConfig(kl_coef=0.3, on_policy_kl_approximation=True)
    loss, m = clipped_pg_loss(cur, cur, torch.zeros(1), torch.ones(1, 2), cfg, generation_logprobs=gen,
                              reference_logprobs=ref)
    weighted = torch.exp(cur - gen) * estimator("k3", ref - cur)
    assert m["kl/mean"] == pytest.approx(float(weighted.mean()), rel=RTOL)
    assert loss.item() == pytest.approx(0.3 * float(weighted.mean()), rel=RTOL)
    with pytest.raises(ValueError, match="on_policy_kl_approximation needs generation_logprobs"):
        clipped_pg_loss(cur, cur, torch.zeros(1), torch.ones(1, 2), cfg, reference_logprobs=ref)


# ---- what each gradient estimates: exact expectations over a categorical policy ------------------------------


def expected_kl_gradient(cfg: ClippedPGLossConfig, theta: torch.Tensor, log_ref: torch.Tensor) -> torch.Tensor:
    """E_{a ~ pi}[d loss(a) / d theta] for a one-token loss, summed exactly over the vocabulary (pi held fixed
    as the sampling distribution): what the per-token gradient estimates on on-policy samples."""
    probs = torch.softmax(theta, -1).detach()
    total = torch.zeros_like(theta)
    for a in range(theta.numel()):
        t = theta.clone().requires_grad_(True)
        lp = torch.log_softmax(t, -1)[a].reshape(1, 1)
        loss, _ = clipped_pg_loss(lp, lp.detach(), torch.zeros(1, dtype=theta.dtype), torch.ones(1, 1), cfg,
                                  reference_logprobs=log_ref[a].reshape(1, 1))
        (grad,) = torch.autograd.grad(loss, t)
        total += probs[a] * grad
    return total


def exact_gradient(fn, theta: torch.Tensor) -> torch.Tensor:
    t = theta.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(torch.log_softmax(t, -1)), t)
    return grad


@pytest.mark.parametrize(
    ("kl_gradient", "name", "target"),
    [
        # with the score function, k1 and k3 estimate the gradient of KL(pi || ref); k2 that of E_pi[k2]
        ("score_function", "k1", "reverse"),
        ("score_function", "k3", "reverse"),
        ("score_function", "k2", "expected_k2"),
        # without it, k2 estimates the gradient of KL(pi || ref), k3 that of KL(ref || pi), k1 nothing
        ("pathwise", "k2", "reverse"),
        ("pathwise", "k3", "forward"),
        ("pathwise", "k1", "zero"),
    ],
)
def test_what_each_kl_gradient_estimates(kl_gradient: str, name: str, target: str) -> None:
    theta = torch.tensor([0.3, -1.1, 0.8, 0.0, -0.4], dtype=torch.float64)
    log_ref = torch.log_softmax(torch.tensor([-0.2, 0.5, 0.1, -0.9, 0.6], dtype=torch.float64), -1)
    cfg = ClippedPGLossConfig(kl_coef=1.0, kl_estimator=name, kl_gradient=kl_gradient,
                              kl_input_clamp_value=None, kl_output_clamp_value=None)
    got = expected_kl_gradient(cfg, theta, log_ref)
    targets = {
        "reverse": lambda lp: (lp.exp() * (lp - log_ref)).sum(),  # KL(pi || ref)
        "forward": lambda lp: (log_ref.exp() * (log_ref - lp)).sum(),  # KL(ref || pi)
        "expected_k2": lambda lp: (lp.exp() * 0.5 * (log_ref - lp) ** 2).sum(),  # E_pi[k2]
        "zero": lambda lp: (lp * 0.0).sum(),
    }
    want = exact_gradient(targets[target], theta)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    if target != "zero":
        assert float(want.abs().max()) > 1e-2  # a real, non-vanishing gradient


# ---- clamps ---------------------------------------------------------------------------------------------------


def test_an_input_clamped_token_passes_no_gradient_at_all() -> None:
    """NeMo-RL's test_calculate_kl_detaches_importance_sampling_when_input_clamped inputs: logp [-3, -1], ref 0,
    input clamp 2, k3: values [e^2 - 3, e - 2]; d/dlogp of their sum: 0 for the clamped token (|x| = 3 > 2) and
    k3 + dk3/dlogp = -x = -1 for the other."""
    lp = torch.tensor([[-3.0, -1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.zeros_like(lp)
    cfg = ClippedPGLossConfig(kl_input_clamp_value=2.0, kl_output_clamp_value=None)
    kl = kl_penalty(lp, ref, "k3", 2.0, None, weights=kl_weight(lp, None, cfg))
    torch.testing.assert_close(kl.detach(), torch.tensor([[math.exp(2) - 3, math.e - 2]], dtype=torch.float64),
                               rtol=RTOL, atol=ATOL)
    kl.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.0]], dtype=torch.float64), rtol=RTOL, atol=ATOL)


def test_the_output_clamp_applies_after_the_weight_and_blocks_its_gradient() -> None:
    """On-policy weight 100 (logp - gen = log 100), logp -1, ref 0, k3: 100 * (e - 2) = 71.8 is clamped to 1
    and passes no gradient; without the clamp the value is 71.8 and the gradient 100 * (k3 + dk3/dlogp) = -100."""
    lp0 = torch.tensor([[-1.0]], dtype=torch.float64)
    gen = lp0 - math.log(100.0)
    ref = torch.zeros_like(lp0)
    for out_clamp, value, grad in ((1.0, 1.0, 0.0), (None, 100 * (math.e - 2), -100.0)):
        cfg = ClippedPGLossConfig(kl_coef=1.0, on_policy_kl_approximation=True, kl_output_clamp_value=out_clamp)
        lp = lp0.clone().requires_grad_(True)
        loss, _ = clipped_pg_loss(lp, lp0, torch.zeros(1), torch.ones(1, 1), cfg, generation_logprobs=gen,
                                  reference_logprobs=ref)
        loss.backward()
        assert loss.item() == pytest.approx(value, rel=RTOL)
        assert lp.grad.item() == pytest.approx(grad, rel=RTOL, abs=ATOL)


def test_kl_gradient_is_validated() -> None:
    with pytest.raises(ValueError, match="kl_gradient"):
        ClippedPGLossConfig(kl_gradient="reinforce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="importance_sampling_cap"):
        ClippedPGLossConfig(importance_sampling_cap=0.0)
