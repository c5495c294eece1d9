"""Every loss option and GDPO through asynchronous GRPO (`grpo.async`, max_lag 1) on the tiny model: two steps of
test_grpo_async_runs.py's say-"yes" task per option set, the trainer's inputs of each step recorded. The run's
step metrics must be what an in-process trainer computes from the same inputs with the run's loss settings
(so the settings reached the trainer that the asynchronous loop drives), and differ from what it computes
with any one option set back to its default (so each option took effect: a metric it alone moves, or a loss
it changes). Step 2 trains groups generated one version behind (lag 1), so the importance-sampling options
see engine/trainer ratios away from 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_grpo_async_runs import ASYNC, config_file  # noqa: F401  (config_file: the module-scoped say-"yes" config)

from nemo_rl_ext.config import load_config
from nemo_rl_ext.data.records import StopReason
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.models.loading import load_model_and_tokenizer
from nemo_rl_ext.objectives.advantages import compute_gdpo_advantages
from nemo_rl_ext.objectives.loss_settings import LossSettings
from nemo_rl_ext.training.trainer import PolicyTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OPTION_SETS = {  # every option at least once; options that exclude each other are in different sets. At step 2
    # the engine/trainer ratios spread over about [0.5, 6] (one Adam step at lr 3e-3 behind): the bands cut some.
    # Every reply here has the 8 tokens of max_new_tokens: max_tokens_norm 16, not 8, sets Dr. GRPO apart
    "gspo-tis": {"sequence_level_importance_ratios": True, "aggregation": "seq-mean-token-mean",
                 "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0,
                 "truncated_importance_sampling_ratio_min": 0.5},
    "cispo-icepop-dr-grpo-entropy": {"policy_loss": "cispo", "aggregation": "seq-mean-token-sum-norm",
                                     "max_tokens_norm": 16, "entropy_coef": 0.01,
                                     "truncated_importance_sampling_type": "icepop",
                                     "truncated_importance_sampling_ratio": 2.0,
                                     "truncated_importance_sampling_ratio_min": 0.5},
    "reinforce-pp-kl-in-reward": {"grpo.adv_estimator": "reinforce_plus_plus", "kl_coef": 0.05,
                                  "use_kl_in_reward": True},
    "seq-mask-tis-token-sum": {"aggregation": "seq-mean-token-sum", "truncated_importance_sampling_type":
                               "seq-mask-tis", "truncated_importance_sampling_ratio": 1.25,
                               "truncated_importance_sampling_ratio_min": 0.8},
}
ABLATIONS = {  # an option (its keys together) set back to the default, for the options no metric alone shows
    "sequence_level_importance_ratios": ("sequence_level_importance_ratios",),
    "policy_loss": ("policy_loss",),
    "aggregation": ("aggregation", "max_tokens_norm"),
    "use_kl_in_reward": ("use_kl_in_reward",),
}


def _run(path: Path, tmp_path: Path, loss: dict) -> tuple[GRPOConfig, list[tuple], list[dict]]:
    """Two asynchronous steps; returns the config, each step's trainer inputs (items, advantages) and metrics."""
    overrides = [f"{k}={v}" if k.startswith("grpo.") else f"loss.{k}={v}" for k, v in loss.items()]
    cfg = load_config(path, [f"output_dir={tmp_path}", "grpo.max_num_steps=2", *ASYNC, "grpo.async.max_lag=1",
                                    "optimizer.minibatches_per_step=2", "optimizer.micro_batch_size=8",
                                    "loss.importance_sampling_cap=null", *overrides], GRPOConfig)
    inputs: list[tuple] = []
    with GRPO(cfg) as grpo:
        train_step = grpo.trainer.train_step

        def spy(items, advantages):
            inputs.append((list(items), advantages.clone()))
            return train_step(items, advantages)

        grpo.trainer.train_step = spy
        history = grpo.run()
    return cfg, inputs, history


