"""Asynchronous GRPO's pieces without a model: the `grpo.async` config, the staleness rules, and the collector
over the sleep-per-token engine (native rollouts, a scripted environment, a simulated trainer)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.data.records import Completion, DatumSpec, Message, PromptGroupRecord, StopReason
from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.grpo.async_collector import AsyncCollector, CollectorError, TakenStep
from nemo_rl_ext.grpo.config import (
    AsyncSettings,
    DynamicSamplingSettings,
    GRPOConfig,
    GRPOSettings,
    async_wedge_warning,
)
from nemo_rl_ext.grpo.prompt_stream import PromptStream
from nemo_rl_ext.grpo.step_seeds import SaltedGeneration
from nemo_rl_ext.models.generation.interfaces import GenerationConfig
from nemo_rl_ext.objectives.staleness import (
    admission_budget,
    group_version,
    lag_histogram,
    lag_metrics,
    token_versions,
)
from nemo_rl_ext.testing import (
    FailingEnvironment,
    Fault,
    ScriptedEnvironment,
    ScriptedGeneration,
    SleepGeneration,
)

# ---- the config ---------------------------------------------------------------------------------


def grpo_config(**grpo) -> GRPOConfig:
    return GRPOConfig.model_validate({"data": {"train_path": "rows.jsonl"}, "grpo": grpo})


def test_async_is_off_by_default_and_round_trips_under_its_yaml_name() -> None:
    assert grpo_config().grpo.async_ == AsyncSettings() and not AsyncSettings().enabled
    assert AsyncSettings().in_flight == "abort"  # a refit does not wait for the longest generation in flight
    cfg = grpo_config(**{"async": {"enabled": True, "max_lag": 2, "in_flight": "finish", "oversample": 3,
                                   "group_deadline_s": 30, "queue_size": 16}})
    dumped = cfg.model_dump(mode="json")
    assert dumped["grpo"]["async"] == {"enabled": True, "max_lag": 2, "in_flight": "finish", "oversample": 3,
                                       "group_deadline_s": 30.0, "queue_size": 16}
    assert GRPOConfig.model_validate(dumped) == cfg  # what a checkpoint saves compares equal on resume


def test_stale_rollouts_turn_the_importance_sampling_correction_on() -> None:
    """NeMo-RL's default is off, but its async GRPO guide calls the correction required for convergence when a
    trajectory may be one or more steps old: with grpo.async on and max_lag > 0 it defaults to on."""
    assert grpo_config().loss.importance_sampling_correction is False
    assert grpo_config(**{"async": {"enabled": True}}).loss.importance_sampling_correction is True  # max_lag 1
    assert grpo_config(**{"async": {"enabled": True, "max_lag": 3}}).loss.importance_sampling_correction is True
    assert grpo_config(**{"async": {"enabled": True, "max_lag": 0}}).loss.importance_sampling_correction is False
    assert grpo_config(**{"async": {"enabled": False, "max_lag": 2}}).loss.importance_sampling_correction is False
    on = GRPOConfig.model_validate({"data": {"train_path": "x"}, "grpo": {"async": {"enabled": True}},
                                    "loss": {"importance_sampling_correction": True, "importance_sampling_cap": 2.0}})
    assert on.loss.importance_sampling_correction is True and on.loss.importance_sampling_cap == 2.0
    assert GRPOConfig.model_validate(on.model_dump(mode="json")) == on  # a checkpoint's config resumes
    # the other loss keys keep their defaults beside the filled-in one
    filled = load_config(None, ["data.train_path=x", "grpo.async.enabled=true", "loss.clip_high=0.28"], GRPOConfig)
    assert filled.loss.importance_sampling_correction is True and filled.loss.clip_high == 0.28
    assert filled.loss.kl_coef == 0.01


def test_an_explicit_false_with_stale_rollouts_is_refused_with_the_other_problems() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.train_path=x", "grpo.async.enabled=true", "grpo.async.max_lag=2",
                           "loss.importance_sampling_correction=false", "loss.clip_low=1.5",
                           "grpo.num_prompts_per_step=0"], GRPOConfig)
    text = str(err.value)
    assert "loss.importance_sampling_correction: must be true when grpo.async is enabled with max_lag > 0 (here 2)" \
        in text, text
    assert "required for convergence" in text and "one or more steps old" in text
    assert "clip_low must be in [0, 1)" in text and "grpo.num_prompts_per_step" in text  # every problem at once
    # max_lag 0 trains on rollouts of the current weights only: false is allowed there
    cfg = load_config(None, ["data.train_path=x", "grpo.async.enabled=true", "grpo.async.max_lag=0",
                             "loss.importance_sampling_correction=false"], GRPOConfig)
    assert cfg.loss.importance_sampling_correction is False


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


def test_a_config_where_one_hung_group_stops_the_run_is_warned_about() -> None:
    warning = async_wedge_warning(AsyncSettings(enabled=True, max_lag=0))
    assert warning is not None and "grpo.async.oversample >= 1 or grpo.async.group_deadline_s" in warning
    for slack in ({"max_lag": 1}, {"max_lag": 0, "oversample": 1}, {"max_lag": 0, "group_deadline_s": 60.0},
                  {"enabled": False, "max_lag": 0}):
        assert async_wedge_warning(AsyncSettings(**{"enabled": True, **slack})) is None, slack


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


def _setup(env, *, rows: int = 8, token_s: float = 0.001, max_new_tokens: int = 6, on_error: str = "record",
           hang: int | None = None, length: Callable[[Sequence[int], GenerationConfig], int] | None = None):
    """The sleep engine behind native rollouts of `rows` one-message rows in order: row i is "q<i>" with the
    prompt ids (10 + i, 20 + i). With `hang` = i, row i's generations never return (hung before any output);
    `length`: the engine's lengths."""
    from nemo_rl_ext.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    engine = SleepGeneration(token_s=token_s, max_batch_size=64, tag=1, tokenizer=tokenizer, length=length)
    policy = engine
    if hang is not None:
        policy = ScriptedGeneration(tokenizer, lambda r: Fault.HANG if 20 + hang in r.prompt_token_ids else None,
                                    backend=engine, record=False)
    generation = SaltedGeneration(policy)
    manager = RolloutManager(tokenizer, {"t": env}, 2, 256, policy_generation=generation,
                             generation_config=GenerationConfig(max_new_tokens=max_new_tokens, seed=1),
                             fault_policy=FaultPolicy(on_error=on_error))
    datums = [DatumSpec(i, (Message("user", f"q{i}", (10 + i, 20 + i)),), "t") for i in range(rows)]
    return engine, manager, PromptStream(datums, seed=0, shuffle=False)


