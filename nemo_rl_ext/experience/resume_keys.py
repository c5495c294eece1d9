"""The config keys a resumed run may change, for the eval and for GRPO, in one place.

A resume compares the config with the one its folder recorded (`config.config_changes`) and refuses any
changed key but these: keys that only say where things are (`LOCATION_KEYS`: a copied or moved run folder,
Gym servers on other ports), and keys that change how fast, how long or on what a run goes, never what one
rollout or training step computes. A key exempts every key under it (`logger` exempts `logger.*`).
"""

from __future__ import annotations

LOCATION_KEYS: tuple[str, ...] = (
    "rollouts.gym.head_server_url",
    "rollouts.gym.agent_urls",
    "rollouts.gym.policy_host",
    "rollouts.gym.policy_port",
    "rollouts.gym.launch.head_server_port",
    "rollouts.gym.launch.work_dir",
)
"""Keys of the shared sections that only say where things are: where the Gym servers listen and where their
logs go."""

EVAL_LOCATION_KEYS: tuple[str, ...] = ("eval.save_path",)
"""The eval's own location keys: its output folder (a copied eval folder resumes under its new path)."""

GRPO_LOCATION_KEYS: tuple[str, ...] = ("output_dir", "resume")
"""GRPO's own location keys: its output folder (checkpoints, metrics) and the checkpoint it resumes."""

RUNTIME_KEYS: tuple[str, ...] = (
    "policy.max_batch_size",
    "policy.hf",
    "policy.cluster",
    "rollouts.env.remote",
    "rollouts.gym.launch.startup_timeout_s",
)
"""Keys of the shared sections that change how a run executes, not what it computes."""

DISTILL_RUNTIME_KEYS: tuple[str, ...] = tuple(f"on_policy_distillation.{k}" for k in (
    "max_batch_tokens", "request_timeout_s", "request_retries", "retry_backoff_s", "max_concurrent_requests",
    "health_timeout_s"))
"""How a teacher is batched and reached over HTTP: the scores, and so the completions' KL, stay the same."""

EVAL_RESUME_MAY_CHANGE: frozenset[str] = frozenset(
    (
        *LOCATION_KEYS,
        *EVAL_LOCATION_KEYS,
        *RUNTIME_KEYS,
        "eval.num_prompts",
        "eval.max_concurrent_prompts",
        "eval.max_error_rate",
        "eval.ray_workers",
        "eval.ray_lease_timeout_s",
        "eval.metrics",
        *DISTILL_RUNTIME_KEYS,
        "on_policy_distillation.kl_type",
        "on_policy_distillation.mixed_kl_weight",
        "on_policy_distillation.top_k",
        "on_policy_distillation.reward_weight",
    )
)
"""Keys that may differ between an eval and its resumption (they change no completion): with a teacher, also
how it is reached (not which teacher it is) and the update's keys, which an eval ignores."""

GRPO_RESUME_MAY_CHANGE: tuple[str, ...] = (
    *LOCATION_KEYS,
    *GRPO_LOCATION_KEYS,
    *RUNTIME_KEYS,
    "grpo.max_num_steps",
    "grpo.save_period",
    "grpo.stop_timeout_s",
    "keep_last_checkpoints",
    "grpo.val_period",
    "grpo.val_at_start",
    "validation",
    "data.val_path",
    "logger",
    "trainer.workers",
    "trainer.worker",
)
"""Keys (and sections) that may differ between a GRPO run and its resumption: how long to train, when to
checkpoint and validate and on what, where logs and outputs go, the hf batch size, where the Gym servers
listen, and how many trainer ranks train (a checkpoint of any count loads onto any other: shards are resharded,
a one-process checkpoint is sharded on load). None of them changes a training step's rollouts or update."""