def _replay(cfg: GRPOConfig, inputs: list[tuple], losses: list[LossSettings]) -> list[dict]:
    """The trainer's metrics of each recorded step, replayed in process from the initial weights, step i under
    `losses[i]`."""
    model, _ = load_model_and_tokenizer(cfg.policy.model_name, dtype=torch.float32, device="cpu")
    reference = load_model_and_tokenizer(cfg.policy.model_name, dtype=torch.float32, device="cpu")[0] if any(
        loss.kl_coef > 0 for loss in losses) else None
    trainer = PolicyTrainer(model, optimizer=cfg.optimizer, loss=losses[0].to_loss_config(8),
                            temperature=cfg.policy.generation.temperature, pad_token_id=0, reference_model=reference)
    out = []
    for (items, advantages), loss in zip(inputs, losses, strict=True):
        trainer.loss_config = loss.to_loss_config(cfg.policy.generation.max_new_tokens)
        out.append(trainer.train_step(items, advantages))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_each_loss_option_takes_effect_in_asynchronous_grpo(config_file: Path, tmp_path: Path, name: str) -> None:  # noqa: F811
    cfg, inputs, history = _run(config_file, tmp_path, OPTION_SETS[name])
    assert len(inputs) == 2 and history[-1]["async/lag/max"] == 1.0, history[-1]  # step 2 trains stale groups
    # the run's trainer computed what an in-process trainer computes from the same inputs under its settings
    # (the same kernels on the same inputs, one torch thread each: equal to the bit)
    for step, metrics in zip(history, _replay(cfg, inputs, [cfg.loss, cfg.loss]), strict=True):
        assert {f"train/{k}": v for k, v in metrics.items() if k != "lr"} == {
            k: v for k, v in step.items() if k.startswith("train/") and k != "train/lr"}
    got = {k.removeprefix("train/"): v for k, v in history[-1].items() if k.startswith("train/")}
    option = OPTION_SETS[name]
    kind = option.get("truncated_importance_sampling_type")
    if kind == "tis":  # a metric only the truncation moves: some weights truncated, not all
        assert 0.0 < got["is_weight/truncated_fraction"] < 1.0, got
    elif kind is not None:  # icepop, seq-mask-tis: some tokens (whole samples) masked, not all
        assert 0.0 < got["is/masked_tokens"] < got["num_tokens"], got
        assert (got["is/masked_sequences"] > 0) == (kind == "seq-mask-tis"), got
    if option.get("use_kl_in_reward"):  # the KL is measured (the policy moved at step 1), not in the loss
        assert got["kl/mean"] > 0.0 and got["loss/kl"] == 0.0, got
    assert (got["loss/entropy"] != 0.0) == ("entropy_coef" in option)  # only the entropy bonus has that term
    for keys in (keys for key, keys in ABLATIONS.items() if key in option):
        default = {k: LossSettings.model_fields[k].default for k in keys}
        ablated = _replay(cfg, inputs, [cfg.loss, cfg.loss.model_copy(update=default)])[-1]
        assert ablated["loss"] != got["loss"], (name, keys)


@pytest.mark.timeout(300)
def test_gdpo_takes_effect_in_asynchronous_grpo(config_file: Path, tmp_path: Path) -> None:  # noqa: F811
    """The scripted double's scalar reward is always 0 (every grpo advantage 0); its two components are not: the
    trainer of the asynchronous loop gets GDPO's advantages of exactly the records it trains."""
    from nemo_rl_ext.testing import ScriptedEnvironment

    cfg = load_config(config_file, [f"output_dir={tmp_path}", "grpo.max_num_steps=2", *ASYNC, "grpo.async.max_lag=1",
                                    "grpo.adv_estimator=gdpo", "grpo.reward_weights={has_e: 1.0, even: 0.5}"],
                      GRPOConfig)
    env = ScriptedEnvironment(reward_components=lambda s: {"has_e": float("e" in s.reply),
                                                           "even": float(len(s.reply) % 2 == 0)})
    seen: list[tuple] = []
    with GRPO(cfg, task_to_env={"string_match": env}) as grpo:
        train_records, train_step = grpo._train_records, grpo.trainer.train_step

        def spy_records(records, metrics):
            seen.append((list(records), None))
            return train_records(records, metrics)

        def spy_step(items, advantages):
            seen[-1] = (seen[-1][0], advantages.clone())
            return train_step(items, advantages)

        grpo._train_records, grpo.trainer.train_step = spy_records, spy_step
        history = grpo.run()
    assert len(seen) == 2 and history[-1]["async/lag/max"] == 1.0
    for records, advantages in seen:
        comps = [[c.reward_components for c in r.completions] for r in records]
        valid = [[c.stop_reason is not StopReason.ERROR for c in r.completions] for r in records]
        expected = torch.cat(compute_gdpo_advantages(comps, {"has_e": 1.0, "even": 0.5}, valid_per_group=valid))
        assert torch.equal(advantages, expected) and bool(advantages.abs().sum() > 0)
        assert all(c.reward == 0.0 for r in records for c in r.completions)
