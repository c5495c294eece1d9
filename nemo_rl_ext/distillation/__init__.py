"""On-policy distillation: teachers that score the student's sampled tokens inside the rollout layer, and the
settings the update reads (`config.DistillationSettings`, the `on_policy_distillation` section)."""
