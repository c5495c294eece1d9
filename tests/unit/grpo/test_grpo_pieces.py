"""The small parts of the GRPO loop: config, prompt stream, training batch, seeds, metrics file, string_match."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.data.records import Completion, DatumSpec, Message, PromptGroupRecord, StopReason
from nemo_rl_ext.environments import create_environment
from nemo_rl_ext.environments.string_match import match_reward
from nemo_rl_ext.grpo.batch import (
    build_training_batch,
    has_reward_variance,
    training_batch_metrics,
)
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.metrics_logger import MetricsLogger, read_metrics
from nemo_rl_ext.grpo.prompt_stream import PromptStream
from nemo_rl_ext.grpo.step_seeds import SaltedGeneration, mix_seed
from nemo_rl_ext.models.generation import (
    FinishReason,
    GenerationConfig,
)
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig
from nemo_rl_ext.objectives.loss_settings import aggregation_of
from nemo_rl_ext.testing import ScriptedGeneration

REPO = Path(__file__).resolve().parents[3]


def datum(i: int) -> DatumSpec:
    return DatumSpec(idx=i, message_log=(Message("user", f"q{i}", (1, 2)),), task_name="t")


def group(rewards, truncated=False) -> PromptGroupRecord:
    prompt = (Message("user", "q", (1, 2, 3)),)
    completions = tuple(
        Completion(
            message_log=(*prompt, Message("assistant", "a", (4, 5), (-0.1, -0.2))),
            reward=r, truncated=truncated, stop_reason=StopReason.TRUNCATED if truncated else StopReason.NATURAL,
            num_turns=1, agent_name="t",
        )
        for r in rewards
    )
    return PromptGroupRecord(
        prompt_idx=0, prompt=prompt, extra_env_info={}, metadata={}, completions=completions, rollout_metrics={},
        agent_name="t",
    )


# ---- config ---------------------------------------------------------------------------------------


def test_config_reports_field_errors_and_cross_field_rules_together():
    bad = [
        "data.train_path=x.jsonl", "rollouts.num_generations_per_prompt={a: 0, b: x}", "loss.clip_low=1.5",
        "optimizer.lr=-1", "rollouts.env.typo=1", "validation.ks=[0, 2]",
        # cross-field rules, reported in the same error although fields above are invalid
        "policy.generation.temperature=0", "rollouts.max_seq_len=4096", "rollouts.mode=nemo_gym",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(None, bad, GRPOConfig)
    text = str(err.value)
    assert text.startswith("config: 8 problem(s)"), text
    for needle in (
        "rollouts.num_generations_per_prompt: Value error, num_generations_per_prompt values must be integers "
        ">= 1; bad entries: {'a': 0, 'b': 'x'}",
        "loss: Value error, invalid ClippedPGLossConfig: clip_low must be in [0, 1), got 1.5",
        "optimizer.lr: Input should be greater than or equal to 0 (got -1)",
        "rollouts.env.typo: Extra inputs are not permitted",
        "validation.ks.0: Input should be greater than or equal to 1 (got 0)",
        "policy.generation.temperature: must be > 0: GRPO compares sampled completions (got 0.0)",
        "rollouts.max_seq_len: exceeds policy.max_model_len (1024) (got 4096)",
        "rollouts.gym: is required with rollouts.mode=nemo_gym",
    ):
        assert needle in text, needle
    # a valid config with only a rule broken reports just that rule
    with pytest.raises(ConfigError) as err:
        gym = ["rollouts.gym={head_server_url: 'http://127.0.0.1:9'}", "rollouts.gym.policy_port=9"]
        load_config(None, ["data.train_path=x", *gym], GRPOConfig)
    text = str(err.value)
    assert text.startswith("config: 1 problem(s)") and "rollouts.gym: is only used with" in text, text


def test_shipped_config_loads():
    cfg = load_config("examples/configs/grpo_smollm2.yaml", ["grpo.max_num_steps=2"], GRPOConfig)
    assert cfg.grpo.max_num_steps == 2 and cfg.rollouts.env.resolved_name == "math" and cfg.rollouts.mode == "native"


# ---- prompt stream --------------------------------------------------------------------------------


def test_prompt_stream_is_seeded_and_resumable():
    rows = [datum(i) for i in range(5)]
    a = PromptStream(rows, seed=3)
    first = [d.idx for d in a.next(7)]
    assert sorted(first[:5]) == list(range(5))  # one full epoch, then the next one starts
    b = PromptStream(rows, seed=3)
    b.load_state_dict(PromptStream(rows, seed=3).state_dict())
    assert [d.idx for d in b.next(7)] == first
    c = PromptStream(rows, seed=3)
    c.next(4)
    resumed = PromptStream(rows, seed=3)
    resumed.load_state_dict(c.state_dict())
    assert [d.idx for d in resumed.next(3)] == first[4:7]
    assert [d.idx for d in PromptStream(rows, seed=3, shuffle=False).next(6)] == [0, 1, 2, 3, 4, 0]
    with pytest.raises(ValueError, match="rows"):
        PromptStream(rows[:4], seed=3).load_state_dict(a.state_dict())


# ---- training batch -------------------------------------------------------------------------------


def test_training_batch_advantages_masks_and_metrics():
    records = [group([1.0, 0.0]), group([0.5, 0.5])]
    assert [has_reward_variance(r) for r in records] == [True, False]
    batch = build_training_batch(records, baseline="mean", normalize_std=False)
    assert batch.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.valid.tolist() == [True] * 4
    assert batch.items[0].loss_mask.tolist() == [0, 0, 0, 1, 1]
    torch.testing.assert_close(batch.items[0].generation_logprobs[3:], torch.tensor([-0.1, -0.2]))
    metrics = training_batch_metrics(batch, records)
    assert metrics["batch/groups_with_variance"] == 1.0 and metrics["batch/num_samples"] == 4.0
    filtered = build_training_batch([group([1.0, 0.0], truncated=True)], overlong_filtering=True)
    assert all(float(x.loss_mask.sum()) == 0 for x in filtered.items)


def with_errors(record: PromptGroupRecord, failed: set[int]) -> PromptGroupRecord:
    """The record with completions `failed` turned into failed rollouts (reward 0, stop_reason error)."""
    completions = tuple(
        replace(c, reward=0.0, stop_reason=StopReason.ERROR, error="boom") if i in failed else c
        for i, c in enumerate(record.completions)
    )
    return replace(record, completions=completions)


def test_training_batch_defaults_are_nemo_rl_and_errors_are_left_out():
    # uneven groups: 4 with one error, 3, 1, 2 with one error. NeMo-RL (leave-one-out, normalize_rewards):
    #   A_i = (r_i - mean(others)) / (std(others, ddof=1) + 1e-6), undivided where std(others) = 0,
    #   0 for a group with fewer than two valid samples; the failed rollout is in no baseline and no std.
    records = [
        with_errors(group([1.0, 0.0, 0.0, 0.0]), {3}),  # valid (1, 0, 0)
        group([0.2, 0.9, 0.5]),
        group([0.7]),
        with_errors(group([1.0, 1.0]), {1}),  # one valid sample left
    ]
    batch = build_training_batch(records)
    eps = 1e-6
    expected = [
        1.0, -0.5 / (0.5**0.5 + eps), -0.5 / (0.5**0.5 + eps), 0.0,  # others of 1: (0, 0), std 0
        -0.5 / (0.08**0.5 + eps), 0.55 / (0.045**0.5 + eps), -0.05 / (0.245**0.5 + eps),
        0.0,
        0.0, 0.0,
    ]
    assert batch.advantages.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert batch.group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 3, 3]
    assert batch.valid.tolist() == [True, True, True, False, True, True, True, True, True, False]
    # failed rollouts get no loss and count in no normalization: their loss mask is all zero
    assert [float(x.loss_mask.sum()) for x in batch.items] == [2, 2, 2, 0, 2, 2, 2, 2, 2, 0]
    assert [has_reward_variance(r) for r in records] == [True, True, False, False]
    metrics = training_batch_metrics(batch, records)
    assert metrics["batch/excluded_samples"] == 2.0 and metrics["batch/groups_with_variance"] == 2.0
    # the previous rule is still there by name: the whole group's std for every sample
    old = build_training_batch(records[:1], std_scope="group")
    s = (1 / 3) ** 0.5  # sample std of (1, 0, 0)
    assert old.advantages.tolist() == pytest.approx([1 / (s + eps), -0.5 / (s + eps), -0.5 / (s + eps), 0.0])


def test_config_defaults_are_nemo_rl_ones():
    cfg = GRPOConfig.model_validate({"data": {"train_path": "x.jsonl"}})
    assert (cfg.grpo.baseline, cfg.grpo.normalize_std, cfg.grpo.std_scope) == ("leave_one_out", True, "baseline")
    assert (cfg.loss.kl_input_clamp_value, cfg.loss.kl_output_clamp_value) == (20.0, 10.0)
    loss = cfg.loss.model_copy(update={"kl_input_clamp_value": None, "kl_estimator": "k2"}).to_loss_config()
    assert loss.kl_input_clamp_value is None and loss.kl_estimator == "k2"
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            ["data.train_path=x", "grpo.std_scope=batch", "loss.kl_input_clamp_value=0", "loss.kl_output_clamp_value=-1"],
            GRPOConfig,
        )
    for needle in ("std_scope", "kl_input_clamp_value", "kl_output_clamp_value"):
        assert needle in str(err.value), needle


# NeMo-RL's examples/configs/grpo_math_1B.yaml, loss_fn section (2026), by our names
NEMO_RL_LOSS_DEFAULTS = {
    "clip_low": 0.2,  # ratio_clip_min
    "clip_high": 0.2,  # ratio_clip_max
    "clip_c": None,  # ratio_clip_c
    "normalization": None,  # the older spelling of aggregation, unset
    "aggregation": None,  # None: token-mean, token_level_loss: true
    "max_tokens_norm": None,  # only read by seq-mean-token-sum-norm (NeMo-RL has no such mode)
    "policy_loss": "ppo_clip",  # use_cispo: false
    "sequence_level_importance_ratios": False,
    "entropy_coef": 0.0,  # NeMo-RL has no entropy term
    "kl_coef": 0.01,  # reference_policy_kl_penalty
    "use_kl_in_reward": False,  # use_kl_in_reward
    "kl_estimator": "k3",  # reference_policy_kl_type
    "kl_input_clamp_value": 20.0,
    "kl_output_clamp_value": 10.0,
    "kl_gradient": "score_function",  # calculate_kl's exp(logp - sg(logp)) weight (PR #2506)
    "on_policy_kl_approximation": False,  # use_on_policy_kl_approximation
    "importance_sampling_correction": False,  # use_importance_sampling_correction
    "importance_sampling_cap": None,  # truncated_importance_sampling_type: null
    "truncated_importance_sampling_type": None,
    "truncated_importance_sampling_ratio": None,
    "truncated_importance_sampling_ratio_min": None,
}


def test_loss_defaults_are_nemo_rl_grpo_math_1b_ones():
    cfg = GRPOConfig.model_validate({"data": {"train_path": "x.jsonl"}})
    assert cfg.loss.model_dump() == NEMO_RL_LOSS_DEFAULTS
    assert dataclasses.asdict(ClippedPGLossConfig()) == NEMO_RL_LOSS_DEFAULTS  # the loss function's own defaults
    assert cfg.loss.to_loss_config() == ClippedPGLossConfig()


@pytest.mark.parametrize("path", [REPO / "examples" / "configs" / "grpo_smollm2.yaml",
                                  REPO / "tests" / "unit" / "older_spelling" / "grpo_smollm2.yaml"])
def test_the_shipped_config_says_why_each_loss_setting_differs_from_nemo_rl(path: Path):
    """A shipped GRPO config may differ from NeMo-RL's defaults only with a comment on that line naming
    NeMo-RL's value."""
    lines = path.read_text().splitlines()
    older = pytest.warns(DeprecationWarning, match="is an older spelling of")  # the copy in NeMo-RL's spelling
    with older if path.parent.name == "older_spelling" else contextlib.nullcontext():
        settings = load_config(path, [], GRPOConfig).loss
    # normalization (the older spelling) and aggregation compare by the aggregation they mean
    loss = {**settings.model_dump(), "normalization": None, "aggregation": aggregation_of(settings)}
    defaults = {**NEMO_RL_LOSS_DEFAULTS, "aggregation": "token-mean"}
    differing = {k for k, v in loss.items() if v != defaults[k]}
    assert differing == {"clip_high", "kl_coef", "importance_sampling_correction", "importance_sampling_cap"}
    for key in differing:
        (line,) = [line for line in lines if line.strip().startswith(f"{key}:")]
        assert "NeMo-RL" in line and "#" in line, line


