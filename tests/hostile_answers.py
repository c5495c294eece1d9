"""Answers that make math-verify run away, shared by the grading tests in tests/unit and tests/functional."""

HOSTILE = [
    "\\boxed{\\binom{10000000}{5000000}}",
    "\\boxed{\\prod_{i=1}^{10^8} i}",
    "\\boxed{\\Gamma(10^9)}",
    "\\boxed{" + "\\frac{1}{" * 20 + "2" + "}" * 20 + "}",
    "\\boxed{" * 20_000,
]
"""Each made math-verify run for 40-70 s or more with its timeouts off (the unclosed boxes in extraction)."""
