"""Experience: the shared `rollouts` config, the front door (`build`), the RolloutManager and its native and
NeMo Gym implementations, fault policy and rollout metrics (the records and per-agent counts are in `data/`)."""
