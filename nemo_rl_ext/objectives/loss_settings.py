"""The clipped policy-gradient loss's settings, declared once.

`LossSettings` is the home: the GRPO config's `loss` section (names, defaults, descriptions, bounds) and the
rules its values must keep (`loss_problems`). `ClippedPGLossConfig`, the frozen dataclass that
`objectives.loss.clipped_pg_loss` takes (NeMo-RL's name), is built from the same fields and checked by the same
rules: `LossSettings(...).to_loss_config()` gives it, and constructing it directly runs the same checks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from pydantic import Field, model_validator

from nemo_rl_ext.config import StrictModel


class LossSettings(StrictModel):
    """The clipped policy-gradient loss (`clipped_pg_loss` in `objectives/loss.py` has the exact formula). The
    defaults are NeMo-RL's (`grpo_math_1B.yaml`'s `loss_fn`)."""

    clip_low: float = Field(default=0.2, description="Ratio clipped below at 1 - clip_low (NeMo-RL's ratio_clip_min).")
    clip_high: float = Field(
        default=0.2, description="Ratio clipped above at 1 + clip_high (NeMo-RL's ratio_clip_max; DAPO's clip-higher "
        "uses 0.28)."
    )
    clip_c: float | None = Field(
        default=None, description="Dual-clip constant (> 1): for negative advantages a token's loss is capped at "
        "-A * clip_c; None disables."
    )
    normalization: Literal["token", "sequence"] = Field(
        default="token", description="Loss reduction. token: the sum over trained tokens / their count; sequence: "
        "each sequence's mean, then the mean over sequences."
    )
    kl_coef: float = Field(
        default=0.01, ge=0.0, description="KL penalty to the initial policy (NeMo-RL's reference_policy_kl_penalty); "
        "> 0 loads a frozen copy of the initial policy as the reference, 0 disables it and saves that copy."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="Per-token KL(pi || ref) estimator of x = log ref - log pi: k1 = -x; "
        "k2 = x^2 / 2; k3 = exp(x) - x - 1."
    )
    kl_input_clamp_value: float | None = Field(
        default=20.0, gt=0.0, description="Clamp log(ref/pi) to [-v, v] before the KL estimator; None: no."
    )
    kl_output_clamp_value: float | None = Field(
        default=10.0, gt=0.0, description="Clamp the per-token KL to [-v, v]; None: no."
    )
    kl_gradient: Literal["score_function", "pathwise"] = Field(
        default="score_function",
        description="score_function (NeMo-RL's since 2026): the KL term's gradient includes the score function of "
        "the sampled token, so k1 and k3 give the gradient of KL(pi || ref); pathwise: d KL-estimate / d logprob "
        "alone (NeMo-RL before June 2026; with k2 that is the gradient of KL(pi || ref), with k3 of KL(ref || pi)).",
    )
    on_policy_kl_approximation: bool = Field(
        default=False, description="Weight the per-token KL by pi / pi_engine (NeMo-RL's "
        "use_on_policy_kl_approximation)."
    )
    importance_sampling_correction: bool = Field(
        default=False,
        description="Weight the policy-gradient term by pi_trainer / pi_engine (engine/trainer mismatch, stale "
        "rollouts). Off by default as in NeMo-RL; on by default, and required, with grpo.async.enabled and "
        "max_lag > 0.",
    )
    importance_sampling_cap: float | None = Field(
        default=None, gt=0.0, description="Truncate that weight at this value (NeMo-RL's truncated IS `tis`); "
        "None: no truncation (NeMo-RL's default)."
    )

    def to_loss_config(self) -> ClippedPGLossConfig:
        """The loss function's own config (raises ValueError on bad values)."""
        return ClippedPGLossConfig(**self.model_dump())

    @model_validator(mode="after")
    def _valid_loss(self) -> LossSettings:
        check_loss_settings(self)
        return self


def loss_problems(s: Any) -> list[str]:
    """Every rule the loss settings `s` (a `LossSettings` or a `ClippedPGLossConfig`) break, one line each."""
    problems = []
    if not 0.0 <= s.clip_low < 1.0:
        problems.append(f"clip_low must be in [0, 1), got {s.clip_low}")
    if s.clip_high < 0.0:
        problems.append(f"clip_high must be >= 0, got {s.clip_high}")
    if s.clip_c is not None and not s.clip_c > 1.0:
        problems.append(f"clip_c must be > 1 (or None), got {s.clip_c}")
    if s.normalization not in ("token", "sequence"):
        problems.append(f"normalization must be 'token' or 'sequence', got {s.normalization!r}")
    if s.kl_estimator not in ("k1", "k2", "k3"):
        problems.append(f"kl_estimator must be 'k1', 'k2' or 'k3', got {s.kl_estimator!r}")
    for name in ("kl_input_clamp_value", "kl_output_clamp_value"):
        value = getattr(s, name)
        if value is not None and not value > 0.0:
            problems.append(f"{name} must be > 0 (or None), got {value}")
    if not math.isfinite(s.kl_coef):
        problems.append(f"kl_coef must be finite, got {s.kl_coef}")
    if s.kl_gradient not in ("score_function", "pathwise"):
        problems.append(f"kl_gradient must be 'score_function' or 'pathwise', got {s.kl_gradient!r}")
    if s.importance_sampling_cap is not None and not s.importance_sampling_cap > 0.0:
        problems.append(f"importance_sampling_cap must be > 0 (or None), got {s.importance_sampling_cap}")
    return problems


def check_loss_settings(s: Any) -> None:
    """Raise one ValueError listing every `loss_problems` of `s`."""
    problems = loss_problems(s)
    if problems:
        raise ValueError("invalid ClippedPGLossConfig: " + "; ".join(problems))


def _loss_config_class() -> type:
    """`ClippedPGLossConfig`: a frozen dataclass with `LossSettings`' fields and defaults, checked on creation."""
    fields = [
        (name, info.annotation, dataclasses.field(default=info.default))
        for name, info in LossSettings.model_fields.items()
    ]
    doc = "Settings of the clipped policy-gradient loss (the fields, defaults and rules of `LossSettings`)."
    cls = dataclasses.make_dataclass(
        "ClippedPGLossConfig", fields, frozen=True, namespace={"__doc__": doc, "__post_init__": check_loss_settings}
    )
    cls.__module__ = __name__  # pickled (to Ray workers) and shown by this module's name
    return cls


ClippedPGLossConfig: Any = _loss_config_class()
"""The loss function's settings (NeMo-RL's name): a frozen dataclass of `LossSettings`' fields."""