# ---- per-step seeds -------------------------------------------------------------------------------


class SeedEcho(ScriptedGeneration):
    """Returns the request's seed as the only token; `loaded` and `in_flight` are those of the last update."""

    def __init__(self) -> None:
        super().__init__(None, lambda r: (r.config.seed if r.config.seed is not None else -1,),
                         finish_reason=FinishReason.EOS, logprobs=0.0, max_model_len=100)

    @property
    def loaded(self):
        return self.updates[-1][0]

    @property
    def in_flight(self):
        return self.updates[-1][1]


def test_salted_generation_mixes_the_step_into_seeds():
    gen = SaltedGeneration(SeedEcho())

    def seed_of(seed):
        return asyncio.run(gen.generate_async([1], GenerationConfig(seed=seed))).output_ids[0]

    assert seed_of(5) == 5  # no salt: unchanged
    gen.salt = (1, 1, 0)
    step1 = seed_of(5)
    gen.salt = (1, 2, 0)
    step2 = seed_of(5)
    assert len({5, step1, step2}) == 3 and step1 == mix_seed(5, (1, 1, 0))
    assert seed_of(None) == -1  # unseeded requests stay unseeded
    weights = {"w": torch.zeros(1)}
    gen.update_weights(weights)  # forwarded to the inner backend
    assert gen.inner.loaded is weights and gen.weight_version == 1
    gen.update_weights(weights, in_flight="abort")  # the in-flight policy and the version come through too
    assert gen.inner.in_flight == "abort" and gen.weight_version == 2


