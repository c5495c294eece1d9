"""GDPO advantages (multi-reward): each component's group advantage, a weighted sum, whitened over the batch.

The NeMo-RL cases are `tests/unit/algorithms/test_grpo.py` of NVIDIA-NeMo/RL (commit 7ea279ab, Aug 2026):
`test_gdpo_advantage_estimator_multiple_rewards` and `test_gdpo_advantage_estimator_reward_weights`, inputs
and expected values written out here. Their single-reward case (`..._single_reward`: GDPO refuses fewer than
two components) is `tests/unit/grpo/test_gdpo_batch.py`, where ours checks it.
"""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_ext.objectives.advantages import compute_gdpo_advantages

# Float64 arithmetic cast to float32: the float32 result is within one ulp (6e-8 relative) of the exact value;
# eps=1e-6 in a std's denominator moves a value by about 1e-6 relative where it does not cancel (below).
FLOAT32_CAST = {"rel": 1e-6, "abs": 1e-7}


def comps(**columns: list[float]) -> list[dict[str, float]]:
    """One group's per-sample component dicts from one column per component."""
    names = list(columns)
    return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def test_nemo_rl_multiple_rewards_case() -> None:
    # NeMo-RL test_gdpo_advantage_estimator_multiple_rewards: mean baseline, normalize_rewards, one prompt of 2;
    # correctness [1, 1] (equal: 0), integer [1, -1] (+-1 / sqrt(2)), format [1, 0] (+-0.5 / sqrt(0.5));
    # sum +-sqrt(2) -> whitened (ddof=1 std 2) +-1/sqrt(2) = their +-0.7071
    group = comps(correctness=[1.0, 1.0], integer=[1.0, -1.0], format=[1.0, 0.0])
    (adv,) = compute_gdpo_advantages(
        [group], dict.fromkeys(("correctness", "integer", "format"), 1.0), baseline="mean", normalize_std=True
    )
    assert adv.tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5)], **FLOAT32_CAST)
    assert adv.dtype == torch.float32


def test_nemo_rl_reward_weights_case_by_hand() -> None:
    # NeMo-RL test_gdpo_advantage_estimator_reward_weights: correctness [1, 0, 1], format [1, 1, 0], mean
    # baseline, normalize. Each component: deviations (1/3, -2/3, 1/3) (format: permuted), sample std sqrt(1/3),
    # so A_c = a (1, -2, 1), A_f = a (1, 1, -2) with the same a for both; whitening removes a (and eps with it).
    group = comps(correctness=[1.0, 0.0, 1.0], format=[1.0, 1.0, 0.0])

    def run(weights: dict[str, float]) -> list[float]:
        return compute_gdpo_advantages([group], weights, baseline="mean", normalize_std=True)[0].tolist()

    default = run({"correctness": 1.0, "format": 1.0})
    # sum a (2, -1, -1): mean 0, ddof=1 std a sqrt(3) -> (2, -1, -1) / sqrt(3)
    assert default == pytest.approx([2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], **FLOAT32_CAST)
    # theirs: any positive uniform scaling is invariant after the final whitening
    assert run({"correctness": 2.0, "format": 2.0}) == pytest.approx(default, **FLOAT32_CAST)
    # theirs: non-uniform weights change the advantages; by hand: a (1.25, -1.75, 0.5) / (a sqrt(2.4375))
    weighted = run({"correctness": 1.0, "format": 0.25})
    s = math.sqrt((1.25**2 + 1.75**2 + 0.5**2) / 2)
    assert weighted == pytest.approx([1.25 / s, -1.75 / s, 0.5 / s], **FLOAT32_CAST)
    assert weighted != pytest.approx(default, abs=1e-3)


def test_leave_one_out_two_groups_whitened_together() -> None:
    # leave-one-out, no std: group 1 a (1, 0, 0) -> (1, -0.5, -0.5), b (0, 0, 1) -> (-0.5, -0.5, 1);
    # group 2 a (1, 1) -> (0, 0) (equal), b (0, 1) -> (-1, 1). Weights a 2, b 1:
    # (1.5, -1.5, 0 | -1, 1): mean 0, ddof=1 std sqrt(6.5 / 4) over all five samples of the batch
    groups = [comps(a=[1.0, 0.0, 0.0], b=[0.0, 0.0, 1.0]), comps(a=[1.0, 1.0], b=[0.0, 1.0])]
    adv = compute_gdpo_advantages(groups, {"a": 2.0, "b": 1.0}, normalize_std=False)
    s = math.sqrt(6.5 / 4)
    assert [a.tolist() for a in adv] == [
        pytest.approx([1.5 / s, -1.5 / s, 0.0], **FLOAT32_CAST),
        pytest.approx([-1 / s, 1 / s], **FLOAT32_CAST),
    ]


def test_invalid_samples_stay_zero_and_leave_the_whitening() -> None:
    # the failed third sample's components are not read (it has none) and it is not in the batch mean or std:
    # a (1, 0) -> mean baseline, no std -> (0.5, -0.5); b (0, 0) -> 0; sum (0.5, -0.5) -> whitened
    # (ddof=1 std sqrt(0.5)) +-1/sqrt(2); the group of one valid sample adds a 0 to the batch
    groups = [[{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 0.0}, {}], [{"a": 5.0, "b": 5.0}]]
    adv = compute_gdpo_advantages(
        groups, {"a": 1.0, "b": 1.0}, baseline="mean", normalize_std=False,
        valid_per_group=[[True, True, False], [True]],
    )
    # batch (0.5, -0.5, 0): mean 0, ddof=1 std sqrt(0.25); the invalid entry is exactly 0
    assert adv[0].tolist() == pytest.approx([1.0, -1.0, 0.0], **FLOAT32_CAST)
    assert adv[0][2].item() == 0.0
    assert adv[1].tolist() == [0.0]


def test_a_batch_with_no_variance_gives_zeros_not_nan() -> None:
    adv = compute_gdpo_advantages([comps(a=[1.0, 1.0], b=[0.0, 0.0])], {"a": 1.0, "b": 1.0})
    assert adv[0].tolist() == [0.0, 0.0]
    assert compute_gdpo_advantages([], {"a": 1.0}) == []
