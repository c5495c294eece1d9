"""Reinforce++ advantages and the KL in the reward (`objectives/kl_reward.py`, NeMo-RL's
`ReinforcePlusPlusAdvantageEstimator` with `use_kl_in_reward`), by hand: float64 arithmetic compared at float64
rounding, the float32 results at one float32 ulp."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.objectives.kl_reward import (
    kl_in_reward_advantages,
    reinforce_pp_advantages,
    whiten_by_tokens,
)
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, clipped_pg_loss

F32 = {"rel": 2e-7, "abs": 1e-7}
"""A float64 computation cast to float32: one ulp (1.2e-7) of the value."""


def test_nemo_rls_global_normalization_case() -> None:
    # NeMo-RL test_reinforce_plus_plus_global_normalization: rewards 0..3 in one group, mask ones(4, 5)
    (adv,) = reinforce_pp_advantages([[0.0, 1.0, 2.0, 3.0]])
    assert adv.tolist() == [-1.5, -0.5, 0.5, 1.5]  # minus the group mean 1.5
    white = whiten_by_tokens(adv, torch.full((4,), 5.0))
    # mean 0, population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25
    assert white.tolist() == pytest.approx([x / math.sqrt(1.25) for x in (-1.5, -0.5, 0.5, 1.5)], rel=1e-15)
    assert float((white * 5).sum()) == pytest.approx(0.0, abs=1e-15)


def test_whitening_counts_each_trained_token_and_failed_samples_are_in_no_mean() -> None:
    (adv,) = reinforce_pp_advantages([[1.0, 0.0, 5.0]], valid_per_group=[[True, True, False]])
    assert adv.tolist() == [0.5, -0.5, 0.0]  # the failed third is in no mean and gets 0
    # 3 trained tokens at 1, 1 at -1: mean 0.5, variance (3 * 0.25 + 2.25) / 4 = 0.75
    white = whiten_by_tokens(torch.tensor([1.0, -1.0], dtype=torch.float64), torch.tensor([3.0, 1.0]))
    assert white.tolist() == pytest.approx([0.5 / math.sqrt(0.75), -1.5 / math.sqrt(0.75)], rel=1e-15)
    (raw,) = reinforce_pp_advantages([[1.0, 3.0]], minus_baseline=False)
    assert raw.tolist() == [1.0, 3.0]
    assert whiten_by_tokens(torch.tensor([2.0, 2.0]), torch.tensor([0.0, 0.0])).tolist() == [0.0, 0.0]
    # equal advantages: variance 0, floored at 1e-8 (NeMo-RL's clamp): 0 / 1e-4 = 0, no NaN
    assert whiten_by_tokens(torch.tensor([2.0, 2.0]), torch.tensor([1.0, 3.0])).tolist() == [0.0, 0.0]


MASKS = [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0])]
PREV = [torch.tensor([0.0, -1.0, -2.0]), torch.tensor([0.0, -0.5])]
REF = [torch.tensor([0.0, -1.5, -2.0]), torch.tensor([0.0, -0.5])]


def _whitened(values: list[float]) -> list[float]:
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return [(v - mean) / math.sqrt(var) for v in values]


@pytest.mark.parametrize(("estimator", "kl"), [
    ("k1", 0.5),  # -(log ref - log pi) = -(-1.5 + 1)
    ("k2", 0.125),  # x^2 / 2 with x = -0.5
    ("k3", math.exp(-0.5) + 0.5 - 1.0),  # exp(x) - x - 1
])
def test_the_kl_is_subtracted_per_trained_token_then_whitened(estimator: str, kl: float) -> None:
    cfg = ClippedPGLossConfig(kl_coef=0.1, kl_estimator=estimator, use_kl_in_reward=True)
    out = kl_in_reward_advantages(torch.tensor([1.0, -1.0]), MASKS, PREV, REF, cfg)
    # trained tokens: sample 0's two (KL `kl` and 0), sample 1's one (KL 0)
    expected = _whitened([1.0 - 0.1 * kl, 1.0, -1.0])
    assert out.shape == (2, 3) and out.dtype == torch.float32
    assert [out[0, 1], out[0, 2], out[1, 1]] == pytest.approx(expected, **F32)
    assert out[0, 0] == out[1, 0] == out[1, 2] == 0.0  # off the mask, and past sample 1's end


def test_the_kl_keeps_the_losss_clamps_and_a_step_without_trained_tokens_is_zero() -> None:
    cfg = ClippedPGLossConfig(kl_coef=0.5, kl_estimator="k1", use_kl_in_reward=True)
    far = [torch.tensor([0.0, -40.0]), torch.tensor([0.0, -1.0])]
    out = kl_in_reward_advantages(torch.tensor([0.0, 0.0]), [torch.tensor([0.0, 1.0])] * 2, far,
                                  [torch.tensor([0.0, -1.0])] * 2, cfg)
    # x = -1 + 40 = 39, clamped to 20: k1 = -20, clamped to -10: A = 0 - 0.5 * -10 = 5; the other token's is 0
    assert [out[0, 1], out[1, 1]] == pytest.approx(_whitened([5.0, 0.0]), **F32)
    nothing = kl_in_reward_advantages(torch.tensor([1.0]), [torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)], cfg)
    assert nothing.tolist() == [[0.0, 0.0]]


def test_the_loss_has_no_kl_term_but_reports_the_kl() -> None:
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)
    adv = torch.tensor([[0.5, -0.5]], dtype=torch.float64)
    args = (logprobs, logprobs.detach(), adv, torch.ones(1, 2))
    loss, metrics = clipped_pg_loss(*args, ClippedPGLossConfig(kl_coef=0.1, kl_estimator="k1", use_kl_in_reward=True),
                                    reference_logprobs=ref)
    plain, _ = clipped_pg_loss(*args, ClippedPGLossConfig(kl_coef=0.0))
    assert float(loss.detach()) == float(plain.detach()) == 0.0 and metrics["loss/kl"] == 0.0  # -mean(A) = 0 at ratio 1
    assert metrics["kl/mean"] == pytest.approx(0.25, rel=1e-15)  # k1 (0.5, 0) over two tokens


@pytest.mark.parametrize(("overrides", "named"), [
    (["grpo.adv_estimator=reinforce_plus_plus", "loss.use_kl_in_reward=true", "loss.kl_coef=0.0"],
     "use_kl_in_reward subtracts kl_coef * KL from the reward: it needs kl_coef > 0"),
    (["loss.use_kl_in_reward=true"], "loss.use_kl_in_reward: is read by grpo.adv_estimator: reinforce_plus_plus only"),
    (["grpo.adv_estimator=gdpo", "loss.use_kl_in_reward=true"], "(here 'gdpo'"),
])
def test_kl_in_reward_without_anything_to_work_with_is_one_config_error(overrides, named) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.train_path=t.jsonl", *overrides], GRPOConfig)
    assert named in str(err.value) and str(err.value).count("\n  - ") == 1, str(err.value)


def test_reinforce_plus_plus_with_the_kl_in_the_reward_loads() -> None:
    cfg = load_config(None, ["data.train_path=t.jsonl", "grpo.adv_estimator=reinforce_plus_plus",
                             "loss.use_kl_in_reward=true", "loss.kl_coef=0.001"], GRPOConfig)
    assert cfg.loss.to_loss_config().use_kl_in_reward and cfg.grpo.minus_baseline


def test_the_grpo_batch_of_reinforce_plus_plus_is_whitened_unless_the_trainer_subtracts_the_kl() -> None:
    from nemo_rl_ext.data.records import Completion, Message, PromptGroupRecord, StopReason
    from nemo_rl_ext.grpo.batch import build_training_batch

    prompt = (Message("user", "q", (1, 2, 3)),)

    def completion(reward: float, n: int) -> Completion:  # n generated tokens
        reply = Message("assistant", "a", tuple(range(4, 4 + n)), tuple([-0.1] * n))
        return Completion(message_log=(*prompt, reply), reward=reward, truncated=False,
                          stop_reason=StopReason.NATURAL, num_turns=1, agent_name="a")

    records = [PromptGroupRecord(0, prompt, {}, {}, (completion(1.0, 3), completion(0.0, 1)), {})]
    batch = build_training_batch(records, adv_estimator="reinforce_plus_plus")
    # r - mean = (0.5, -0.5) over 3 and 1 trained tokens: mean 0.25, variance (3 * 0.0625 + 0.5625) / 4 = 0.1875
    assert batch.advantages.tolist() == pytest.approx([0.25 / math.sqrt(0.1875), -0.75 / math.sqrt(0.1875)], **F32)
    unwhitened = build_training_batch(records, adv_estimator="reinforce_plus_plus", kl_in_reward=True)
    assert unwhitened.advantages.tolist() == [0.5, -0.5]
