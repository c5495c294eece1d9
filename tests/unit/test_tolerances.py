"""The rule for weights and Adam state after optimizer steps (`tests/tolerances.py`), on hand-made tensors run
through torch's own Adam: two paths whose gradients differ by rounding pass, with the elements whose gradient is
rounding noise moved apart by up to 2 lr a step; a real bug fails, naming the tensor, the element and why (an
update 1% off, a wrong lr, a stale weight, a rank that skipped its gradient all-reduce)."""

from __future__ import annotations

import pytest
import torch
from tolerances import (
    GRADIENT_OF_LARGEST,
    AdamGradients,
    AdamRecord,
    assert_adam_moments_close,
    assert_trained_weights_close,
)

LR, STEPS = 3e-3, 3
SHAPE = (32, 48)


def _true_gradients() -> list[dict[str, torch.Tensor]]:
    """Per step, the exact gradients of two tensors: `w` with a real gradient everywhere but row 0, whose true
    gradient is 0 (what `k_proj.bias` gets), and `b`, all 0 (sums of large terms that cancel)."""
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(STEPS):
        w = torch.randn(SHAPE, generator=g) * 1e-2
        w[0] = 0.0
        steps.append({"w": w, "b": torch.zeros(SHAPE[1])})
    return steps


def _train(gradients: list[dict[str, torch.Tensor]], *, seed: int, lr: float = LR,
           ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], AdamGradients | None]:
    """Adam from the same initial weights on these gradients, each entry off by rounding noise of this path
    (`seed`): up to a quarter of GRADIENT_OF_LARGEST of the largest entry, the size rounding has."""
    torch.manual_seed(1)
    params = {"w": torch.nn.Parameter(torch.randn(SHAPE) * 0.05), "b": torch.nn.Parameter(torch.zeros(SHAPE[1]))}
    optimizer = torch.optim.Adam(params.values(), lr=lr)
    record = AdamRecord(optimizer, params)
    largest = max((float(g.abs().max()) for step in gradients for g in step.values()), default=0.0)
    noise = torch.Generator().manual_seed(seed)
    for step in gradients:
        for name, p in params.items():
            off = (torch.rand(p.shape, generator=noise) * 2 - 1) * 0.25 * GRADIENT_OF_LARGEST * largest
            p.grad = step[name] + off
        optimizer.step()
    state = {name: {k: v.clone() for k, v in optimizer.state[p].items() if k != "step"} for name, p in params.items()}
    return {k: p.detach().clone() for k, p in params.items()}, state, record.at(len(gradients)) if gradients else None


def _initial() -> dict[str, torch.Tensor]:
    return _train([], seed=0)[0]


def _check(reference, candidate, record: AdamGradients) -> float:
    return assert_trained_weights_close(reference, candidate, initial=_initial(), record=record, lr=LR)


def test_two_paths_that_differ_by_rounding_pass_though_their_noise_elements_moved_lr_apart() -> None:
    grads = _true_gradients()
    (a, state_a, record), (b, state_b, _) = _train(grads, seed=1), _train(grads, seed=2)
    noise_moved = float((a["w"][0] - b["w"][0]).abs().max())
    assert noise_moved > LR  # the noise row went opposite ways: no rtol/atol fitted to a machine would hold it
    with pytest.raises(AssertionError):
        torch.testing.assert_close(b["w"], a["w"], rtol=1e-5, atol=2e-6)
    power = _check(a, b, record)
    assert power > 0.5  # most elements are held to 1% of a step: the check has teeth
    assert_adam_moments_close(state_a, state_b, noise=record.noise, steps=STEPS)


def test_a_real_gradient_element_one_percent_off_fails_naming_it() -> None:
    grads = _true_gradients()
    (a, _, record), (b, _, _) = _train(grads, seed=1), _train(grads, seed=2)
    initial = _initial()
    row, col = (int(i) for i in torch.unravel_index(record.floor["w"].argmax(), SHAPE))  # its gradient is real
    b["w"][row, col] = initial["w"][row, col] + (b["w"][row, col] - initial["w"][row, col]) * 1.01
    with pytest.raises(AssertionError, match=rf"(?s)w: 1 of 1536 elements.*\[{row}, {col}\].*real gradient"):
        _check(a, b, record)


@pytest.mark.parametrize("lr", [LR * 1.01, LR * 2])
def test_a_wrong_learning_rate_fails(lr: float) -> None:
    grads = _true_gradients()
    (a, _, record), (b, _, _) = _train(grads, seed=1), _train(grads, seed=2, lr=lr)
    with pytest.raises(AssertionError, match=r"(?s)w: \d+ of 1536 elements.*real gradient"):
        _check(a, b, record)


def test_a_stale_weight_fails() -> None:
    grads = _true_gradients()
    (a, _, record) = _train(grads, seed=1)
    stale = _initial()  # the candidate never applied its updates
    with pytest.raises(AssertionError, match=r"(?s)w: \d+ of 1536.*real gradient"):
        _check(a, stale, record)


def test_a_rank_that_skipped_its_gradient_all_reduce_fails_weights_and_moments() -> None:
    """Two ranks, each half the batch: one that skipped the all-reduce steps on its own half's gradient."""
    grads = _true_gradients()
    g = torch.Generator().manual_seed(3)
    half = [{k: v / 2 + torch.randn(v.shape, generator=g) * 2e-3 * (v != 0) for k, v in step.items()}
            for step in grads]
    (a, state_a, record), (b, state_b, _) = _train(grads, seed=1), _train(half, seed=2)
    with pytest.raises(AssertionError, match="real gradient"):
        _check(a, b, record)
    with pytest.raises(AssertionError, match="w exp_avg"):
        assert_adam_moments_close(state_a, state_b, noise=record.noise, steps=STEPS)
