"""Ray: a pool of generation replicas routed in the caller's process, and environments hosted in actors.

The layer above environments/, gym/ and serving/ in pyproject's import contract (beside testing/): imports
from those and the layers below them (models/, data/, config), never experience/, evals/, objectives/, training/ or grpo/. `ray` is imported
when a pool, a remote environment or `init_ray` is used, not by importing this package.
"""

from nemo_rl_ext.cluster.environment_hosting import build_environment
from nemo_rl_ext.cluster.policy_generation import build_policy_generation, loads_model_folder
from nemo_rl_ext.cluster.ray_runtime import init_ray, on_this_node
from nemo_rl_ext.cluster.remote_environment import RemoteEnvironment
from nemo_rl_ext.cluster.routed_generation import RoutedGeneration
from nemo_rl_ext.models.config import ClusterConfig, ReplicaResources

__all__ = [
    "ClusterConfig",
    "RemoteEnvironment",
    "ReplicaResources",
    "RoutedGeneration",
    "build_environment",
    "build_policy_generation",
    "init_ray",
    "loads_model_folder",
    "on_this_node",
]
