"""Float tolerances shared by the tests, and why they have the size they have.

float32 keeps 24 significant bits: one ulp is 2**-23 (1.2e-7) of the value. Two computations of the same number
that differ only in the order of their sums (another matmul kernel: another processor's SIMD width, another batch
shape, another thread count, `ATEN_CPU_CAPABILITY`, MKL's code path) differ by a few ulps per term of each
reduction, relative to the size of the terms. So "equal up to rounding" is an `rtol` (logprobs near -20 are
4 ulps = 7.6e-6 apart on an AVX-512 Xeon) plus an `atol` for values near 0, never a bare `atol`.

The sizes below hold the errors measured on this repository's tiny fp32 models (hidden 64-128, MLP 128-256,
vocabulary ~1k) under `ATEN_CPU_CAPABILITY=default|avx2|avx512`, `MKL_CBWR=COMPATIBLE` (MKL's generic GEMM code
path) and 1 or 2 torch threads with a margin of 4x or more, and stay far below the errors a bug makes (a wrong
token, position or temperature, a bf16 path, a stale weight: 1e-2 and up). `make numerics` re-runs the tests
that use them under other CPU kernels.

Weights after optimizer steps are no such pair: Adam divides by the gradient's size, so an element whose gradient
is rounding noise moves by up to lr in a direction the noise picks. `assert_trained_weights_close` (below) bounds
each element by what Adam can do with the gradient noise, derived step by step; `assert_adam_moments_close` does the
same for Adam's moments.

Bit-exact comparisons (`torch.equal`, `==` on floats) are for copies (weights sent to the engine, checkpoints,
JSON round trips) and for runs that execute the same kernels on the same shapes by construction; each says so.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pytest
import torch

SAME_MODEL_LOGPROBS = {"rtol": 1e-5, "atol": 1e-5}
"""Two paths through the same fp32 weights in one process (another batch shape or padding, the log-softmax in
chunks, a shared prompt's KV cache): measured at most 1.6e-6 relative (MKL_CBWR=COMPATIBLE) and 1.5e-5 absolute
on values of ~25. Tolerance: 2.1e-4 at -20, 1.1e-5 near 0."""

ENGINE_LOGPROBS = {"rtol": 1e-4, "atol": 1e-4}
"""A generation engine's logprobs (KV-cache decode, one position a step, rows padded in a batch) against one
forward pass over the whole sequence: measured up to 8e-5 absolute on values up to 12 (a decode step's attention
and the forward's run other shapes). Tolerance: 1.1e-3 at -10, 1e-4 near 0; a stale weight or a wrong token
moves a logprob by 1e-2 or more."""

GRADIENT_OF_LARGEST = 1e-4
"""Gradients and SGD updates (lr 1) of two equivalent computations agree to this fraction of the largest entry (the
tests take the model's largest: a tensor whose true gradient is 0 has no largest entry of its own to speak of): the entries are sums of many terms with mixed signs (cancellation), so their rounding error follows the
size of the terms, which the largest entry bounds, not the size of the result. Measured: up to 8.5e-6 of the
largest entry (shared prompt KV cache, 2 decoder layers)."""


def approx(expected, tolerance: dict[str, float]):
    """`pytest.approx` with one of the tolerances above (`rtol`/`atol` spelled as pytest's `rel`/`abs`)."""
    return pytest.approx(expected, rel=tolerance["rtol"], abs=tolerance["atol"])


# ---- weights and Adam state after optimizer steps ---------------------------------------------------------------

FLOAT32_ULP = 2.0**-23
"""One float32 ulp relative to the value (24 significant bits)."""


def adam_step_bound(t: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest |m_hat / sqrt(v_hat)| Adam's step t can take, whatever the gradients: m_hat = sum w_i g_i and
    v_hat = sum c_i g_i^2 (bias-corrected weights of step i's gradient, each set summing to 1), so by
    Cauchy-Schwarz |m_hat| / sqrt(v_hat) <= sqrt(sum w_i^2 / c_i). 1 at t = 1 (lr * g / |g|); 1.004 at t = 3 and
    1.043 at t = 10 for betas (0.9, 0.999)."""
    b1, b2 = betas
    w = [(1 - b1) * b1 ** (t - i) / (1 - b1**t) for i in range(1, t + 1)]
    c = [(1 - b2) * b2 ** (t - i) / (1 - b2**t) for i in range(1, t + 1)]
    return math.sqrt(sum(wi * wi / ci for wi, ci in zip(w, c, strict=True)))


@dataclass(frozen=True)
class AdamGradients:
    """What the weight rule needs to know of the reference path's gradients, up to one of its steps."""

    floor: dict[str, torch.Tensor]
    """Per element, the smallest sqrt(v_hat) of any step so far: the gradient RMS Adam divided by, at its smallest."""
    largest: float
    """The largest gradient entry of the model at any step so far (after clipping: what Adam saw)."""
    steps: int
    """Optimizer steps taken."""

    @property
    def noise(self) -> float:
        """The rounding noise of any one gradient entry of any step: GRADIENT_OF_LARGEST of the model's largest
        entry. The model's largest, not the tensor's: a tensor whose true gradient is 0 (`k_proj.bias`: a constant
        added to every key shifts a query's scores alike, which the softmax ignores) is a sum of terms as large as
        its neighbours', so all its entries are rounding noise."""
        return GRADIENT_OF_LARGEST * self.largest


class AdamRecord:
    """Records the reference path's `AdamGradients` after each step of its Adam(W) (a step post-hook): recorded,
    not read from the final state, because an element whose gradient was near 0 at step 1 and large later is
    noise at step 1, which the final v_hat cannot tell. `at(steps)`: as they were after that many steps;
    `renamed(rename)`: the same record under other names (a checkpoint's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, named: Mapping[str, torch.nn.Parameter]) -> None:
        self.history: list[AdamGradients] = []
        self.beta2 = optimizer.defaults["betas"][1]
        self._named = dict(named)
        self.initial = {name: p.detach().to("cpu", copy=True) for name, p in self._named.items()}
        """The parameters as they were when the record began (before the first step)."""
        self.handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: self._record(opt))

    def _record(self, optimizer: torch.optim.Optimizer) -> None:
        last = self.history[-1] if self.history else AdamGradients({}, 0.0, 0)
        floor, largest = {}, last.largest
        for name, p in self._named.items():
            state = optimizer.state.get(p) or {}
            if "exp_avg_sq" in state:
                rms = (state["exp_avg_sq"].detach().double() / (1 - self.beta2 ** int(state["step"]))).sqrt().cpu()
            else:  # no gradient yet (Adam skips a parameter whose .grad is None): nothing to divide by
                rms = torch.zeros(p.shape, dtype=torch.float64)
            floor[name] = torch.minimum(last.floor[name], rms) if name in last.floor else rms
            if p.grad is not None:
                largest = max(largest, float(p.grad.detach().abs().max()))
        self.history.append(AdamGradients(floor, largest, last.steps + 1))

    def renamed(self, rename: Callable[[str], str]) -> AdamRecord:
        """This record with every name passed through `rename` (e.g. peft's parameter names to its file names)."""
        other = copy.copy(self)
        other.initial = {rename(k): v for k, v in self.initial.items()}
        other.history = [AdamGradients({rename(k): v for k, v in h.floor.items()}, h.largest, h.steps)
                         for h in self.history]
        return other

    def at(self, steps: int) -> AdamGradients:
        """The record after `steps` optimizer steps."""
        assert 1 <= steps <= len(self.history), f"{steps} steps asked, {len(self.history)} recorded"
        return self.history[steps - 1]


def adam_weight_tolerance(floor: torch.Tensor, *, noise: float, lr: float, steps: int,
                          betas: tuple[float, float] = (0.9, 0.999)) -> torch.Tensor:
    """How far apart two code paths may put each element after `steps` Adam(W) steps from the same weights (their
    own rounding of the weights aside: `assert_trained_weights_close` adds it). Step t moves an element by
    lr * m_hat / (sqrt(v_hat) + eps), |m_hat / sqrt(v_hat)| <= B_t (`adam_step_bound`). The paths' gradients
    differ by rounding, at most `noise` per entry, so m_hat differs by at most `noise` (its weights sum to 1),
    sqrt(v_hat) = s by at most `noise` (a weighted L2 norm, weights summing to 1: Minkowski), and m_hat / s by
    at most (|dm| s + |m| |ds|) / (s (s - noise)) <= (1 + B_t) noise / (s - noise). So per element and step, with
    s at least `floor` (the smallest s of any step, `AdamRecord`):
      - floor = 0 (no gradient at some step: it is 0 at every step for a token no batch holds, and Adam moves
        it by 0 while v stays 0; a gradient that appears later is caught by the box below): 2 B_t lr;
      - floor > noise (a real gradient): lr * min((1 + B_t) noise / (floor - noise), 2 B_t), i.e. lr times a
        relative error of noise / floor: an element whose gradient is 1e4 x its rounding noise agrees to ~2e-4 lr;
      - floor <= noise (its gradient is rounding noise): anything in [-B_t lr, B_t lr] on each path: 2 B_t lr.
    Summed over the steps. eps only lowers the sensitivity; AdamW's decay multiplies both paths' weights by
    (1 - lr * weight_decay) <= 1, which only shrinks a difference; gradient clipping scales a whole step's
    gradients, which Adam's ratio ignores. Not bounded here: feedback (a noise element that went +lr on one path
    and -lr on the other changes the next steps' forward pass); tests keep it below the rounding noise by
    comparing a few steps, and GRADIENT_OF_LARGEST's 10x margin over the measured rounding absorbs it."""
    per_step = torch.zeros_like(floor, dtype=torch.float64)
    real = floor > noise
    for t in range(1, steps + 1):
        box = 2 * adam_step_bound(t, betas)
        per_step[real] += ((1 + adam_step_bound(t, betas)) * noise / (floor[real] - noise)).clamp(max=box)
        per_step[~real] += box
    return lr * per_step


def _element_report(name: str, ref: torch.Tensor, cand: torch.Tensor, initial: torch.Tensor,
                    floor: torch.Tensor, tol: torch.Tensor, noise: float, bad: torch.Tensor, worst: int) -> str:
    diff = (cand.double() - ref.double()).abs().flatten()
    tol, floor = tol.flatten(), floor.flatten()
    excess = torch.where(bad.flatten(), diff / tol.clamp(min=1e-300), torch.zeros_like(diff))
    lines = [f"{name}: {int(bad.sum())} of {ref.numel()} elements further apart than Adam can take them by "
             f"rounding (gradient noise {noise:.3g})"]
    for flat in excess.argsort(descending=True)[:min(worst, int(bad.sum()))].tolist():
        index = [int(i) for i in torch.unravel_index(torch.tensor(flat), ref.shape)]
        s = float(floor[flat])
        if s > noise:
            why = (f"real gradient (sqrt(v_hat) >= {s:.3g}, {s / noise:.3g} x the noise): the paths' updates must "
                   "agree to noise / sqrt(v_hat) of lr a step")
        else:
            why = "gradient at rounding noise: each path may move it up to lr a step, this is further"
        lines.append(f"  {index}: reference {float(ref.flatten()[flat]):.9g}, candidate "
                     f"{float(cand.flatten()[flat]):.9g}, initial {float(initial.flatten()[flat]):.9g}: apart "
                     f"{float(diff[flat]):.3g} > allowed {float(tol[flat]):.3g}; {why}")
    return "\n".join(lines)


def assert_trained_weights_close(reference: Mapping[str, torch.Tensor], candidate: Mapping[str, torch.Tensor], *,
                                 initial: Mapping[str, torch.Tensor], record: AdamGradients, lr: float,
                                 betas: tuple[float, float] = (0.9, 0.999), worst: int = 5) -> float:
    """Weights that two code paths trained with Adam(W) from the same `initial` weights, compared element by
    element with `adam_weight_tolerance` (`record`: the reference path's, `AdamRecord.at`) plus each side's rounding
    of its weights, 2 ulps of the element a step (w - lr * u, and the decay's product). Every tensor of
    `reference` is compared; one AssertionError names each tensor that fails, its worst elements, and why.
    Returns the fraction of elements held to 1% of one step's lr or tighter: the check's power, which a test
    asserts is not nil (were every gradient at the noise floor, the check would be a box of 2 lr a step and catch
    a wrong lr or a stale weight nowhere)."""
    problems, tight, total = [], 0, 0
    for name, ref in reference.items():
        cand, start, floor = candidate[name], initial[name], record.floor[name]
        assert cand.shape == ref.shape == start.shape == floor.shape, (name, cand.shape, ref.shape, floor.shape)
        tol = adam_weight_tolerance(floor, noise=record.noise, lr=lr, steps=record.steps, betas=betas)
        size = torch.maximum(torch.maximum(ref.double().abs(), cand.double().abs()), start.double().abs())
        tol = tol + 2 * record.steps * FLOAT32_ULP * size
        bad = (cand.double() - ref.double()).abs() > tol
        tight += int((tol <= 1e-2 * lr).sum())
        total += ref.numel()
        if bad.any():
            problems.append(_element_report(name, ref, cand, start, floor, tol, record.noise, bad, worst))
    if problems:
        raise AssertionError(f"trained weights differ beyond Adam's rounding ({record.steps} steps, lr {lr:g}):\n"
                             + "\n".join(problems))
    return tight / max(total, 1)


def assert_adam_moments_close(reference: Mapping[str, Mapping[str, torch.Tensor]],
                              candidate: Mapping[str, Mapping[str, torch.Tensor]], *, noise: float, steps: int,
                              betas: tuple[float, float] = (0.9, 0.999)) -> None:
    """Adam's moments of two code paths after `steps` steps ({name: {"exp_avg", "exp_avg_sq"}}; `noise`:
    `AdamGradients.noise`). m = sum (1 - b1) b1^(T-i) g_i, weights summing to 1 - b1^T, so |m - m'| <=
    (1 - b1^T) noise; sqrt(v) is a weighted L2 norm of the gradients, weights summing to 1 - b2^T, so
    |sqrt(v) - sqrt(v')| <= sqrt(1 - b2^T) noise (Minkowski). v is compared through its root: where the gradient
    is noise, v ~ noise^2 and its relative differences are of order 1. Plus 2 ulps of the moment a step."""
    problems = []
    for name, state in reference.items():
        for key, bound, view in (("exp_avg", 1 - betas[0] ** steps, lambda x: x.double()),
                                 ("exp_avg_sq", math.sqrt(1 - betas[1] ** steps), lambda x: x.double().sqrt())):
            a, b = view(state[key]), view(candidate[name][key])
            tol = bound * noise + 2 * steps * FLOAT32_ULP * torch.maximum(a.abs(), b.abs())
            bad = (a - b).abs() > tol
            if bad.any():
                flat = int(((a - b).abs() - tol).argmax())
                problems.append(f"{name} {key}: {int(bad.sum())} of {a.numel()} entries apart by more than "
                                f"{bound:.3g} x noise {noise:.3g}; worst at flat index {flat}: "
                                f"{float(a.flatten()[flat]):.6g} against {float(b.flatten()[flat]):.6g}")
    if problems:
        raise AssertionError("Adam moments differ beyond gradient rounding:\n" + "\n".join(problems))
