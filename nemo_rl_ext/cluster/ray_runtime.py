"""Starting or joining Ray: a local instance on a laptop, or an existing cluster by address."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from nemo_rl_ext.models.config import ClusterConfig

logger = logging.getLogger(__name__)


def init_ray(cfg: ClusterConfig | None = None) -> bool:
    """Make Ray ready for `cfg`; True when this call started or joined it (so the caller owns `ray.shutdown`).

    Already initialized (a test fixture, a script that called `ray.init` itself): nothing changes, False.
    `address` null starts a local Ray with `local_num_cpus` CPUs, no dashboard, usage stats off, its node
    on 127.0.0.1 only (`keep_ray_on_loopback`).
    Otherwise `ray.init(address=...)` connects to the running cluster.
    """
    cfg = cfg or ClusterConfig()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before `import ray`: it reads this at import
    if cfg.address is None:
        keep_ray_on_loopback()
    import ray  # lazy: ray loads only when Ray is used, not by importing this module

    if ray.is_initialized():
        return False
    with _keeping_sigterm_handler():
        _start_or_join(ray, cfg)
    return True


@contextlib.contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """Keep the caller's own SIGTERM handler (e.g. `lifecycle.stop_on_signals`: checkpoint, then exit):
    `ray.init` replaces it with one that exits at once. A default handler is left to Ray's."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    yield
    if main and callable(previous):
        signal.signal(signal.SIGTERM, previous)


def _start_or_join(ray: Any, cfg: ClusterConfig) -> None:
    if cfg.address is None:
        ray.init(
            # "local": always a new instance; with no address Ray joins a cluster `ray start` left on this machine
            address="local",
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


def on_this_node() -> Any:
    """The Ray scheduling strategy that keeps an actor on this process's node: state the driver cannot lose
    without losing the run anyway (an eval's prompt queue). Placed anywhere, it may land on a worker node,
    and losing that node would lose the run that the other nodes could finish."""
    import ray  # lazy: ray loads only when Ray is used
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


def keep_ray_on_loopback() -> None:
    """Make a local Ray use 127.0.0.1 for every server it binds and every address it connects to.

    On Linux, Ray 2.60 replaces a loopback node address with the machine's outward IP, and its gRPC servers
    then listen on every interface. With cluster mode off (what Ray does by default on macOS and Windows)
    the node address stays 127.0.0.1: the environment variable reaches the processes Ray starts, and the
    constant covers a `ray` imported before this call. Only for a local Ray: a cluster needs its node IPs.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import sys  # stdlib, cheap: local only by habit, could move to the top

    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False
