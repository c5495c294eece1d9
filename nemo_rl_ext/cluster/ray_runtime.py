"""Starting or joining Ray: a local instance on a laptop, or an existing cluster by address."""

from __future__ import annotations

import logging
import os

from nemo_rl_ext.cluster.config import ClusterConfig

logger = logging.getLogger(__name__)


def init_ray(cfg: ClusterConfig | None = None) -> bool:
    """Make Ray ready for `cfg`; True when this call started or joined it (so the caller owns `ray.shutdown`).

    Already initialized (a test fixture, a script that called `ray.init` itself): nothing changes, False.
    `address` null starts a local Ray with `local_num_cpus` CPUs, no dashboard, usage stats off, its node
    named 127.0.0.1 (Ray 2.60 still binds its gRPC ports on every interface; see the README).
    Otherwise `ray.init(address=...)` connects to the running cluster.
    """
    cfg = cfg or ClusterConfig()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before `import ray`: it reads this at import
    import ray

    if ray.is_initialized():
        return False
    if cfg.address is None:
        ray.init(
            num_cpus=cfg.local_num_cpus,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
        )
        logger.info("started a local Ray (%s CPUs)", ray.cluster_resources().get("CPU"))
    else:
        ray.init(address=cfg.address, log_to_driver=True, configure_logging=False)
        logger.info("joined the Ray cluster at %s: %s", cfg.address, ray.cluster_resources())
    return True
