"""The 2026 recipes' loss options: GSPO, CISPO, truncated IS (tis, icepop, seq-mask-tis), aggregation modes.

Inputs and expected values marked "NeMo-RL" are those of NeMo-RL's `tests/unit/algorithms/test_loss_functions.py`
(August 2026, the named function): there a [1, 4] batch whose first token is masked, so the 3 trained tokens are
the values written here. Their expected values are given to 4 digits, so those are compared at 1e-3 relative
(the precision they are printed with); the others are hand-computed and compared at float64 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.grpo.config import GRPOConfig, LossSettings
from nemo_rl_ext.objectives.aggregation import normalization_count
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, clipped_pg_loss

F64 = {"rtol": 1e-12, "atol": 1e-12}
PRINTED = {"rtol": 1e-3, "atol": 0.0}  # NeMo-RL's 4-digit expected values

ADV = [[1.0, -1.0, 2.0]]
PREV = [[-1.0, -1.0, -1.0]]
CURR = [[-1.69315, -1.0, -0.59453]]  # ratios ~0.5, 1.0, 1.5


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def run(curr, prev, adv, cfg, gen=None, mask=None, count=None):
    logprobs = t(curr).requires_grad_(True)
    mask = torch.ones_like(logprobs) if mask is None else t(mask)
    loss, metrics = clipped_pg_loss(logprobs, t(prev), t(adv), mask, cfg,
                                    generation_logprobs=None if gen is None else t(gen),
                                    global_normalization_count=count)
    loss.backward()
    return loss, logprobs.grad, metrics


# ---- GSPO --------------------------------------------------------------------------------------------------


def test_gspo_one_sample_nemo_rl():
    # NeMo-RL test_clipped_pg_loss_gspo: s = exp(mean log r) = 0.9086 inside the band; loss -0.6057
    cfg = ClippedPGLossConfig(kl_coef=0.0, sequence_level_importance_ratios=True, aggregation="seq-mean-token-mean")
    loss, grad, metrics = run(CURR, PREV, ADV, cfg)
    torch.testing.assert_close(loss, torch.tensor(-0.6057, dtype=torch.float64), **PRINTED)
    s = math.exp(sum(c - p for c, p in zip(CURR[0], PREV[0], strict=True)) / 3)
    torch.testing.assert_close(loss, torch.tensor(-s * sum(ADV[0]) / 3, dtype=torch.float64), **F64)
    # d loss / d logp_t = -mean(A) * s / 3 on every token: the sample's ratio moves as one
    torch.testing.assert_close(grad, torch.full((1, 3), -s * sum(ADV[0]) / 9, dtype=torch.float64), **F64)
    assert metrics["policy_ratio/mean"] == pytest.approx(s)


def test_gspo_two_samples_nemo_rl():
    # NeMo-RL test_clipped_pg_loss_gspo_batch_size_2: the second sample's s = 2.4697 is clipped at 1.2
    cfg = ClippedPGLossConfig(kl_coef=0.0, sequence_level_importance_ratios=True, aggregation="seq-mean-token-mean")
    loss, _, metrics = run(CURR * 2, [[-1.0] * 3, [-2.0] * 3], ADV * 2, cfg)
    torch.testing.assert_close(loss, torch.tensor(-0.4912, dtype=torch.float64), **PRINTED)
    assert metrics["clip_fraction"] == pytest.approx(2 / 6)  # the clipped term wins on its A > 0 tokens


def test_gspo_engine_weight_is_per_sample_nemo_rl():
    # NeMo-RL test_clipped_pg_loss_gspo_importance_sampling_correction: w = exp(sum(prev - gen)) = 0.8187;
    # actor loss -0.4959
    cfg = ClippedPGLossConfig(kl_coef=0.0, sequence_level_importance_ratios=True, aggregation="seq-mean-token-mean",
                              importance_sampling_correction=True)
    loss, _, metrics = run(CURR, PREV, ADV, cfg, gen=[[-0.5, -1.5, -0.8]])
    torch.testing.assert_close(loss, torch.tensor(-0.4959, dtype=torch.float64), **PRINTED)
    assert metrics["is_weight/mean"] == pytest.approx(math.exp(-0.2))


# ---- CISPO -------------------------------------------------------------------------------------------------


def cispo_terms():
    ratios = [math.exp(c - p) for c, p in zip(CURR[0], PREV[0], strict=True)]
    clamped = [min(max(r, 0.8), 1.2) for r in ratios]
    return clamped, [-a * c * lp for a, c, lp in zip(ADV[0], clamped, CURR[0], strict=True)]


def test_cispo_nemo_rl():
    # NeMo-RL test_clipped_pg_loss_cispo: -A * sg(clip(r, 0.8, 1.2)) * logp, token mean
    cfg = ClippedPGLossConfig(kl_coef=0.0, policy_loss="cispo")
    loss, grad, metrics = run(CURR, PREV, ADV, cfg)
    clamped, per_token = cispo_terms()
    assert clamped == pytest.approx([0.8, 1.0, 1.2], abs=1e-4)
    torch.testing.assert_close(loss, torch.tensor(sum(per_token) / 3, dtype=torch.float64), **F64)
    # the clipped ratio is a constant: the gradient is -A * clip(r) / 3, even where the ratio is clipped
    expected = [-a * c / 3 for a, c in zip(ADV[0], clamped, strict=True)]
    torch.testing.assert_close(grad, t([expected]), **F64)
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)


def test_cispo_with_engine_weights_nemo_rl():
    # NeMo-RL test_clipped_pg_loss_cispo_with_importance_sampling_correction: times exp(prev - gen) per token
    gen = [-0.5, -1.5, -0.8]
    cfg = ClippedPGLossConfig(kl_coef=0.0, policy_loss="cispo", importance_sampling_correction=True)
    loss, _, _ = run(CURR, PREV, ADV, cfg, gen=[gen])
    _, per_token = cispo_terms()
    w = [math.exp(p - g) for p, g in zip(PREV[0], gen, strict=True)]
    torch.testing.assert_close(loss, torch.tensor(sum(a * b for a, b in zip(w, per_token, strict=True)) / 3,
                                                  dtype=torch.float64), **F64)


# ---- truncated importance sampling ------------------------------------------------------------------------


def test_icepop_drops_tokens_outside_the_band_nemo_rl():
    # NeMo-RL test_clipped_pg_loss_icepop_importance_sampling: w = [0.6065, 12.18, 0.8187], band [0.5, 5]
    cfg = ClippedPGLossConfig(kl_coef=0.0, importance_sampling_correction=True, truncated_importance_sampling_type=
                              "icepop", truncated_importance_sampling_ratio=5.0,
                              truncated_importance_sampling_ratio_min=0.5)
    loss, grad, metrics = run(PREV, PREV, ADV, cfg, gen=[[-0.5, -3.5, -0.8]])
    expected = (math.exp(-0.5) * -1.0 + 0.0 + math.exp(-0.2) * -2.0) / 3  # the dropped token still counts in /3
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), **F64)
    assert grad[0, 1] == 0.0
    assert (metrics["is/masked_tokens"], metrics["is/masked_sequences"]) == (1.0, 0.0)


@pytest.mark.parametrize(("low", "weights", "truncated"), [
    (None, [0.1, 1.0, 2.0], 1 / 3),  # NeMo-RL test_clipped_pg_loss_tis_min_bound_defaults_to_zero (min None)
    (0.5, [0.5, 1.0, 2.0], 2 / 3),   # ... and min 0.5; is_oob_ratio is our is_weight/truncated_fraction
])
def test_tis_clamps_into_the_band_nemo_rl(low, weights, truncated):
    cfg = ClippedPGLossConfig(kl_coef=0.0, importance_sampling_correction=True, truncated_importance_sampling_type=
                              "tis", truncated_importance_sampling_ratio=2.0,
                              truncated_importance_sampling_ratio_min=low)
    lp = [[math.log(0.1), 0.0, math.log(3.0)]]
    loss, _, metrics = run(lp, lp, [[1.0, 1.0, 1.0]], cfg, gen=[[0.0, 0.0, 0.0]])
    torch.testing.assert_close(loss, torch.tensor(-sum(weights) / 3, dtype=torch.float64), **F64)
    assert metrics["is_weight/truncated_fraction"] == pytest.approx(truncated)
    assert metrics["is/masked_tokens"] == 0.0


def test_importance_sampling_cap_is_tis_without_a_minimum():
    old = ClippedPGLossConfig(kl_coef=0.0, importance_sampling_correction=True, importance_sampling_cap=2.0)
    new = ClippedPGLossConfig(kl_coef=0.0, importance_sampling_correction=True,
                              truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0)
    lp = [[math.log(0.1), 0.0, math.log(3.0)]]
    assert run(lp, lp, ADV, old, gen=[[0.0] * 3])[0] == run(lp, lp, ADV, new, gen=[[0.0] * 3])[0]


def test_seq_mask_tis_keeps_or_drops_whole_samples_nemo_rl():
    # NeMo-RL test_clipped_pg_loss_seq_mask_tis: geometric mean exp(0.0005) in [0.999, 1.002]: kept, with the
    # raw token weights; a second sample whose geometric mean is exp(0.01) is dropped whole
    cfg = ClippedPGLossConfig(kl_coef=0.0, importance_sampling_correction=True, truncated_importance_sampling_type=
                              "seq-mask-tis", truncated_importance_sampling_ratio=1.002,
                              truncated_importance_sampling_ratio_min=0.999)
    loss, _, _ = run(PREV, PREV, ADV, cfg, gen=[[-1.0005] * 3])
    torch.testing.assert_close(loss, torch.tensor(-math.exp(0.0005) * 2 / 3, dtype=torch.float64), **F64)
    loss, grad, metrics = run(PREV * 2, PREV * 2, ADV * 2, cfg, gen=[[-1.0005] * 3, [-1.03, -1.0, -1.0]])
    torch.testing.assert_close(loss, torch.tensor(-math.exp(0.0005) * 2 / 6, dtype=torch.float64), **F64)
    assert bool((grad[1] == 0).all())
    assert (metrics["is/masked_tokens"], metrics["is/masked_sequences"]) == (3.0, 1.0)


def test_masking_every_sample_trains_on_nothing_without_nan():
    cfg = ClippedPGLossConfig(kl_coef=0.0, importance_sampling_correction=True, truncated_importance_sampling_type=
                              "icepop", truncated_importance_sampling_ratio=2.0,
                              truncated_importance_sampling_ratio_min=0.5)
    gen = [[-5.0, -5.0, -0.1], [-5.0, -5.0, -5.0]]  # every weight exp(4) or exp(-0.9): outside [0.5, 2]
    loss, grad, metrics = run(PREV * 2, PREV * 2, ADV * 2, cfg, gen=gen, mask=[[1, 1, 1], [1, 1, 0]])
    assert float(loss.detach()) == 0.0 and bool((grad == 0).all()) and bool(torch.isfinite(grad).all())
    assert (metrics["is/masked_tokens"], metrics["is/masked_sequences"]) == (metrics["num_tokens"], 2.0) == (5.0, 2.0)


# ---- aggregation ------------------------------------------------------------------------------------------

# two samples at ratio 1: sample 0 trains 3 tokens with A = 1, sample 1 one token with A = 2 (pg = -A per token)
AGG_MASK = [[1, 1, 1, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", (-3 - 2) / 4),
    ("seq-mean-token-mean", (-1 - 2) / 2),
    ("seq-mean-token-sum", (-3 - 2) / 2),
    ("seq-mean-token-sum-norm", (-3 - 2) / (2 * 8)),  # Dr. GRPO / TRL dr_grpo: / (samples * max tokens)
])
def test_aggregation_modes_by_hand(mode, expected):
    cfg = ClippedPGLossConfig(kl_coef=0.0, aggregation=mode, max_tokens_norm=8)
    zeros = [[0.0] * 4] * 2
    loss, _, _ = run(zeros, zeros, [1.0, 2.0], cfg, mask=AGG_MASK)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    masks = [t(m) for m in AGG_MASK]
    count = normalization_count(masks, cfg)
    # one micro-batch per sample, each divided by the minibatch's count: they sum to the whole
    parts = [run([zeros[i]], [zeros[i]], [[1.0, 2.0][i]], cfg, mask=[AGG_MASK[i]], count=count)[0] for i in (0, 1)]
    assert float(sum(parts).detach()) == pytest.approx(expected, rel=1e-12)


def test_older_spellings_are_the_new_ones():
    assert LossSettings(normalization="sequence").to_loss_config() is not None
    zeros = [[0.0] * 4] * 2
    old = run(zeros, zeros, [1.0, 2.0], ClippedPGLossConfig(kl_coef=0.0, normalization="sequence"), mask=AGG_MASK)[0]
    new = run(zeros, zeros, [1.0, 2.0], ClippedPGLossConfig(kl_coef=0.0, aggregation="seq-mean-token-mean"),
              mask=AGG_MASK)[0]
    assert float(old.detach()) == float(new.detach()) == -1.5


def test_max_tokens_norm_defaults_to_the_max_new_tokens():
    cfg = load_config(None, ["data.train_path=train.jsonl", "loss.aggregation=seq-mean-token-sum-norm",
                             "policy.generation.max_new_tokens=96"], GRPOConfig)
    assert cfg.loss.to_loss_config(cfg.policy.generation.max_new_tokens).max_tokens_norm == 96
    assert LossSettings(max_tokens_norm=10).to_loss_config(96).max_tokens_norm == 10


# ---- bad values: one config error naming the key, at load -------------------------------------------------


@pytest.mark.parametrize(("overrides", "named"), [
    (["loss.aggregation=tokens"], "loss.aggregation"),
    (["loss.importance_sampling_correction=true", "loss.truncated_importance_sampling_type=icepop",
      "loss.truncated_importance_sampling_ratio=1.0", "loss.truncated_importance_sampling_ratio_min=2.0"],
     "truncated_importance_sampling_ratio_min (2.0) must be in [0, truncated_importance_sampling_ratio (1.0)]"),
    (["loss.truncated_importance_sampling_type=tis", "loss.truncated_importance_sampling_ratio=2.0"],
     "truncated_importance_sampling_type tis needs importance_sampling_correction: true"),
    (["loss.importance_sampling_correction=true", "loss.truncated_importance_sampling_type=icepop",
      "loss.truncated_importance_sampling_ratio=2.0"], "truncated_importance_sampling_ratio_min is required by icepop"),
    (["loss.policy_loss=cispo", "loss.clip_c=3.0"], "policy_loss cispo has no dual clip"),
    (["loss.policy_loss=cispo", "loss.sequence_level_importance_ratios=true"], "excludes sequence_level"),
    (["loss.normalization=sequence", "loss.aggregation=token-mean"], "contradicts aggregation"),
    (["loss.importance_sampling_correction=true", "loss.importance_sampling_cap=2.0",
      "loss.truncated_importance_sampling_type=tis", "loss.truncated_importance_sampling_ratio=2.0"], "set one of them"),
])
def test_bad_loss_values_are_one_config_error_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.train_path=train.jsonl", *overrides], GRPOConfig)
    assert named in str(err.value)
    assert str(err.value).count("\n  - ") == 1  # one problem, one line


# ---- entropy bonus ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("coef", [0.0, 0.1])
def test_entropy_bonus_subtracts_the_aggregated_entropy(coef):
    # two tokens of ratio 1 and A = 1 (pg = -1 each), entropies 2 and 4: loss = -1 - coef * 3 (token mean)
    entropy = t([[2.0, 4.0]]).requires_grad_(True)
    cfg = ClippedPGLossConfig(kl_coef=0.0, entropy_coef=coef)
    zeros = torch.zeros(1, 2, dtype=torch.float64)
    loss, metrics = clipped_pg_loss(zeros, zeros, t([1.0]), torch.ones(1, 2), cfg, entropy=entropy)
    assert float(loss.detach()) == pytest.approx(-1.0 - coef * 3.0, rel=1e-12)
    assert metrics["entropy"] == 3.0 and metrics["loss/entropy"] == pytest.approx(-coef * 3.0, rel=1e-12)
    if coef:
        loss.backward()
        torch.testing.assert_close(entropy.grad, t([[-coef / 2, -coef / 2]]), **F64)
    with pytest.raises(ValueError, match="entropy_coef != 0 needs the per-token entropy"):
        clipped_pg_loss(zeros, zeros, t([1.0]), torch.ones(1, 2), ClippedPGLossConfig(kl_coef=0.0, entropy_coef=0.1))