def test_salted_generation_streams_the_salted_request():
    gen = SaltedGeneration(SeedEcho(), salt=(1, 1, 0))

    async def events():
        return [e async for e in gen.generate_stream([1], GenerationConfig(seed=5))]

    *deltas, output = asyncio.run(events())
    assert [d.output_ids for d in deltas] == [(mix_seed(5, (1, 1, 0)),)]  # streamed, not only the output
    assert output == asyncio.run(gen.generate_async([1], GenerationConfig(seed=5)))


# ---- metrics file ---------------------------------------------------------------------------------


def test_metrics_logger_appends_and_truncates(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        log.log(step, {"reward": step / 10, "bad": float("nan")})
    log.truncate_after(2)
    log.log(3, {"reward": 0.9})
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["bad"] is None and records[2]["reward"] == 0.9


# ---- string_match environment ---------------------------------------------------------------------


def test_match_reward_modes():
    assert match_reward("yes", "yes") == 1.0
    assert match_reward("yes", "yes", "exact") == 1.0 and match_reward("yes!", "yes", "exact") == 0.0
    assert match_reward("ye", "yes") == pytest.approx(0.8)
    assert match_reward("yex", "yes", "prefix") == pytest.approx(2 / 3)
    assert 0.0 < match_reward("blah yes", "yes") < match_reward("a yes", "yes") < 1.0


async def test_string_match_environment_scores_the_last_answer():
    env = create_environment("string_match", mode="exact", case_sensitive=False)
    logs = [
        (Message("user", "q", (1,)), Message("assistant", "  YES \n", (2,), (0.0,))),
        (Message("user", "q", (1,)), Message("assistant", "no", (2,), (0.0,))),
    ]
    out = await env.step(logs, [{"ground_truth": "yes"}, {"ground_truth": "yes"}])
    assert out.rewards == [1.0, 0.0] and out.terminateds == [True, True] and out.answers == ["yes", "no"]
    with pytest.raises(ValueError, match="mode"):
        create_environment("string_match", mode="fuzzy")


def test_gym_rows_without_agent_ref_take_the_gym_agent_name_in_grpo(tmp_path, tiny_model_dir):
    """GRPO reads Gym rows as the eval does: `rollouts.gym.agent_name` is the agent of rows without
    agent_ref (checked before the model loads, and in the datums), and the overrides reach every row."""
    from nemo_rl_ext.experience.build import load_rollout_rows, make_datums
    from nemo_rl_ext.grpo.config import input_problems

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"responses_create_params": {"input": [{"role": "user", "content": "hi"}]}}\n'
        '{"responses_create_params": {"input": [{"role": "user", "content": "ho"}]}, "agent_ref": {"name": "b"}}\n'
    )
    base = [
        f"data.train_path={rows}", f"policy.model_name={tiny_model_dir}", "rollouts.mode=nemo_gym",
        "rollouts.gym={head_server_url: 'http://127.0.0.1:9'}", "rollouts.gym.policy_port=9",
        "rollouts.num_generations_per_prompt={a: 2, b: 1}",
    ]
    without = load_config(None, base, GRPOConfig)
    assert any("rows [0]" in p for p in input_problems(without, val=False)), input_problems(without, val=False)
    cfg = load_config(None, [*base, "rollouts.gym.agent_name=a",
                             "rollouts.gym.responses_create_params={parallel_tool_calls: false}"], GRPOConfig)
    assert input_problems(cfg, val=False) == []
    datums = make_datums(cfg.rollouts, None, load_rollout_rows(cfg.rollouts, rows))
    assert [d.agent for d in datums] == ["a", "b"]
    assert all(d.extra_env_info["responses_create_params"]["parallel_tool_calls"] is False for d in datums)


