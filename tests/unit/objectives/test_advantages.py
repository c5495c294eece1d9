"""Group advantages: hand-computed values, NeMo-RL's formulas written out here, groups of one, zero variance,
uneven group sizes, failed rollouts left out."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nemo_rl_ext.objectives.advantages import compute_group_advantages, flatten_group_advantages


def leave_one_out_by_definition(group: list[float]) -> list[float]:
    n = len(group)
    return [r - math.fsum(group[j] for j in range(n) if j != i) / (n - 1) for i, r in enumerate(group)]


def test_mean_baseline_without_std() -> None:
    # rewards 1, 0, 0, 1 -> mean 0.5 -> advantages 0.5, -0.5, -0.5, 0.5
    (adv,) = compute_group_advantages([[1.0, 0.0, 0.0, 1.0]], baseline="mean", normalize_std=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]
    assert adv.dtype == torch.float32


def test_mean_baseline_with_std() -> None:
    # rewards 1, 0, 0, 1: sample std = sqrt((4 * 0.25) / 3) = sqrt(1/3) ~ 0.57735
    # advantages = +-0.5 / (sqrt(1/3) + eps) ~ +-0.866025
    (adv,) = compute_group_advantages([[1.0, 0.0, 0.0, 1.0]], baseline="mean", normalize_std=True, eps=0.0)
    expected = 0.5 / math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6, abs=1e-6)
    (adv_eps,) = compute_group_advantages([[1.0, 0.0, 0.0, 1.0]], baseline="mean", normalize_std=True, eps=0.1)
    assert adv_eps[0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 0.1), rel=1e-6, abs=1e-6)


def test_leave_one_out_baseline_hand_values() -> None:
    # rewards 1, 0, 0: baselines (0+0)/2 = 0, (1+0)/2 = .5, (1+0)/2 = .5 -> advantages 1, -.5, -.5
    (adv,) = compute_group_advantages([[1.0, 0.0, 0.0]], baseline="leave_one_out", normalize_std=False)
    assert adv.tolist() == pytest.approx([1.0, -0.5, -0.5])
    # with std (NeMo-RL): sample 0's others (0, 0) have std 0 -> not divided: 1; sample 1's others (1, 0)
    # have sample std sqrt(1/2) -> -.5 / sqrt(1/2) = -sqrt(1/2)
    (adv_std,) = compute_group_advantages(
        [[1.0, 0.0, 0.0]], baseline="leave_one_out", normalize_std=True, eps=0.0
    )
    assert adv_std.tolist() == pytest.approx([1.0, -math.sqrt(0.5), -math.sqrt(0.5)], rel=1e-6, abs=1e-6)
    # std_scope="group": every sample divided by the whole group's sample std, sqrt(1/3)
    (adv_group,) = compute_group_advantages(
        [[1.0, 0.0, 0.0]], baseline="leave_one_out", normalize_std=True, eps=0.0, std_scope="group"
    )
    s = math.sqrt(1 / 3)
    assert adv_group.tolist() == pytest.approx([1.0 / s, -0.5 / s, -0.5 / s], rel=1e-6, abs=1e-6)


def test_leave_one_out_matches_definition_on_random_groups() -> None:
    rng = random.Random(0)
    groups = [[rng.uniform(-2, 3) for _ in range(rng.randint(2, 9))] for _ in range(50)]
    advs = compute_group_advantages(
        groups, baseline="leave_one_out", normalize_std=False, dtype=torch.float64
    )
    for group, adv in zip(groups, advs, strict=True):
        assert adv.tolist() == pytest.approx(leave_one_out_by_definition(group), rel=1e-12, abs=1e-12)


def test_group_of_one_and_zero_variance_get_zero() -> None:
    groups = [[0.7], [1.0, 1.0, 1.0], [0.1, 0.1, 0.1], [0.0, 1.0]]
    for baseline in ("mean", "leave_one_out"):
        for normalize in (True, False):
            advs = compute_group_advantages(groups, baseline=baseline, normalize_std=normalize, eps=0.0)
            assert advs[0].tolist() == [0.0]
            assert advs[1].tolist() == [0.0, 0.0, 0.0]
            assert advs[2].tolist() == [0.0, 0.0, 0.0]  # exactly 0, no 1e-17 / eps blow-up
            assert all(bool(torch.isfinite(a).all()) for a in advs)
            assert advs[3][0].item() < 0 < advs[3][1].item()


def test_different_sizes_and_flatten() -> None:
    # group 0: (1, 0) -> mean .5 -> (.5, -.5); group 1: (2, 2, 5) -> mean 3 -> (-1, -1, 2); group 2: empty
    advs = compute_group_advantages([[1.0, 0.0], [2.0, 2.0, 5.0], []], baseline="mean", normalize_std=False)
    assert [a.tolist() for a in advs] == [[0.5, -0.5], [-1.0, -1.0, 2.0], []]
    flat, group_ids = flatten_group_advantages(advs)
    assert flat.tolist() == [0.5, -0.5, -1.0, -1.0, 2.0]
    assert group_ids.tolist() == [0, 0, 1, 1, 1]
    # normalized advantages have unit sample std within each (non-degenerate) group
    advs_std = compute_group_advantages(
        [[1.0, 0.0, 3.0, 7.0], [2.0, 2.0, 5.0]], baseline="mean", normalize_std=True, eps=0.0
    )
    for a in advs_std:
        assert a.double().std(correction=1).item() == pytest.approx(1.0, rel=1e-6, abs=1e-6)
        assert a.double().mean().item() == pytest.approx(0.0, rel=1e-6, abs=1e-6)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="baseline"):
        compute_group_advantages([[1.0, 0.0]], baseline="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="finite"):
        compute_group_advantages([[1.0, float("nan")]])
    with pytest.raises(ValueError, match="eps"):
        compute_group_advantages([[1.0, 0.0]], eps=-1.0)
    with pytest.raises(ValueError, match="std_scope"):
        compute_group_advantages([[1.0, 0.0]], std_scope="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group 1: 2 rewards but 3 valid flags") as err:
        compute_group_advantages([[1.0], [1.0, 0.0], [2.0, float("inf")]], valid_per_group=[[1], [1, 1, 0], [1, 1]])
    assert "group 2: rewards must be finite" in str(err.value)  # every bad group at once
    # an invalid sample's reward is not looked at
    (adv,) = compute_group_advantages([[1.0, 0.0, float("nan")]], valid_per_group=[[True, True, False]])
    assert adv.tolist() == [1.0, -1.0, 0.0]


# ---- NeMo-RL's formulas, written out independently ----------------------------------------------------


def nemo_rl_advantages(rewards: list[float], valid: list[bool], leave_one_out: bool = True) -> list[float]:
    """NeMo-RL's GRPO advantages of one prompt's samples, from `calculate_baseline_and_std_per_prompt` and
    `GRPOAdvantageEstimator` (use_leave_one_out_baseline, normalize_rewards=True):

        k = sum(valid)
        if k <= 1:  baseline_i = r_i (so A_i = 0), std_i = 0
        else:       n = k - 1 if leave_one_out else k
                    baseline_i = sum_{j in S_i} valid_j r_j / n,  sq_i = sum_{j in S_i} valid_j r_j^2 / n
                    (S_i = all j != i with leave_one_out, all j without)
                    std_i = sqrt((sq_i - baseline_i^2) * n / (n - 1)), nan -> 0
        A_i = r_i - baseline_i;  where std_i > 0: A_i = A_i / (std_i + 1e-6)

    Samples with valid 0 are masked out of NeMo-RL's loss; here their advantage is 0.
    """
    k = sum(valid)
    out = []
    for i, r_i in enumerate(rewards):
        if not valid[i] or k <= 1:
            out.append(0.0)
            continue
        n = k - 1 if leave_one_out else k
        members = [j for j in range(len(rewards)) if valid[j] and (j != i or not leave_one_out)]
        baseline = sum(rewards[j] for j in members) / n
        sq = sum(rewards[j] ** 2 for j in members) / n
        var = (sq - baseline**2) * n / (n - 1) if n > 1 else float("nan")
        std = math.sqrt(var) if var > 0 else 0.0  # nan (n = 1) or a rounding negative -> 0, as nan_to_num
        a = r_i - baseline
        out.append(a / (std + 1e-6) if std > 0 else a)
    return out


def test_one_correct_of_four_gets_one_not_two() -> None:
    # the issue's example: [1, 0, 0, 0]. Sample 0's others are all 0 (std 0): A = 1 - 0 = 1.0, undivided.
    # Samples 1-3: others (1, 0, 0), baseline 1/3, sample std sqrt(1/3): A = -(1/3) / sqrt(1/3) = -0.57735
    (adv,) = compute_group_advantages([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    third = -(1 / 3) / (math.sqrt(1 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([1.0, third, third, third], rel=1e-9, abs=1e-9)
    assert adv.tolist() == pytest.approx(nemo_rl_advantages([1.0, 0.0, 0.0, 0.0], [True] * 4), rel=1e-9, abs=1e-9)
    # the previous rule (the whole group's std) stays available by name: 1 / sqrt(1/4) = 2.0
    (old,) = compute_group_advantages([[1.0, 0.0, 0.0, 0.0]], std_scope="group", eps=0.0)
    assert old.tolist() == pytest.approx([2.0, -2 / 3, -2 / 3, -2 / 3], rel=1e-6, abs=1e-6)


HAND_GROUPS = [
    # (rewards, valid, expected leave-one-out advantages worked by hand)
    (
        [1.0, 0.0, 1.0, 0.0, 0.0],
        [True] * 5,
        # r=1: others (0,1,0,0) mean .25, std .5 -> .75/.5 = 1.5;
        # r=0: others (1,1,0,0) mean .5, std sqrt(1/3) -> -.5/sqrt(1/3) = -0.866025
        [1.5, -0.5 / math.sqrt(1 / 3), 1.5, -0.5 / math.sqrt(1 / 3), -0.5 / math.sqrt(1 / 3)],
    ),
    (
        [0.2, 0.9, 0.5],
        [True] * 3,
        # two others each: (0.9, 0.5) mean .7 std sqrt(.08); (0.2, 0.5) mean .35 std sqrt(.045);
        # (0.2, 0.9) mean .55 std sqrt(.245)
        [-0.5 / math.sqrt(0.08), 0.55 / math.sqrt(0.045), -0.05 / math.sqrt(0.245)],
    ),
    ([1.0, 0.0], [True] * 2, [1.0, -1.0]),  # one other each: the std of one value is 0 -> undivided
    ([0.7], [True], [0.0]),  # a group of one
    ([3.0, 3.0, 3.0], [True] * 3, [0.0, 0.0, 0.0]),  # no variance
    # a failed rollout (reward 0, invalid) is left out: the group is (1, 0, 0) for the others
    ([1.0, 0.0, 0.0, 0.0], [True, True, True, False], [1.0, -math.sqrt(0.5), -math.sqrt(0.5), 0.0]),
    # an error next to a single valid sample: nothing to compare against
    ([1.0, 0.0], [True, False], [0.0, 0.0]),
]


def test_hand_groups_of_uneven_sizes_with_errors_match_nemo_rl() -> None:
    rewards = [g[0] for g in HAND_GROUPS]
    valid = [g[1] for g in HAND_GROUPS]
    advs = compute_group_advantages(rewards, valid_per_group=valid, dtype=torch.float64)
    for (r, v, hand), adv in zip(HAND_GROUPS, advs, strict=True):
        reference = nemo_rl_advantages(r, v)
        assert hand == pytest.approx(reference, rel=1e-5, abs=1e-9), (r, v)  # hand numbers are NeMo-RL's (eps aside)
        assert adv.tolist() == pytest.approx(reference, rel=1e-9, abs=1e-9), (r, v)


def test_failed_rollouts_do_not_pull_siblings_down() -> None:
    # siblings (1, 1, 0) plus an error scored 0: counted, it would lower every sibling's baseline
    rewards, valid = [1.0, 1.0, 0.0, 0.0], [True, True, True, False]
    (with_mask,) = compute_group_advantages([rewards], valid_per_group=[valid], dtype=torch.float64)
    (without_error,) = compute_group_advantages([rewards[:3]], dtype=torch.float64)
    # bit-exact: 0/1 rewards make every sum exact, so the masked (4-wide) and the 3-wide reductions cannot differ
    assert with_mask[:3].tolist() == without_error.tolist() and with_mask[3].item() == 0.0
    assert with_mask.tolist() == pytest.approx(nemo_rl_advantages(rewards, valid), rel=1e-9, abs=1e-9)
    # counted as a 0 (the old behaviour), it moves every sibling's advantage: 1 -> 1.1547, 0 -> -0.8660
    (counted,) = compute_group_advantages([rewards], dtype=torch.float64)
    assert counted[:3].tolist() != pytest.approx(with_mask[:3].tolist(), abs=1e-3)


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_random_groups_with_random_errors_match_nemo_rl(leave_one_out: bool) -> None:
    rng = random.Random(7)
    groups = [[round(rng.uniform(-1, 2), 3) for _ in range(rng.randint(1, 9))] for _ in range(200)]
    valid = [[rng.random() > 0.2 for _ in g] for g in groups]
    advs = compute_group_advantages(
        groups,
        baseline="leave_one_out" if leave_one_out else "mean",
        valid_per_group=valid,
        dtype=torch.float64,
    )
    for g, v, adv in zip(groups, valid, advs, strict=True):
        assert adv.tolist() == pytest.approx(nemo_rl_advantages(g, v, leave_one_out), rel=1e-7, abs=1e-7), (g, v)
