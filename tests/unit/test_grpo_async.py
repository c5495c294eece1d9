"""Asynchronous GRPO's pieces without a model: the `grpo.async` config, the staleness rules, and the collector
over the sleep-per-token engine (native rollouts, a scripted environment, a simulated trainer)."""

from __future__ import annotations

import asyncio
import time

import pytest

from nemo_rl_ext.algorithms.async_collector import AsyncCollector, CollectorError
from nemo_rl_ext.algorithms.grpo_config import AsyncSettings, DynamicSamplingSettings, GRPOConfig
from nemo_rl_ext.algorithms.prompt_stream import PromptStream
from nemo_rl_ext.algorithms.staleness import admission_budget, group_version, lag_histogram, lag_metrics
from nemo_rl_ext.algorithms.step_seeds import SaltedGeneration
from nemo_rl_ext.data.records import Completion, DatumSpec, Message, PromptGroupRecord, StopReason
from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.models.generation.interfaces import GenerationConfig
from nemo_rl_ext.testing import FailingEnvironment, Fault, ScriptedEnvironment, SleepGeneration

# ---- the config ---------------------------------------------------------------------------------


def grpo_config(**grpo) -> GRPOConfig:
    return GRPOConfig.model_validate({"data": {"train_path": "rows.jsonl"}, "grpo": grpo})


def test_async_is_off_by_default_and_round_trips_under_its_yaml_name() -> None:
    assert grpo_config().grpo.async_ == AsyncSettings() and not AsyncSettings().enabled
    cfg = grpo_config(**{"async": {"enabled": True, "max_lag": 2, "in_flight": "abort", "oversample": 3,
                                   "group_deadline_s": 30, "queue_size": 16}})
    dumped = cfg.model_dump(mode="json")
    assert dumped["grpo"]["async"] == {"enabled": True, "max_lag": 2, "in_flight": "abort", "oversample": 3,
                                       "group_deadline_s": 30.0, "queue_size": 16}
    assert GRPOConfig.model_validate(dumped) == cfg  # what a checkpoint saves compares equal on resume


def test_every_bad_async_value_is_reported_at_once() -> None:
    bad = {"max_lag": -1, "in_flight": "drop", "oversample": -2, "group_deadline_s": 0, "queue_size": 3,
           "enable": True}
    with pytest.raises(ValueError) as err:
        grpo_config(num_prompts_per_step=4, **{"async": bad})
    text = str(err.value)
    for key in ("grpo.async.max_lag", "grpo.async.in_flight", "grpo.async.oversample", "grpo.async.group_deadline_s",
                "grpo.async.enable"):
        assert key in text, (key, text)
    assert "grpo.async.queue_size" in text and "must be >= grpo.num_prompts_per_step (4)" in text, text
    with pytest.raises(ValueError, match="queue_size"):
        grpo_config(num_prompts_per_step=8, **{"async": {"queue_size": 4}})
    assert grpo_config(num_prompts_per_step=4, **{"async": {"queue_size": 4}}).grpo.async_.queue_size == 4


# ---- the staleness rules ----------------------------------------------------------------------------


def test_admission_follows_arealss_rule() -> None:
    # idle at version 3 after 3 steps: the steps training at versions 3..3+max_lag may still take groups
    assert admission_budget(3, 3, max_lag=0, per_step=4, oversample=0) == 4
    assert admission_budget(3, 3, max_lag=2, per_step=4, oversample=1) == 13
    # training step 4 (taken, version still 3): with max_lag 0 nothing may start (it could only be 1 behind)
    assert admission_budget(3, 4, max_lag=0, per_step=4, oversample=5) == 0
    assert admission_budget(3, 4, max_lag=1, per_step=4, oversample=0) == 4


def _record(versions: list[tuple[int, ...] | None]) -> PromptGroupRecord:
    completions = tuple(
        Completion((Message("user", "q", (1,)), Message("assistant", "a", tuple(range(len(v or (0,)))),
                                                        (0.0,) * len(v or (0,)), v)),
                   1.0, False, StopReason.NATURAL, 1, "t")
        for v in versions
    )
    return PromptGroupRecord(0, (Message("user", "q", (1,)),), {}, {}, completions, {})


def test_a_groups_version_is_its_oldest_token_or_its_start() -> None:
    record = _record([(5, 5, 6), (7,)])  # a turn that crossed an update shows both versions
    assert group_version(record, offset=10, start_version=0) == 15
    assert group_version(_record([None, None]), offset=10, start_version=14) == 14  # e.g. NeMo Gym's records


def test_lag_metrics_hold_every_bucket_up_to_max_lag() -> None:
    metrics = lag_metrics([0, 2, 2], max_lag=2)
    assert metrics == {"async/lag/0": 1.0, "async/lag/1": 0.0, "async/lag/2": 2.0, "async/lag/max": 2.0,
                       "async/lag/mean": 4 / 3}
    assert lag_histogram([metrics, lag_metrics([1], 2)]) == {0: 1, 1: 1, 2: 2}


