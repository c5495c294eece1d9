"""`build_environment`: the one place that chooses between an in-process environment and a Ray-hosted one.

GRPO's `env` section and the eval's `eval.remote_environment` both come here. `remote` false: the registered
environment, built in this process. True: a `RemoteEnvironment` actor on the Ray that `init_ray(cluster)`
makes ready (the policy's cluster, or a local Ray when it has none); its `shutdown` kills the actor, and ends
Ray only when this call started it (a Ray the caller or the policy's pool runs is left alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nemo_rl_ext.cluster.ray_runtime import init_ray

if TYPE_CHECKING:
    from nemo_rl_ext.environments.interfaces import EnvironmentInterface
    from nemo_rl_ext.models.config import ClusterConfig


def build_environment(
    name: str,
    env_kwargs: Mapping[str, Any] | None = None,
    *,
    remote: bool = False,
    step_timeout_s: float = 300.0,
    cluster: ClusterConfig | None = None,
) -> EnvironmentInterface:
    """The registered environment `name` built with `env_kwargs`: in this process, or (`remote`) in an actor
    whose calls past `step_timeout_s` kill and restart it. The caller shuts it down when done."""
    if not remote:
        # lazy: the environment registry imports every implementation
        from nemo_rl_ext.environments import create_environment

        return create_environment(name, **dict(env_kwargs or {}))
    # local: cluster/__init__ loads it anyway; no cycle, could move up
    from nemo_rl_ext.cluster.remote_environment import RemoteEnvironment

    started = init_ray(cluster)
    try:
        return RemoteEnvironment.from_registry(name, env_kwargs, step_timeout_s=step_timeout_s, owns_ray=started)
    except BaseException:
        if started:
            import ray  # lazy: ray loads only when Ray is used, not by importing this module

            ray.shutdown()
        raise
