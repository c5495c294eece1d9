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

Bit-exact comparisons (`torch.equal`, `==` on floats) are for copies (weights sent to the engine, checkpoints,
JSON round trips) and for runs that execute the same kernels on the same shapes by construction; each says so.
"""

from __future__ import annotations

import pytest

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
"""Gradients and SGD updates (lr 1) of two equivalent computations agree to this fraction of the tensor's largest
entry: the entries are sums of many terms with mixed signs (cancellation), so their rounding error follows the
size of the terms, which the largest entry bounds, not the size of the result. Measured: up to 8.5e-6 of the
largest entry (shared prompt KV cache, 2 decoder layers)."""


def approx(expected, tolerance: dict[str, float]):
    """`pytest.approx` with one of the tolerances above (`rtol`/`atol` spelled as pytest's `rel`/`abs`)."""
    return pytest.approx(expected, rel=tolerance["rtol"], abs=tolerance["atol"])