def test_a_checkpoint_saved_before_kl_gradient_existed_resumes_with_the_gradient_it_trained_with():
    from nemo_rl_ext.config import config_changes
    from nemo_rl_ext.grpo.config import saved_config_settings

    old = GRPOConfig.model_validate({"data": {"train_path": "x.jsonl"}, "loss": {"kl_coef": 0.05}}).model_dump(
        mode="json")
    del old["loss"]["kl_gradient"], old["loss"]["on_policy_kl_approximation"]  # as a checkpoint of then saved it
    resumed = GRPOConfig.model_validate(saved_config_settings(old))
    assert resumed.loss.kl_gradient == "pathwise" and resumed.loss.on_policy_kl_approximation is False
    today = GRPOConfig.model_validate({"data": {"train_path": "x.jsonl"}, "loss": {"kl_coef": 0.05}})
    assert config_changes(resumed.model_dump(mode="json"), today.model_dump(mode="json"), ()) == [
        "loss.kl_gradient: 'pathwise' -> 'score_function'"]
    # without a KL term the gradient choice changes nothing, so such a checkpoint takes today's default
    no_kl = {**old, "loss": {**old["loss"], "kl_coef": 0.0}}
    assert GRPOConfig.model_validate(saved_config_settings(no_kl)).loss.kl_gradient == "score_function"
    assert saved_config_settings(["not", "a", "config"]) == ["not", "a", "config"]
