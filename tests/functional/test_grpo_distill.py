"""On-policy distillation end to end through the GRPO loop on the say-"yes" task (`test_grpo.py`'s task, model and
config): a student distilled from a teacher that says "yes" learns to say it in fewer steps than GRPO on the same
reward, counted in steps, not seconds.

The GRPO run from scratch is both the baseline and the teacher: its model after 30 steps (reward ~1.0, measured in
`test_grpo.py`) scores the student's completions. Until the rollout layer's teachers land (issue 36, part 1), the
test scores each step's records itself, by a forward pass of the teacher over each completion's exact token ids, and
attaches the scores to the assistant messages as the rollout layer will (`Message.teacher_logprobs`); the update is
the real one (`on_policy_distillation.enabled`, reward_weight 0: pure distillation)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_grpo import config_file, run, soft_tiny_model  # noqa: F401  (module-scoped fixtures of the say-"yes" task)
from transformers import AutoModelForCausalLM

from nemo_rl_ext.config import load_config
from nemo_rl_ext.data.records import Completion, PromptGroupRecord
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.training.checkpoint import checkpoint_dir, load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@torch.no_grad()
def scored(completion: Completion, teacher, temperature: float, top_k: int = 0) -> Completion:
    """The completion with the teacher's logprob of every generated assistant token (its exact ids, in context), and
    with `top_k` its k most likely ids and their logprobs at each of those tokens."""
    ids = torch.tensor([completion.token_ids])
    logits = teacher(input_ids=ids).logits[0].float() / (temperature if temperature > 0 else 1.0)
    full = torch.cat([torch.zeros(1, logits.shape[-1]), torch.log_softmax(logits, dim=-1)[:-1]])  # row t: token t
    lp = full.gather(-1, ids[0, :, None])[:, 0].tolist()
    top = full.topk(top_k, dim=-1) if top_k else None
    messages, start = [], 0
    for m in completion.message_log:
        n = len(m.token_ids)
        if m.generation_logprobs is not None:
            extra = {}
            if top is not None:
                extra = dict(teacher_topk_ids=tuple(map(tuple, top.indices[start : start + n].tolist())),
                             teacher_topk_logprobs=tuple(map(tuple, top.values[start : start + n].tolist())))
            m = dataclasses.replace(m, teacher_logprobs=tuple(lp[start : start + n]), **extra)
        messages.append(m)
        start += n
    return dataclasses.replace(completion, message_log=tuple(messages))


def with_teacher(grpo: GRPO, teacher, temperature: float, top_k: int = 0) -> None:
    """Every record the loop's rollouts return comes back scored by `teacher` (stands in for the rollout layer's)."""
    roll = grpo.manager.run_rollouts

    async def run_rollouts(*args, **kwargs):
        records, metrics = await roll(*args, **kwargs)
        out = [dataclasses.replace(r, completions=tuple(scored(c, teacher, temperature, top_k) for c in r.completions))
               for r in records]
        assert all(isinstance(r, PromptGroupRecord) for r in out)
        return out, metrics

    grpo.manager.run_rollouts = run_rollouts


def steps_to(rewards: list[float], target: float = 0.9, window: int = 3) -> int:
    """The first step whose trailing `window` steps' mean reward is >= target (len + 1: never)."""
    for end in range(window, len(rewards) + 1):
        if sum(rewards[end - window : end]) / window >= target:
            return end
    return len(rewards) + 1


@pytest.fixture(scope="module")
def grpo_run(config_file: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811
    """GRPO from scratch on the say-"yes" task (30 steps): its rewards per step, and its final model (the teacher)."""
    out = tmp_path_factory.mktemp("grpo")
    metrics = run(config_file, f"output_dir={out}", "grpo.save_period=30")
    rewards = [m["rollout/reward/mean"] for m in metrics if m["step"] > 0]
    assert sum(rewards[-5:]) / 5 > 0.9, rewards  # the teacher says "yes"
    model_dir = load_checkpoint(checkpoint_dir(out / "checkpoints", 30)).model_dir
    return rewards, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def distill(config: Path, out: Path, teacher, *overrides: str) -> list[dict]:
    """A pure-distillation run (reward_weight 0) of the say-"yes" config, its records scored by `teacher`."""
    cfg = load_config(config, [f"output_dir={out}", "on_policy_distillation.enabled=true", *overrides], GRPOConfig)
    with GRPO(cfg) as grpo:
        with_teacher(grpo, teacher, cfg.policy.generation.temperature, cfg.on_policy_distillation.top_k)
        grpo.run()
    return [m for m in read_metrics(Path(cfg.output_dir) / "metrics.jsonl") if m["step"] > 0]


def check_learns_from_the_teacher(metrics: list[dict], grpo_rewards: list[float], name: str) -> list[float]:
    """The run's rewards; it started where GRPO started and its reverse KL to the teacher fell by 4x or more."""
    rewards = [m["rollout/reward/mean"] for m in metrics]
    print(f"{name}: rewards", [round(r, 3) for r in rewards])
    print(f"{name}: reverse_kl", [round(m["train/distill/reverse_kl"], 3) for m in metrics])
    print(f"{name}: GRPO rewards", [round(r, 3) for r in grpo_rewards])
    assert len(rewards) == 30
    # the student starts where GRPO started (same seed, same model) and gets no reward signal at all
    assert rewards[0] == grpo_rewards[0]
    assert metrics[0]["train/distill/reverse_kl"] > 1.0  # the untrained student disagrees with the teacher
    assert metrics[-1]["train/distill/reverse_kl"] < metrics[0]["train/distill/reverse_kl"] / 4
    return rewards


# Measured (seeded; 2 loaded cores): GRPO reaches a 3-step mean reward of 0.5 at step 9 and of 0.9 at step 15;
# mixed (top-8, w 0.5) at steps 5 and 13; reverse alone at steps 11 and 15 (it starts slower: its signal is on the
# sampled tokens only, which are rarely "yes" at first, while the top-k terms see the teacher's "yes" at every token).


@pytest.mark.timeout(1200)
def test_distillation_learns_to_say_yes_in_fewer_steps_than_grpo(
    config_file: Path, grpo_run, tmp_path: Path  # noqa: F811
) -> None:
    grpo_rewards, teacher = grpo_run
    metrics = distill(config_file, tmp_path, teacher, "on_policy_distillation.kl_type=mixed",
                      "on_policy_distillation.top_k=8")
    rewards = check_learns_from_the_teacher(metrics, grpo_rewards, "mixed")
    assert "train/distill/forward_kl" in metrics[0]
    assert steps_to(rewards, 0.5) < steps_to(grpo_rewards, 0.5), (rewards, grpo_rewards)
    assert steps_to(rewards, 0.9) < steps_to(grpo_rewards, 0.9), (rewards, grpo_rewards)


@pytest.mark.timeout(1200)
def test_reverse_distillation_alone_learns_to_say_yes(config_file: Path, grpo_run, tmp_path: Path) -> None:  # noqa: F811
    """kl_type reverse with no reward: the sampled-token advantage alone teaches the task (a 3-step mean reward of
    0.9 within the 30 steps); on this task it is not faster than GRPO (measured: 15 steps both, see above)."""
    grpo_rewards, teacher = grpo_run
    metrics = distill(config_file, tmp_path, teacher, "on_policy_distillation.kl_type=reverse")
    rewards = check_learns_from_the_teacher(metrics, grpo_rewards, "reverse")
    assert steps_to(rewards, 0.9) <= 30, rewards