async def _train(collector: AsyncCollector, engine: SleepGeneration, steps: int, *, in_flight: str = "finish",
                 train_s: float = 0.01, taken: list[TakenStep] | None = None) -> list[dict[str, Any]]:
    """A simulated trainer: take a step's groups, sleep, refit the engine from a worker thread (as GRPO does:
    a refit in "finish" mode waits for the requests in flight), move the version on."""
    collector.start()
    out = []
    try:
        for step in range(1, steps + 1):
            took = await collector.take(final=step == steps)
            await collector.guard(asyncio.sleep(train_s))
            await collector.guard(asyncio.to_thread(engine.update_weights, {}, in_flight=in_flight))
            collector.set_version(step)
            if taken is not None:
                taken.append(took)
            out.append({**took.metrics, "groups": float(len(took.groups)),
                        "positions": [g.position for g in took.groups]})
    finally:
        await collector.aclose()
    return out


def _collector(manager, stream, *, per_step: int = 2, **knobs) -> AsyncCollector:
    return AsyncCollector(manager, stream, AsyncSettings(enabled=True, **knobs), per_step=per_step, version=0,
                          offset=0, salt_prefix=1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("in_flight", ["finish", "abort"])
def test_the_lag_never_passes_max_lag_and_aborted_turns_count_their_oldest_tokens(in_flight: str) -> None:
    engine, manager, stream = _setup(ScriptedEnvironment(turns=2, reward=lambda s: float(s.index)), token_s=0.004,
                                     max_new_tokens=20)
    taken: list[TakenStep] = []
    steps = asyncio.run(_train(_collector(manager, stream, max_lag=1, in_flight=in_flight), engine, 8,
                               in_flight=in_flight, train_s=0.03, taken=taken))
    assert all(s["groups"] == 2.0 and s["async/lag/max"] <= 1.0 for s in steps)
    assert sum(s["async/lag/1"] for s in steps) > 0  # groups did run across updates
    # every trained group's version is its oldest token's, whatever turn or piece of a turn it is in
    for step, took in enumerate(taken):
        for group in took.groups:
            assert group.version == min(token_versions(group.record))
            assert step - group.version <= 1  # the version when it trained (step) minus its oldest token's
    turns = [m.generation_weight_versions for t in taken for g in t.groups for c in g.record.completions
             for m in c.message_log if m.generation_weight_versions]
    mixed = [v for v in turns if len(set(v)) > 1]
    if in_flight == "abort":  # an aborted turn continued on the new weights: one turn, two versions, in order
        assert mixed, "no turn crossed a weight update"
        assert all(list(v) == sorted(v) and v[-1] == v[0] + 1 for v in mixed)
    else:  # a refit waits for the requests in flight: a turn never spans two versions
        assert not mixed


@pytest.mark.timeout(30)
def test_dynamic_sampling_steps_with_what_it_has_after_max_gen_batches() -> None:
    engine, manager, stream = _setup(ScriptedEnvironment(reward=0.0))  # every group has zero variance
    collector = AsyncCollector(manager, stream, AsyncSettings(enabled=True, max_lag=1), per_step=2, version=0,
                               offset=0, salt_prefix=1,
                               dynamic=DynamicSamplingSettings(enabled=True, max_gen_batches=3))
    steps = asyncio.run(_train(collector, engine, 2))
    for s in steps:
        assert s["groups"] == 0.0 and s["dynamic_sampling/kept_groups"] == 0.0
        assert s["dynamic_sampling/gen_batches"] >= 3.0 and s["dynamic_sampling/zero_variance_fraction"] == 1.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("during", ["take", "train"])
def test_a_raising_rollout_fails_the_trainers_wait_at_once(during: str) -> None:
    """Raised while the trainer waits for groups, or while it trains (the failure cuts the training wait)."""
    env = FailingEnvironment(ValueError("grader exploded"), when=lambda s: s.question == "q5")
    # while training: rows 0-5 start at once (max_lag 2), row 5 generates 40 tokens (0.4 s), the others 6:
    # step 1 takes two short groups and trains for 5 s; row 5 fails during it
    slow_row_5 = (lambda ids, config: 40 if 25 in ids else 6) if during == "train" else None
    engine, manager, stream = _setup(env, on_error="raise", token_s=0.01, max_new_tokens=40, length=slow_row_5)
    start = time.monotonic()
    with pytest.raises(CollectorError, match="row 5 raised.*grader exploded"):
        asyncio.run(_train(_collector(manager, stream, max_lag=2), engine, 50,
                           train_s=0.2 if during == "take" else 5.0))
    assert time.monotonic() - start < 3.0


@pytest.mark.timeout(30)
def test_a_bad_reward_component_reaches_the_trainer_as_the_user_error_it_is() -> None:
    """Raised by the rollout even with on_error: record, and passed on unwrapped, so the CLI exits 2 with it."""
    from nemo_rl_ext.data.records import RewardComponentError

    env = ScriptedEnvironment(reward=1.0, reward_components={"correct": 1.0, "format": None})
    engine, manager, stream = _setup(env)
    with pytest.raises(RewardComponentError, match="environment 't': reward component field 'format'"):
        asyncio.run(_train(_collector(manager, stream, max_lag=1), engine, 3))


@pytest.mark.timeout(30)
def test_a_hung_group_is_cancelled_at_its_deadline_and_its_row_is_not_retried() -> None:
    env = FailingEnvironment(Fault.HANG, when=lambda s: s.question == "q1")
    engine, manager, stream = _setup(env, rows=4)
    steps = asyncio.run(_train(_collector(manager, stream, max_lag=0, group_deadline_s=0.5), engine, 2))
    assert steps[0]["async/groups/deadline_expired"] == 1.0, steps
    assert steps[0]["positions"] == [0, 2]  # the step went on with the next row drawn, not row 1 again


@pytest.mark.timeout(30)
@pytest.mark.parametrize("oversample", [0, 1])
def test_one_spare_group_keeps_a_hung_group_from_stopping_max_lag_0(oversample: int) -> None:
    hang = FailingEnvironment(Fault.HANG, when=lambda s: s.question == "q1")
    engine, manager, stream = _setup(hang, rows=8)
    run = _train(_collector(manager, stream, max_lag=0, oversample=oversample), engine, 4)
    if oversample == 0:  # no spare slot: the first step waits for the hung group forever
        with pytest.raises(TimeoutError):
            asyncio.run(asyncio.wait_for(run, 2.0))
        return
    steps = asyncio.run(run)
    assert [s["positions"] for s in steps][0] == [0, 2]  # the spare (row 2) took the hung group's place
    assert sum(s["async/groups/cancelled_stale"] for s in steps) >= 1  # cancelled at the first version change
    assert all(s["async/lag/max"] == 0.0 for s in steps)


@pytest.mark.timeout(30)
def test_groups_hung_before_their_first_token_free_their_slots_after_max_lag_versions() -> None:
    """Row q1 hangs in the engine (no output, so no version to judge it by) at every epoch. Counted from its
    start version, each hung group is cancelled once max_lag + 1 versions passed; kept (as before), they piled
    up until the hung groups outnumbered the spare slots (max_lag x per_step + oversample = 2) and stopped the
    run (step 9 here)."""
    engine, manager, stream = _setup(ScriptedEnvironment(reward=lambda s: float(s.index)), rows=4, hang=1)
    steps = asyncio.run(asyncio.wait_for(_train(_collector(manager, stream, max_lag=1), engine, 16), 10.0))
    assert len(steps) == 16 and all(s["async/lag/max"] <= 1.0 for s in steps)
    assert sum(s["async/groups/cancelled_stale"] for s in steps) >= 5
    assert all(s["async/groups/in_flight"] <= 4 for s in steps)


@pytest.mark.timeout(30)
def test_a_finished_group_that_went_stale_waiting_is_dropped_counted_and_never_trained() -> None:
    engine, manager, stream = _setup(ScriptedEnvironment(reward=lambda s: float(s.index)), rows=12)
    # max_lag 0, one spare: 3 groups per step finish; a step takes 2, the third is stale at the version change
    steps = asyncio.run(_train(_collector(manager, stream, max_lag=0, oversample=1), engine, 3, train_s=0.2))
    trained = [p for s in steps for p in s["positions"]]
    assert trained == [0, 1, 3, 4, 6, 7]  # 2, 5 and 8 were never trained
    assert [s["async/groups/dropped_stale"] for s in steps] == [0.0, 1.0, 1.0]  # counted at the next take
    assert [s["async/groups/oversampled_discarded"] for s in steps] == [0.0, 1.0, 2.0]  # + row 8, left at the end
    assert all(s["async/groups/cancelled_stale"] == 0.0 for s in steps)


@pytest.mark.timeout(30)
def test_trainer_wait_and_generation_idle_measure_the_timeline() -> None:
    # a group is 2 samples x 200 tokens at 2 ms: 0.4 s; a trainer step 0.3 s, then a refit that waits for
    # the requests in flight ("finish")
    def timeline(max_lag: int) -> list[dict[str, Any]]:
        engine, manager, stream = _setup(ScriptedEnvironment(reward=lambda s: float(s.index)), rows=16,
                                         token_s=0.002, max_new_tokens=200)
        return asyncio.run(_train(_collector(manager, stream, max_lag=max_lag), engine, 5, train_s=0.3))

    # generation idles while the trainer sleeps its 0.3 s, less the few ms by which the last request's end is
    # recorded after the step began (0.295 s seen on a loaded machine): 0.25 s still tells idle from busy
    on_policy = timeline(0)  # nothing runs while the trainer steps: it waits a group's time, generation idles
    for s in on_policy[1:]:
        assert s["async/trainer_wait_s"] >= 0.4
        assert 0.25 <= s["async/generation_idle_s"] < 0.3 + 0.5
    # the next step's groups run during the trainer step (and its refit waits for them); steps 1 and 2 fill the
    # pipeline (the first 4 groups ran at once, so generation idled during step 1's training)
    lagged = timeline(1)
    assert lagged[1]["async/generation_idle_s"] >= 0.25
    for s in lagged[2:]:
        assert s["async/trainer_wait_s"] < 0.2
        assert s["async/generation_idle_s"] < 0.15


@pytest.mark.timeout(30)
def test_queue_size_stops_admission_while_that_many_groups_wait() -> None:
    def started(queue_size: int | None) -> list[float]:
        engine, manager, stream = _setup(ScriptedEnvironment(reward=lambda s: float(s.index)), rows=32)
        steps = asyncio.run(_train(_collector(manager, stream, max_lag=2, queue_size=queue_size), engine, 4,
                                   train_s=0.2))
        return [s["async/groups/started"] for s in steps]

    # max_lag 2: 6 groups start at once; each finishes long before the 0.2 s trainer step ends
    # (a step's count is what started since the previous take; the trainer takes right after a version change)
    assert started(None) == [6.0, 0.0, 2.0, 2.0]  # every version change starts one step's worth
    assert started(2) == [6.0, 0.0, 0.0, 4.0]  # nothing starts while 2 finished groups wait


@pytest.mark.timeout(30)
def test_a_group_dropped_in_take_wakes_admission() -> None:
    """White-box: `take` drops waiting groups that went stale; if nothing is in flight, admission must run
    again or the wait never ends. (Through the public calls `set_version` drops them first, so the state is
    set by hand: a version moved on without `set_version`.)"""
    engine, manager, stream = _setup(ScriptedEnvironment(reward=lambda s: float(s.index)), rows=8)
    collector = _collector(manager, stream, max_lag=0, oversample=1)  # row 2 is the spare: it waits

    async def go() -> tuple[TakenStep, TakenStep]:
        collector.start()
        try:
            first = await collector.take()
            await asyncio.to_thread(engine.update_weights, {})
            await asyncio.sleep(0.1)  # admission ran: nothing may start (row 2 fills the budget of 1)
            assert collector.pending_rows() == [2]
            collector.version = 1  # the version moves on without set_version: row 2 is stale
            second = await asyncio.wait_for(collector.take(), 2.0)
            return first, second
        finally:
            await collector.aclose()

    first, second = asyncio.run(go())
    assert [g.position for g in first.groups] == [0, 1] and [g.position for g in second.groups] == [3, 4]
    assert second.metrics["async/groups/dropped_stale"] == 1.0


@pytest.mark.timeout(30)
def test_dynamic_sampling_keeps_a_gdpo_group_for_its_components_when_its_scalar_ties() -> None:
    # every scalar reward is 0 (no variance: the grpo estimator's dynamic sampling drops every group); the
    # components differ between a group's two samples, so GDPO's advantages do not vanish and the groups train
    calls: dict[str, int] = {}

    def components(s) -> dict[str, float]:  # a group's first sample scores on a, its second on b
        calls[s.question] = calls.get(s.question, 0) + 1
        return {"a": float(calls[s.question] % 2), "b": float(1 - calls[s.question] % 2)}

    env = ScriptedEnvironment(reward=0.0, reward_components=components)
    dynamic = DynamicSamplingSettings(enabled=True, max_gen_batches=2)
    kept = {}
    for estimator in ("grpo", "gdpo"):
        engine, manager, stream = _setup(env)
        advantages = GRPOSettings(adv_estimator=estimator, reward_weights={"a": 1.0, "b": 0.5} if estimator ==
                                  "gdpo" else None)
        collector = AsyncCollector(manager, stream, AsyncSettings(enabled=True, max_lag=1), per_step=2, version=0,
                                   offset=0, salt_prefix=1, dynamic=dynamic, advantages=advantages)
        kept[estimator] = asyncio.run(_train(collector, engine, 1))[0]["dynamic_sampling/kept_groups"]
    assert kept == {"grpo": 0.0, "gdpo": 2.0}
