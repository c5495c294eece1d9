"""GDPO in the GRPO loop: the step's batch, its config rules, `reward/<name>` metrics, and one tiny-model step.

GDPO's advantages are computed on the driver (`grpo/batch.build_training_batch`, called by `GRPO._train_records`
for the synchronous and the asynchronous loop alike) and handed to the trainer, so trainer ranks only ever see
finished advantages (`functional/test_trainer_workers_loss.py` trains GDPO's on two ranks against one).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.data.records import Completion, Message, PromptGroupRecord, RewardComponentError, StopReason
from nemo_rl_ext.grpo.batch import (
    build_training_batch,
    has_reward_variance,
    has_signal,
    training_batch_metrics,
)
from nemo_rl_ext.grpo.config import GRPOConfig, GRPOSettings
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.objectives.advantages import compute_gdpo_advantages

FLOAT32_CAST = {"rel": 1e-6, "abs": 1e-7}
"""Float64 arithmetic cast to float32 (one ulp: 6e-8 relative)."""


def group(components: list[dict], agent: str = "env_a", failed: tuple[int, ...] = ()) -> PromptGroupRecord:
    prompt = (Message("user", "q", (1, 2, 3)),)
    completions = tuple(
        Completion(
            message_log=(*prompt, Message("assistant", "a", (4, 5), (-0.1, -0.2))),
            reward=0.0 if i in failed else sum(c.values()), truncated=False,
            stop_reason=StopReason.ERROR if i in failed else StopReason.NATURAL, num_turns=1, agent_name=agent,
            error="boom" if i in failed else None, reward_components={} if i in failed else c,
        )
        for i, c in enumerate(components)
    )
    return PromptGroupRecord(0, prompt, {}, {}, completions, {}, agent_name=agent)


def test_gdpo_batch_uses_the_components_and_reports_them() -> None:
    # NeMo-RL's multiple-rewards case (test_grpo.py, test_gdpo_advantage_estimator_multiple_rewards), mean
    # baseline, through the batch: +-1/sqrt(2); the failed third sample gets 0 and is not in reward/<name>
    records = [group([{"correctness": 1.0, "integer": 1.0, "format": 1.0},
                      {"correctness": 1.0, "integer": -1.0, "format": 0.0}, {}], failed=(2,))]
    batch = build_training_batch(records, baseline="mean", adv_estimator="gdpo")
    assert batch.advantages.tolist() == pytest.approx([math.sqrt(0.5), -math.sqrt(0.5), 0.0], **FLOAT32_CAST)
    metrics = training_batch_metrics(batch, records)
    assert (metrics["reward/correctness"], metrics["reward/integer"], metrics["reward/format"]) == (1.0, 0.0, 0.5)


def test_reward_weights_reach_the_advantages() -> None:
    records = [group([{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 1.0}])]
    weights = {"a": 3.0, "b": 1.0}
    batch = build_training_batch(records, adv_estimator="gdpo", reward_weights=weights)
    (expected,) = compute_gdpo_advantages([[c.reward_components for c in records[0].completions]], weights)
    assert torch.equal(batch.advantages, expected)  # the same function on the same input: the same kernels
    assert not torch.equal(batch.advantages, build_training_batch(records, adv_estimator="gdpo").advantages)


def test_gdpo_without_components_names_the_key() -> None:
    # NeMo-RL test_gdpo_advantage_estimator_single_reward: one component is refused (use grpo)
    for components in ([{}, {}], [{"correctness": 1.0}, {"correctness": 3.0}]):
        with pytest.raises(ConfigError, match=r"grpo.adv_estimator: gdpo needs two or more"):
            build_training_batch([group(components)], adv_estimator="gdpo")


def test_unknown_or_missing_weights_name_the_key() -> None:
    records = [group([{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 1.0}])]
    with pytest.raises(ConfigError, match=r"grpo.reward_weights: names \['c'\] .* no weight for \['b'\]"):
        build_training_batch(records, adv_estimator="gdpo", reward_weights={"a": 1.0, "c": 1.0})


def test_a_completion_missing_a_component_names_the_environment_and_the_field() -> None:
    records = [group([{"a": 1.0, "b": 0.0}, {"a": 0.0}], agent="formatter")]
    with pytest.raises(RewardComponentError, match=r"environment 'formatter': reward component field 'b' is missing"):
        build_training_batch(records, adv_estimator="gdpo")


def _cfg(*overrides: str) -> list[str]:
    base = ["data.train_path=x.jsonl"]
    try:
        load_config(None, base + list(overrides), GRPOConfig)
    except ConfigError as err:
        return str(err).splitlines()
    return []


def test_config_rules_name_the_key_before_any_model_loads() -> None:
    gym = ["rollouts.mode=nemo_gym", "rollouts.gym={head_server_url: 'http://127.0.0.1:9', policy_port: 9}"]
    assert _cfg("grpo.adv_estimator=gdpo") == []  # native: its components are known once it returns them
    assert _cfg("grpo.adv_estimator=gdpo", "grpo.reward_weights={a: 1.0}") == []
    assert any("grpo.adv_estimator" in p and "rollouts.gym.reward_components" in p
               for p in _cfg("grpo.adv_estimator=gdpo", *gym))
    named = [*gym, "rollouts.gym.reward_components=[correct, format]", "grpo.adv_estimator=gdpo"]
    assert _cfg(*named) == []
    problems = _cfg(*named, "grpo.reward_weights={correct: 1.0, length: 0.5}")
    assert any("grpo.reward_weights.length" in p for p in problems), problems
    assert any("grpo.reward_weights" in p and "'format'" in p for p in problems), problems
    assert any("grpo.reward_weights" in p and "only with grpo.adv_estimator: gdpo" in p
               for p in _cfg("grpo.reward_weights={a: 1.0}")), _cfg("grpo.reward_weights={a: 1.0}")
    assert any("grpo.adv_estimator" in p for p in _cfg("grpo.adv_estimator=gdpoo"))


def _tiny_gdpo_config(tmp_path: Path, tiny_model_dir: Path, *overrides: str) -> GRPOConfig:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say {w}.", "answer": "yes"}) + "\n" for w in "abcd"))
    return load_config(None, [
        f"policy.model_name={tiny_model_dir}", "policy.max_model_len=128", "policy.generation.max_new_tokens=6",
        "rollouts.num_generations_per_prompt=4", "rollouts.max_seq_len=96", f"data.train_path={data}",
        "rollouts.env={name: string_match}", "grpo.num_prompts_per_step=2", "grpo.max_num_steps=1",
        "grpo.adv_estimator=gdpo", "grpo.reward_weights={short: 1.0, has_a: 0.5}", "loss.kl_coef=0.0",
        f"output_dir={tmp_path / 'run'}", "logger.progress=false", "logger.tensorboard_enabled=false",
        "logger.print_steps=false", *overrides,
    ], GRPOConfig)


def _two_components():
    """The scripted double scoring every reply on `short` and `has_a`; its scalar reward is always 0."""
    from nemo_rl_ext.testing import ScriptedEnvironment

    return ScriptedEnvironment(
        reward_components=lambda s: {"short": float(len(s.reply) < 8), "has_a": float("a" in s.reply)},
    )


@pytest.mark.parametrize("lora", [False, True])
def test_a_tiny_model_grpo_step_trains_on_two_components(tmp_path: Path, tiny_model_dir: Path, lora: bool) -> None:
    """A native environment (the scripted double) reports `short` and `has_a` for every reply: one GRPO step
    on the tiny model logs both as reward/<name> and trains on GDPO's advantages of the records it made, with
    LoRA too (its adapters alone train)."""
    from nemo_rl_ext.grpo.loop import GRPO

    adapters = ("trainer.lora.r=4", "trainer.lora.alpha=8", "trainer.lora.target_modules=[q_proj,v_proj]")
    cfg = _tiny_gdpo_config(tmp_path, tiny_model_dir, *(adapters if lora else ()))
    env = _two_components()
    seen: dict[str, object] = {}
    with GRPO(cfg, task_to_env={"string_match": env}) as grpo:
        train_records, train_step = grpo._train_records, grpo.trainer.train_step

        def spy_records(records, metrics):
            seen["records"] = list(records)
            return train_records(records, metrics)

        def spy_step(items, advantages):
            seen["advantages"] = advantages.clone()
            return train_step(items, advantages)

        grpo._train_records, grpo.trainer.train_step = spy_records, spy_step
        metrics = grpo.run()[-1]
        trained = [name for name, p in grpo.trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(("lora_" in name) == lora for name in trained), trained
    assert metrics["train/grad_norm"] > 0
    records = seen["records"]
    comps = [[c.reward_components for c in r.completions] for r in records]
    assert all(set(c) == {"short", "has_a"} for g in comps for c in g), comps
    valid = [[c.stop_reason is not StopReason.ERROR for c in r.completions] for r in records]
    expected = torch.cat(compute_gdpo_advantages(comps, {"short": 1.0, "has_a": 0.5}, valid_per_group=valid))
    assert torch.equal(seen["advantages"], expected)  # the same function on the same input: the same kernels
    logged = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    for name in ("short", "has_a"):
        values = [c[name] for g, ok in zip(comps, valid, strict=True) for c, v in zip(g, ok, strict=True) if v]
        assert metrics[f"reward/{name}"] == logged[f"reward/{name}"] == sum(values) / len(values)


# ---- dynamic sampling under GDPO: a group is kept for its components' signal, not its scalar's ---------------


def _with_rewards(record: PromptGroupRecord, rewards: list[float]) -> PromptGroupRecord:
    completions = tuple(replace(c, reward=r) for c, r in zip(record.completions, rewards, strict=True))
    return replace(record, completions=completions)


def test_dynamic_sampling_judges_a_gdpo_group_by_its_weighted_component_advantages() -> None:
    grpo, gdpo = GRPOSettings(), GRPOSettings(adv_estimator="gdpo")
    # one point each for a, b or c: the scalar ties at 1. Leave-one-out, by hand: a sample's own component
    # gets 1 (its others (0, 0): std 0, undivided), each other one -0.5 / std(1, 0) = -0.5 / sqrt(0.5); the sum
    # 1 - 2 sqrt(0.5) = -0.414 is not 0 (with baseline mean and no std it would be: sum_n (x_n - mean) = 0)
    swapped = group([{"a": 1.0, "b": 0.0, "c": 0.0}, {"a": 0.0, "b": 1.0, "c": 0.0}, {"a": 0.0, "b": 0.0, "c": 1.0}])
    assert not has_signal(swapped, grpo)  # the scalar ties: DAPO's rule drops it
    assert has_signal(swapped, gdpo)
    assert not has_signal(swapped, gdpo.model_copy(update={"baseline": "mean", "normalize_std": False}))
    # two components that always sum to 1 and equal weights: A_b = -A_a exactly, the sum is 0
    pair = group([{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 1.0}, {"a": 0.0, "b": 1.0}])
    assert not has_signal(pair, gdpo)
    assert has_signal(pair, gdpo.model_copy(update={"reward_weights": {"a": 1.0, "b": 0.5}}))
    # the scalar varies while no component does: GDPO's advantages are all zero, the group goes
    flat = _with_rewards(group([{"a": 1.0, "b": 0.0}] * 3), [1.0, 0.0, 0.0])
    assert has_signal(flat, grpo) and not has_signal(flat, gdpo)
    # a zero-weight component's variance is no signal; an incomplete group is kept for the batch to name
    assert not has_signal(swapped, gdpo.model_copy(update={"reward_weights": {"a": 0.0, "b": 0.0, "c": 0.0}}))
    assert has_signal(group([{"a": 1.0, "b": 0.0}, {"a": 1.0}]), gdpo)
    # failed rollouts are in no advantage: one valid sample left is no signal
    assert not has_signal(group([{"a": 1.0, "b": 0.0}, {}], failed=(1,)), gdpo)


def test_a_tiny_model_step_with_dynamic_sampling_keeps_gdpo_groups_whose_scalar_ties(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The scripted double's scalar reward is always 0, so DAPO's rule on the scalar would keep nothing; under
    GDPO the step keeps exactly the generated groups whose components carry signal, and trains on them."""
    from nemo_rl_ext.grpo.loop import GRPO

    cfg = _tiny_gdpo_config(tmp_path, tiny_model_dir, "grpo.dynamic_sampling.enabled=true",
                            "grpo.dynamic_sampling.max_gen_batches=1")
    generated: list[PromptGroupRecord] = []
    trained: list[PromptGroupRecord] = []
    with GRPO(cfg, task_to_env={"string_match": _two_components()}) as run:
        rollouts, train_records = run.manager.run_rollouts, run._train_records

        async def spy_rollouts(*args, **kwargs):
            records, metrics = await rollouts(*args, **kwargs)
            generated.extend(records)
            return records, metrics

        def spy_records(records, metrics):
            trained.extend(records)
            return train_records(records, metrics)

        run.manager.run_rollouts, run._train_records = spy_rollouts, spy_records
        metrics = run.run()[-1]
    assert len(generated) == 2 and not any(has_reward_variance(r) for r in generated)
    kept = [r for r in generated if has_signal(r, cfg.grpo)]
    assert kept and [r.prompt_idx for r in trained] == [r.prompt_idx for r in kept]
    assert metrics["dynamic_sampling/kept_groups"] == float(len(kept))
