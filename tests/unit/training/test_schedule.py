"""`optimizer.scheduler`: the learning rate at given GRPO steps, worked out by hand from the formula in
`training/schedule.py`, and the settings a config refuses (one error naming the key)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.training.config import OptimizerSettings
from nemo_rl_ext.training.schedule import scheduled_lr, warmup_steps

SHIPPED = Path(__file__).resolve().parents[3] / "examples" / "configs" / "grpo_smollm2.yaml"


def settings(**scheduler) -> OptimizerSettings:
    return OptimizerSettings(lr=1e-4, scheduler=scheduler)


def lrs(opt: OptimizerSettings, total: int) -> list[float]:
    return [scheduled_lr(opt, s, total) for s in range(1, total + 1)]


def test_the_default_keeps_lr_constant() -> None:
    assert lrs(OptimizerSettings(lr=3e-4), 5) == [3e-4] * 5


def test_constant_after_a_linear_warm_up() -> None:
    # W = 4: lr x s/4 for s = 1..4, then lr
    assert lrs(settings(warmup_steps=4), 6) == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4], rel=1e-12)


def test_linear_decay_to_min_lr_after_warm_up() -> None:
    # T = 10, W = 2, min 1e-5: s = 3..10 decays over p = (s - 2)/8; 1e-5 + 9e-5 (1 - p)
    got = lrs(settings(type="linear", warmup_steps=2, min_lr=1e-5), 10)
    expected = [5e-5, 1e-4] + [1e-5 + 9e-5 * (1 - (s - 2) / 8) for s in range(3, 11)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[2] == pytest.approx(8.875e-5, rel=1e-12)  # s = 3: p = 1/8
    assert got[-1] == 1e-5


def test_cosine_decay_with_a_warm_up_ratio() -> None:
    # T = 10, ratio 0.2: W = ceil(2.0) = 2; s = 6: p = 4/8, cos(pi/2) = 0 -> halfway between lr and min_lr
    opt = settings(type="cosine", warmup_ratio=0.2, min_lr=1e-5)
    assert warmup_steps(opt, 10) == 2
    assert scheduled_lr(opt, 6, 10) == pytest.approx(5.5e-5, rel=1e-12)
    assert scheduled_lr(opt, 4, 10) == pytest.approx(1e-5 + 9e-5 * (1 + math.cos(math.pi / 4)) / 2, rel=1e-12)
    assert scheduled_lr(opt, 10, 10) == 1e-5
    assert scheduled_lr(opt, 14, 10) == 1e-5  # past the horizon (a resume that trains longer): min_lr
    # ratio rounds up as transformers does: 0.15 x 10 -> 2
    assert warmup_steps(settings(warmup_ratio=0.15), 10) == 2


def test_a_decay_without_warm_up_starts_at_lr() -> None:
    assert lrs(settings(type="linear"), 3) == pytest.approx([1e-4, 5e-5, 0.0], rel=1e-12, abs=0)


def test_step_counts_from_one() -> None:
    with pytest.raises(ValueError, match="count from 1"):
        scheduled_lr(settings(), 0, 5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optimizer.scheduler.warmup_steps=2", "optimizer.scheduler.warmup_ratio=0.1"],
         "optimizer.scheduler.warmup_ratio: give warmup_steps or warmup_ratio, not both"),
        (["optimizer.scheduler.warmup_ratio=1.5"], "optimizer.scheduler.warmup_ratio"),
        (["optimizer.scheduler.type=cosine", "optimizer.scheduler.min_lr=1.0"],
         r"optimizer.scheduler.min_lr: must be at most optimizer.lr \(2e-06\)"),
        (["optimizer.scheduler.type=exponential"], "optimizer.scheduler.type"),
        (["optimizer.scheduler.warmup_steps=-1"], "optimizer.scheduler.warmup_steps"),
    ],
)
def test_bad_schedules_are_one_config_problem_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_config(SHIPPED, overrides, GRPOConfig)
    assert "1 problem(s)" in str(err.value)


def test_several_bad_schedule_keys_are_reported_together() -> None:
    bad = ["optimizer.scheduler.warmup_steps=2", "optimizer.scheduler.warmup_ratio=0.1",
           "optimizer.scheduler.min_lr=1.0", "grpo.max_num_steps=0"]
    with pytest.raises(ConfigError) as err:
        load_config(SHIPPED, bad, GRPOConfig)
    text = str(err.value)
    assert "3 problem(s)" in text, text
    for key in ("optimizer.scheduler.warmup_ratio", "optimizer.scheduler.min_lr", "grpo.max_num_steps"):
        assert key in text, text


def test_a_checkpoint_saved_before_schedules_existed_resumes_at_its_constant_lr_only() -> None:
    """Its saved config has no `optimizer.scheduler` and its state no `schedule_steps`: it trained at a constant lr,
    so it resumes under today's default (constant) and a resume that adds a schedule is refused naming the key
    (the schedule is not in RESUME_MAY_CHANGE: it changes what a step computes)."""
    from nemo_rl_ext.grpo.build import check_saved_config
    from nemo_rl_ext.training.checkpoint import Checkpoint

    old = load_config(SHIPPED, [], GRPOConfig).model_dump(mode="json")
    del old["optimizer"]["scheduler"]  # as a checkpoint of then saved it
    checkpoint = Checkpoint(path=Path("run/checkpoints/step_2"), step=2, data_state={}, extra={"config": old})
    check_saved_config(load_config(SHIPPED, [], GRPOConfig), checkpoint)  # no schedule: resumes
    with pytest.raises(ConfigError, match=r"optimizer\.scheduler\.type: 'constant' -> 'cosine'"):
        check_saved_config(load_config(SHIPPED, ["optimizer.scheduler.type=cosine"], GRPOConfig), checkpoint)
