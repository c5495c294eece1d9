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
    normalization: Literal["token", "sequence"] | None = Field(
        default=None, description="Older spelling of `aggregation`: token = token-mean, sequence = "
        "seq-mean-token-mean; None: `aggregation` decides (token-mean when both are None)."
    )
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] | None = (
        Field(
            default=None, description="Loss aggregation over a minibatch's trained tokens (verl's loss_agg_mode): "
            "token-mean = sum / trained tokens; seq-mean-token-mean = mean over sequences of each one's token mean; "
            "seq-mean-token-sum = mean over sequences of each one's token sum; seq-mean-token-sum-norm = sum / "
            "(sequences * max_tokens_norm) (Dr. GRPO). None: `normalization`'s, else token-mean."
        )
    )
    max_tokens_norm: int | None = Field(
        default=None, gt=0, description="The constant token divisor of seq-mean-token-sum-norm; None: "
        "policy.generation.max_new_tokens."
    )
    policy_loss: Literal["ppo_clip", "cispo"] = Field(
        default="ppo_clip", description="ppo_clip: max(-A r, -A clip(r)); cispo (MiniMax-M1; NeMo-RL's use_cispo): "
        "-sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi."
    )
    sequence_level_importance_ratios: bool = Field(
        default=False, description="GSPO: r is one ratio per sample, exp(mean over its trained tokens of "
        "log pi - log pi_old), clipped and applied to each of its tokens; the IS weight against the engine is per "
        "sample too, exp(sum over its tokens of log pi_old - log pi_engine)."
    )
    entropy_coef: float = Field(
        default=0.0, ge=0.0, description="Entropy bonus: loss -= entropy_coef * the aggregated entropy of each trained "
        "token's distribution under the generation temperature (computed from the logits in chunks); train/entropy "
        "is reported at 0 too."
    )
    kl_coef: float = Field(
        default=0.01, ge=0.0, description="KL penalty to the initial policy (NeMo-RL's reference_policy_kl_penalty); "
        "> 0 loads a frozen copy of the initial policy as the reference, 0 disables it and saves that copy."
    )
    use_kl_in_reward: bool = Field(
        default=False, description="Reinforce++ (NeMo-RL's use_kl_in_reward; needs grpo.adv_estimator: "
        "reinforce_plus_plus and kl_coef > 0): the loss has no KL term; each trained token's advantage is "
        "A_i - kl_coef * kl(pi_old, ref), then whitened over the step's trained tokens."
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
        default=None, gt=0.0, description="Older spelling of truncated_importance_sampling_type tis with "
        "truncated_importance_sampling_ratio = this value; None: no truncation (NeMo-RL's default)."
    )
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = Field(
        default=None, description="With importance_sampling_correction, what happens to the IS weight w outside "
        "[ratio_min, ratio]: tis clamps w into it; icepop sets w = 0 on those tokens; seq-mask-tis sets w = 0 on "
        "every token of a sample whose geometric-mean w (exp of the mean log w) is outside. None: no truncation."
    )
    truncated_importance_sampling_ratio: float | None = Field(
        default=None, gt=0.0, description="The upper bound of the truncation band (required with a type)."
    )
    truncated_importance_sampling_ratio_min: float | None = Field(
        default=None, ge=0.0, description="The lower bound of the band (required by icepop and seq-mask-tis; "
        "tis: None = 0)."
    )

    def to_loss_config(self, max_new_tokens: int | None = None) -> ClippedPGLossConfig:
        """The loss function's own config (raises ValueError on bad values); `max_new_tokens` (the generation's)
        fills `max_tokens_norm` when that is None."""
        values = self.model_dump()
        if values["max_tokens_norm"] is None:
            values["max_tokens_norm"] = max_new_tokens
        return ClippedPGLossConfig(**values)

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
    problems += _reduction_problems(s)
    problems += _truncation_problems(s)
    if s.policy_loss not in ("ppo_clip", "cispo"):
        problems.append(f"policy_loss must be 'ppo_clip' or 'cispo', got {s.policy_loss!r}")
    elif s.policy_loss == "cispo" and s.sequence_level_importance_ratios:
        problems.append("policy_loss cispo uses token ratios: it excludes sequence_level_importance_ratios")
    elif s.policy_loss == "cispo" and s.clip_c is not None:
        problems.append("policy_loss cispo has no dual clip: set clip_c to None")
    if s.kl_estimator not in ("k1", "k2", "k3"):
        problems.append(f"kl_estimator must be 'k1', 'k2' or 'k3', got {s.kl_estimator!r}")
    for name in ("kl_input_clamp_value", "kl_output_clamp_value"):
        value = getattr(s, name)
        if value is not None and not value > 0.0:
            problems.append(f"{name} must be > 0 (or None), got {value}")
    if not (math.isfinite(s.entropy_coef) and s.entropy_coef >= 0.0):
        problems.append(f"entropy_coef must be finite and >= 0, got {s.entropy_coef}")
    if not math.isfinite(s.kl_coef):
        problems.append(f"kl_coef must be finite, got {s.kl_coef}")
    elif s.use_kl_in_reward and not s.kl_coef > 0.0:
        problems.append(f"use_kl_in_reward subtracts kl_coef * KL from the reward: it needs kl_coef > 0 (and so "
                        f"the reference policy), got kl_coef {s.kl_coef}")
    if s.kl_gradient not in ("score_function", "pathwise"):
        problems.append(f"kl_gradient must be 'score_function' or 'pathwise', got {s.kl_gradient!r}")
    if s.importance_sampling_cap is not None and not s.importance_sampling_cap > 0.0:
        problems.append(f"importance_sampling_cap must be > 0 (or None), got {s.importance_sampling_cap}")
    return problems


AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_OLD_NORMALIZATION = {"token": "token-mean", "sequence": "seq-mean-token-mean"}


def aggregation_of(s: Any) -> str:
    """The effective aggregation: `aggregation`, else the older `normalization`'s, else token-mean."""
    if s.aggregation is not None:
        return s.aggregation
    return _OLD_NORMALIZATION.get(s.normalization or "token", "token-mean")


def truncation_of(s: Any) -> tuple[str | None, float | None, float | None]:
    """(type, max, min) of the truncated IS: `truncated_importance_sampling_*`, or `importance_sampling_cap` as
    tis with that max and min 0 (its older spelling); (None, None, None) without."""
    if s.truncated_importance_sampling_type is not None:
        return (s.truncated_importance_sampling_type, s.truncated_importance_sampling_ratio,
                s.truncated_importance_sampling_ratio_min)
    if s.importance_sampling_cap is not None:
        return "tis", s.importance_sampling_cap, None
    return None, None, None


def _reduction_problems(s: Any) -> list[str]:
    problems = []
    if s.normalization is not None and s.normalization not in _OLD_NORMALIZATION:
        problems.append(f"normalization must be 'token' or 'sequence', got {s.normalization!r}")
    if s.aggregation is not None and s.aggregation not in AGGREGATIONS:
        problems.append(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {s.aggregation!r}")
    elif (s.aggregation is not None and s.normalization in _OLD_NORMALIZATION
          and _OLD_NORMALIZATION[s.normalization] != s.aggregation):
        problems.append(f"normalization {s.normalization!r} (the older spelling) contradicts aggregation "
                        f"{s.aggregation!r}: set aggregation only")
    if s.max_tokens_norm is not None and not s.max_tokens_norm > 0:
        problems.append(f"max_tokens_norm must be > 0 (or None), got {s.max_tokens_norm}")
    return problems


def _truncation_problems(s: Any) -> list[str]:
    kind, high, low = (s.truncated_importance_sampling_type, s.truncated_importance_sampling_ratio,
                       s.truncated_importance_sampling_ratio_min)
    if kind is None:
        if high is not None or low is not None:
            return ["truncated_importance_sampling_ratio(_min) needs truncated_importance_sampling_type"]
        return []
    if kind not in ("tis", "icepop", "seq-mask-tis"):
        return [f"truncated_importance_sampling_type must be 'tis', 'icepop' or 'seq-mask-tis', got {kind!r}"]
    problems = []
    if s.importance_sampling_cap is not None:
        problems.append("importance_sampling_cap is the older spelling of truncated_importance_sampling_type tis: "
                        "set one of them")
    if not s.importance_sampling_correction:
        problems.append(f"truncated_importance_sampling_type {kind} needs importance_sampling_correction: true")
    if high is None or not high > 0.0:
        problems.append(f"truncated_importance_sampling_ratio must be > 0 with a type, got {high}")
    if low is None and kind != "tis":
        problems.append(f"truncated_importance_sampling_ratio_min is required by {kind}")
    elif low is not None and (low < 0.0 or (high is not None and low > high)):
        problems.append(f"truncated_importance_sampling_ratio_min ({low}) must be in [0, "
                        f"truncated_importance_sampling_ratio ({high})]")
    if kind == "seq-mask-tis" and s.sequence_level_importance_ratios:
        problems.append("seq-mask-tis masks samples of token-level IS weights: it excludes "
                        "sequence_level_importance_ratios")
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
