"""`build_policy_generation`: the one place that chooses between an in-process engine and a Ray pool.

`policy.cluster` null: `models.backends.build_generation` (one engine in this process, sharing the caller's
model and tokenizer when given). Set: `init_ray(policy.cluster)`, then a `RoutedGeneration` of
`cluster.num_replicas` replicas, each loading the model folder itself. The pool's `shutdown` ends Ray
only when this call started or joined it (a Ray the caller initialized is left running).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nemo_rl_ext.cluster.ray_runtime import init_ray

if TYPE_CHECKING:
    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.generation.interfaces import GenerationInterface


def build_policy_generation(policy_cfg: PolicyConfig, model: Any = None, tokenizer: Any = None) -> GenerationInterface:
    """The generation `policy_cfg` describes: a `RoutedGeneration` when `policy_cfg.cluster` is set.

    `model` / `tokenizer`: a trainer's, shared by an in-process hf engine. A pool's replicas load the model
    folder (`loads_model_folder` is True for it), so a caller whose weights differ from the folder's (a
    resumed run) refits the pool with `update_weights`.
    """
    if policy_cfg.cluster is None:
        # lazy: models.backends loads torch; importing cluster stays light
        from nemo_rl_ext.models.backends import build_generation

        return build_generation(policy_cfg, model, tokenizer)
    # local: cluster/__init__ loads it anyway; no cycle, could move up
    from nemo_rl_ext.cluster.routed_generation import RoutedGeneration
    from nemo_rl_ext.models.policy import resolve_model_path

    # every replica loads the same folder ("tiny" / "smollm2" resolved here, where they are built)
    replica_cfg = policy_cfg.model_copy(update={"model_name": str(resolve_model_path(policy_cfg)), "cluster": None})
    started = init_ray(policy_cfg.cluster)
    try:
        return RoutedGeneration.from_policy(replica_cfg, policy_cfg.cluster, tokenizer=tokenizer, owns_ray=started)
    except BaseException:
        if started:
            import ray  # lazy: ray loads only when Ray is used, not by importing this module

            ray.shutdown()
        raise


def loads_model_folder(policy_cfg: PolicyConfig) -> bool:
    """True when the generation `policy_cfg` builds loads the model folder itself (vLLM, a Ray pool) rather
    than serving the weights of a model handed to it (in-process hf)."""
    # lazy: models.backends loads torch; importing cluster stays light
    from nemo_rl_ext.models.backends import backend_entry

    return policy_cfg.cluster is not None or backend_entry(policy_cfg.backend).loads_model_folder