# ---- the collector over the sleep engine ------------------------------------------------------------


def _setup(env, *, rows: int = 8, token_s: float = 0.001, max_new_tokens: int = 6, on_error: str = "record"):
    from nemo_rl_ext.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    engine = SleepGeneration(token_s=token_s, max_batch_size=64, tag=1, tokenizer=tokenizer)
    generation = SaltedGeneration(engine)
    manager = RolloutManager(tokenizer, {"t": env}, 2, 256, policy_generation=generation,
                             generation_config=GenerationConfig(max_new_tokens=max_new_tokens, seed=1),
                             fault_policy=FaultPolicy(on_error=on_error))
    datums = [DatumSpec(i, (Message("user", f"q{i}", (10 + i, 20 + i)),), "t") for i in range(rows)]
    return engine, manager, PromptStream(datums, seed=0, shuffle=False)


async def _train(collector: AsyncCollector, engine: SleepGeneration, steps: int, *, in_flight: str = "finish",
                 train_s: float = 0.01) -> list[dict[str, float]]:
    """A simulated trainer: take a step's groups, sleep, refit the engine, move the version on."""
    collector.start()
    out = []
    try:
        for step in range(1, steps + 1):
            taken = await collector.take()
            await collector.guard(asyncio.sleep(train_s))
            await collector.guard(asyncio.to_thread(engine.update_weights, {}, in_flight=in_flight))  # off the loop
            collector.set_version(step)
            out.append({**taken.metrics, "groups": float(len(taken.groups)),
                        "positions": [g.position for g in taken.groups]})
    finally:
        await collector.aclose()
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_flight", ["finish", "abort"])
def test_the_lag_never_passes_max_lag_and_aborted_turns_count_their_oldest_tokens(in_flight: str) -> None:
    engine, manager, stream = _setup(ScriptedEnvironment(turns=2, reward=lambda s: float(s.index)), token_s=0.004)
    settings = AsyncSettings(enabled=True, max_lag=1, in_flight=in_flight)
    collector = AsyncCollector(manager, stream, settings, per_step=2, version=0, offset=0, salt_prefix=1)
    steps = asyncio.run(_train(collector, engine, 8, in_flight=in_flight, train_s=0.03))
    assert all(s["groups"] == 2.0 and s["async/lag/max"] <= 1.0 for s in steps)
    assert sum(s["async/lag/1"] for s in steps) > 0  # groups did run across updates
    if in_flight == "abort":
        assert engine._aborts == 8


@pytest.mark.timeout(30)
def test_dynamic_sampling_steps_with_what_it_has_after_max_gen_batches() -> None:
    engine, manager, stream = _setup(ScriptedEnvironment(reward=0.0))  # every group has zero variance
    settings = AsyncSettings(enabled=True, max_lag=1)
    collector = AsyncCollector(manager, stream, settings, per_step=2, version=0, offset=0, salt_prefix=1,
                               dynamic=DynamicSamplingSettings(enabled=True, max_gen_batches=3))
    steps = asyncio.run(_train(collector, engine, 2))
    for s in steps:
        assert s["groups"] == 0.0 and s["dynamic_sampling/kept_groups"] == 0.0
        assert s["dynamic_sampling/gen_batches"] >= 3.0 and s["dynamic_sampling/zero_variance_fraction"] == 1.0


@pytest.mark.timeout(30)
def test_a_raising_rollout_fails_the_trainers_wait_at_once() -> None:
    env = FailingEnvironment(ValueError("grader exploded"), when=lambda s: s.question == "q5")
    engine, manager, stream = _setup(env, on_error="raise")  # errors raised, not recorded as data
    collector = AsyncCollector(manager, stream, AsyncSettings(enabled=True, max_lag=2), per_step=2, version=0,
                               offset=0, salt_prefix=1)
    start = time.monotonic()
    with pytest.raises(CollectorError, match="row 5 raised.*grader exploded"):
        asyncio.run(_train(collector, engine, 50, train_s=0.2))
    assert time.monotonic() - start < 5.0


@pytest.mark.timeout(30)
def test_a_hung_group_is_cancelled_at_its_deadline_and_its_row_is_not_retried() -> None:
    env = FailingEnvironment(Fault.HANG, when=lambda s: s.question == "q1")
    engine, manager, stream = _setup(env, rows=4)
    settings = AsyncSettings(enabled=True, max_lag=0, group_deadline_s=0.5)
    collector = AsyncCollector(manager, stream, settings, per_step=2, version=0, offset=0, salt_prefix=1)
    steps = asyncio.run(_train(collector, engine, 2))
    assert steps[0]["async/groups/deadline_expired"] == 1.0, steps
    assert steps[0]["positions"] == [0, 2]  # the step went on with the next row drawn, not row 1 again
