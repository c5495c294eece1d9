"""The eval config: sections `eval`, `rollouts` (shared with GRPO) and `policy`, every problem reported at once.

    cfg = load_config("examples/configs/evals/eval.yaml", ["rollouts.num_generations_per_prompt=8"], EvalConfig)

The rules on rollouts and the policy are the shared ones (`experience.config.rollouts_rule_problems`); the
eval adds one: every k in `eval.ks` must be <= the largest sample count (else it is reported for no prompt).

NeMo-RL's eval spelling (`eval.rollout_mode`, `eval.num_tests_per_prompt`, ..., a top-level `gym` section) is
accepted as the same settings, with a DeprecationWarning: `nemo_rl_ext.compat` holds every older spelling.
Errors name the key as written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from nemo_rl_ext.compat import eval_spellings
from nemo_rl_ext.config import (
    INVALID,
    CheckedConfig,
    Renames,
    RuleProblem,
    StrictModel,
    raise_problems,
    raw_field,
)
from nemo_rl_ext.data.hf_source import is_hub_id
from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.evals.metrics import metric_defs
from nemo_rl_ext.evals.shards import ShardSpec
from nemo_rl_ext.experience.config import RolloutsConfig, largest_count, rollouts_rule_problems
from nemo_rl_ext.experience.input_checks import (
    dataset_agents,
    dataset_problems,
    distillation_input_problems,
    rollouts_problems,
)
from nemo_rl_ext.gym.config import GymConfig, resolve_gym_path
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation.interfaces import SEED_LIMIT


class EvalSettings(StrictModel):
    """What to evaluate, how many samples, which metrics, and where the outputs go."""

    dataset_path: str = Field(
        description="The dataset: a .jsonl / .json / .parquet / .csv / .arrow file, a folder written by "
        "save_to_disk, or a Hugging Face hub id (owner/name, with dataset_subset and dataset_split); rows with a "
        "prompt and a reference answer (native modes: question/answer, prompt, messages, docs/datasets.md) or Gym "
        "rows with responses_create_params and agent_ref.name or gym.agent_name (nemo_gym). Relative paths are "
        "relative to the CWD; in nemo_gym mode with gym.launch, one not found there is looked up in the Gym install."
    )
    dataset_subset: str | None = Field(default=None, description="The subset (configuration) of a hub dataset.")
    dataset_split: str = Field(default="train", description="The split of a hub dataset or save_to_disk folder.")
    save_path: str = Field(description="Output folder; re-running with the same folder resumes.")
    num_prompts: int | None = Field(default=None, ge=1, description="Evaluate only the first N rows.")
    ks: tuple[int, ...] | None = Field(
        default=None,
        description="The k of pass@k, maj@k, mean@k; null: powers of two up to the largest sample count, "
        "and that count.",
    )
    reward_threshold: float = Field(
        default=1.0, description="A sample is correct when its reward is >= this."
    )
    metrics: tuple[str, ...] | None = Field(
        default=None,
        description="The metrics the printed table and report.md show, in this order, by name (`maj` or "
        "`maj@k`): `mean_reward`, `pass`, `maj` (ours: every k-subset, ties share, no answer casts no vote), "
        "`mean`, `majority` (NeMo-Skills': the first k samples), `cons` (NeMo-RL's eval cons@k), and any "
        "registered metric; null: every metric but `majority` and `cons`. summary.json always has them all.",
    )
    save_token_ids: bool = Field(default=False, description="Also write each message's token ids.")
    max_concurrent_prompts: int | None = Field(
        default=None,
        ge=1,
        description="Prompts rolled out at once (null: all); smaller keeps more "
        "finished groups on disk if a run is killed.",
    )
    max_error_rate: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="Share of samples that may end as errors (infrastructure failures, not answers) for the "
        "run to succeed; above it the CLI exits 3. 0: any error left fails the run; 1: errors never do.",
    )
    shard: str | None = Field(
        default=None,
        description="`I/N`: evaluate only shard I (0-based) of N, the prompts with index % N == I, into "
        "`<save_path>/[seeds/<seed>/]shards/<I>-of-<N>/`; the last shard to finish merges (evals/shards.py).",
    )
    seeds: tuple[int, ...] | None = Field(
        default=None,
        description="One job per seed (its `policy.generation.seed`), each its own store under "
        "`<save_path>/seeds/<seed>/`; the merge pools each prompt's samples over the seeds. Without "
        "`seed_index` one invocation runs every seed, one after another.",
    )
    seed_index: int | None = Field(
        default=None, ge=0, description="Run only the job of `seeds[seed_index]` (0-based; a job array's index)."
    )
    ray_workers: int | None = Field(
        default=None,
        ge=1,
        description="Evaluate on N Ray workers (Ray from `policy.cluster`; null there: a local Ray), each with its "
        "own engine and store `<save_path>/[seeds/<seed>/]shards/worker-<k>/`, pulling prompts from a shared "
        "queue; this process merges when the queue is empty (evals/ray_lease_queue.py). In nemo_gym mode each worker "
        "serves its own policy server and, with rollouts.gym.launch (mode direct), launches its own Gym.",
    )
    ray_lease_timeout_s: float | None = Field(
        default=3600.0,
        gt=0,
        description="With ray_workers: a prompt a worker has held this long goes back to the queue and the worker "
        "is restarted (it may hang); null: no limit (a dead worker's prompts still go back at once).",
    )

    @field_validator("shard")
    @classmethod
    def _valid_shard(cls, value: str | None) -> str | None:
        return None if value is None else ShardSpec.parse(value).text

    @field_validator("seeds")
    @classmethod
    def _valid_seeds(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("seeds must list at least one seed (or be null)")
        bad = [s for s in value if not 0 <= s < SEED_LIMIT]
        if bad:
            raise ValueError(f"every seed must be in [0, 2**63); bad: {bad}")
        repeated = sorted({s for s in value if value.count(s) > 1})
        if repeated:
            raise ValueError(f"every seed must be listed once; repeated: {repeated}")
        return value

    @property
    def shard_spec(self) -> ShardSpec | None:
        """The parsed `shard`, or None."""
        return None if self.shard is None else ShardSpec.parse(self.shard)

    @property
    def on_ray(self) -> bool:
        """True when the run's prompts are pulled by `ray_workers` Ray workers (ray_lease_queue.py)."""
        return self.ray_workers is not None

    @property
    def is_job(self) -> bool:
        """True when the run is split into jobs (`shard` or `seeds` set): each job writes its own store."""
        return self.shard is not None or self.seeds is not None

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        return None if value is None else report_metric_names(value)

    @field_validator("ks")
    @classmethod
    def _positive_ks(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        bad = [k for k in value if k < 1]
        if bad:
            raise ValueError(f"every k must be >= 1; bad: {bad}")
        if not value:
            raise ValueError("ks must list at least one k (or be null for the default)")
        return tuple(sorted(set(value)))

    def resolved_ks(self, max_samples: int) -> tuple[int, ...]:
        """`ks`, or the default: 1, 2, 4, ... up to the largest sample count, and that count."""
        if self.ks is not None:
            return self.ks
        ks, k = [], 1
        while k < max_samples:
            ks.append(k)
            k *= 2
        return (*ks, max_samples)


def report_metric_names(names: Sequence[str]) -> tuple[str, ...]:
    """The registered metrics `names` selects, in its order, each once (`maj@k` is `maj`); ValueError naming every
    unknown name and listing the valid ones."""
    if not names:
        raise ValueError("eval.metrics must list at least one metric (or be null for the default)")
    defs = {m.name: m for m in metric_defs()}
    per_k = {f"{m.name}@k": m.name for m in defs.values() if m.per_k}
    chosen = [per_k.get(n, n) for n in names]
    unknown = [n for n, c in zip(names, chosen, strict=True) if c not in defs]
    if unknown:
        valid = ", ".join(f"{m.name}@k" if m.per_k else m.name for m in defs.values())
        raise ValueError(f"unknown metric(s) {unknown}; valid: {valid}")
    return tuple(dict.fromkeys(chosen))


class EvalConfig(CheckedConfig):
    """A whole eval run: `eval` settings, the `rollouts` that make the samples, the `policy` that generates."""

    eval: EvalSettings
    rollouts: RolloutsConfig = Field(default_factory=RolloutsConfig, description="How samples are rolled out.")
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    on_policy_distillation: DistillationSettings = Field(
        default_factory=DistillationSettings,
        description="A teacher scores every completion, and the summary reports the student-teacher KL "
        "(`distill/reverse_kl`) beside pass@k. Only the teacher keys matter in an eval; the update's keys "
        "(kl_type, mixed_kl_weight, top_k, reward_weight) are ignored.")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k values reported (`eval.ks`, or the default for the largest sample count); with `eval.seeds`,
        those that fit one seed's samples (the larger ones are reported over the seeds' pooled samples)."""
        n = self.rollouts.max_samples
        return tuple(k for k in self.eval.resolved_ks(n) if k <= n) or (n,)

    @classmethod
    def legacy_spellings(
        cls, data: dict[str, Any], *, whole: bool = True, base: Mapping[str, Any] | None = None
    ) -> tuple[Renames, list[RuleProblem]]:
        """The eval's older spelling (NeMo-RL's, `compat.eval_spellings`) rewritten to the shared `rollouts`
        section, with a DeprecationWarning per key."""
        return eval_spellings(data, whole=whole, base=base)

    @classmethod
    def rule_problems(cls, data: Mapping[str, Any]) -> list[RuleProblem]:
        """The shared rollouts rules, and every k fits the largest sample count."""
        problems = rollouts_rule_problems(data, RolloutsConfig, seq_len_within_model=False)
        counts = raw_field(RolloutsConfig, data.get("rollouts"), "num_generations_per_prompt")
        ks = raw_field(EvalSettings, data.get("eval"), "ks")
        if counts is not INVALID and ks is not INVALID and ks:
            try:
                largest = largest_count(counts)
            except (TypeError, ValueError):
                return problems
            seeds = raw_field(EvalSettings, data.get("eval"), "seeds")
            num_seeds = len(seeds) if seeds not in (INVALID, None) else 1
            too_big = [k for k in ks if k > largest * num_seeds]
            if too_big:
                pooled = f" x {num_seeds} seeds" if num_seeds > 1 else ""
                problems.append(
                    (
                        ("eval", "ks"),
                        f"k={too_big} larger than the largest sample count ({largest} from "
                        f"num_generations_per_prompt{pooled}) would be reported for no prompt",
                        list(ks),
                    )
                )
        ev = data.get("eval")
        seed_index = raw_field(EvalSettings, ev, "seed_index")
        seeds = raw_field(EvalSettings, ev, "seeds")
        if seed_index not in (INVALID, None) and seeds is not INVALID:
            if seeds is None:
                problems.append((("eval", "seed_index"), "selects a seed of eval.seeds, which is not set", seed_index))
            elif seed_index >= len(seeds):
                problems.append(
                    (("eval", "seed_index"), f"must be < {len(seeds)} (the number of eval.seeds)", seed_index)
                )
        return problems + ray_worker_problems(data)


def ray_worker_problems(data: Mapping[str, Any]) -> list[RuleProblem]:
    """`eval.ray_workers` with what it can't run with: a static shard or seed job (the queue hands out every
    prompt of every seed), in nemo_gym mode what is fixed to one port (`_gym_worker_problems`), unseeded sampling
    (a dead worker's prompt is rolled out again elsewhere, and the merge needs the two to agree byte for byte),
    and a replica pool (each worker builds its own engine)."""
    ev = data.get("eval")
    workers = raw_field(EvalSettings, ev, "ray_workers")
    if workers in (INVALID, None):
        return []
    problems: list[RuleProblem] = []
    for key, why in (("shard", "the queue hands out every prompt; drop eval.shard"),
                     ("seed_index", "the workers run every seed of eval.seeds; drop eval.seed_index")):
        value = raw_field(EvalSettings, ev, key)
        if value not in (INVALID, None):
            problems.append((("eval", key), f"can't be combined with eval.ray_workers ({why})", value))
    if raw_field(RolloutsConfig, data.get("rollouts"), "mode") == "nemo_gym":
        problems += _gym_worker_problems(data, workers)
    policy = data.get("policy") if isinstance(data.get("policy"), Mapping) else {}
    generation = policy.get("generation") if isinstance(policy.get("generation"), Mapping) else {}
    seeds = raw_field(EvalSettings, ev, "seeds")
    if generation.get("seed") is None and seeds in (INVALID, None):
        problems.append((("policy", "generation", "seed"), "must be set with eval.ray_workers (or use eval.seeds): a "
                         "dead worker's prompt is rolled out again by another, and the merge needs the two to agree "
                         "byte for byte", None))
    cluster = raw_field(PolicyConfig, policy, "cluster")
    if cluster not in (INVALID, None) and cluster.num_replicas > 1:
        problems.append((("policy", "cluster", "num_replicas"), "must be 1 with eval.ray_workers (each worker builds "
                         "its own engine with policy.cluster.replica's resources)", cluster.num_replicas))
    return problems


def _gym_worker_problems(data: Mapping[str, Any], workers: int) -> list[RuleProblem]:
    """nemo_gym on Ray workers: each worker (and, with `eval.seeds`, each seed in it) serves its own policy
    server and, with `rollouts.gym.launch`, launches its own Gym; what is fixed to one port can exist only once:
    a running Gym's model server (it calls the one policy URL), a set `gym.policy_port`, ng_run's head server."""
    gym = raw_field(RolloutsConfig, data.get("rollouts"), "gym")
    if not isinstance(gym, GymConfig):
        return []  # missing or invalid: the rollouts rules say so
    seeds = raw_field(EvalSettings, data.get("eval"), "seeds")
    num_seeds = len(seeds) if seeds not in (INVALID, None) else 1
    servers = workers * num_seeds
    if servers == 1:
        return []
    many = f"eval.ray_workers={workers}" + (f" x {num_seeds} eval.seeds" if num_seeds > 1 else "")
    many += f" would serve {servers} policy servers (one per worker and seed)"
    if gym.launch is None:
        if not gym.serve_policy:
            return []  # Gym calls another model server: every worker may share the running Gym
        key = ("rollouts", "gym", "head_server_url" if gym.head_server_url else "agent_urls")
        return [(key, f"a running Gym's model server calls one policy URL (rollouts.gym.policy_port), but {many}; "
                 "use rollouts.gym.launch (each worker starts its own Gym) or eval.ray_workers=1 without eval.seeds",
                 gym.head_server_url or gym.agent_urls)]
    problems: list[RuleProblem] = []
    if gym.policy_port != 0:
        problems.append((("rollouts", "gym", "policy_port"), f"must be 0 (a free port each) with {many}",
                         gym.policy_port))
    if gym.launch.mode == "ng_run":
        problems.append((("rollouts", "gym", "launch", "mode"), f"ng_run's head server listens on "
                         f"rollouts.gym.launch.head_server_port, one per machine, but {many}, each launching "
                         "its own Gym; use mode direct", gym.launch.mode))
    return problems


def input_problems(cfg: EvalConfig) -> list[str]:
    """What a run of `cfg` would stop on once its model is loaded, found without loading it: a missing model
    folder, a `policy.device` torch does not have here (the engine and a local teacher load on it), a missing or
    unreadable dataset, rows whose agent has no count in `num_generations_per_prompt`, and
    on-policy distillation's problems (unmapped agents, a teacher that is missing, unreachable or whose
    tokenizer is not the student's)."""
    problems = [p for p in (cfg.policy.model_folder_problem(),) if p is not None]
    if cfg.policy.cluster is None and cfg.policy.device != "cpu":  # loaded here (a Ray worker: on its machine)
        # local: torch only for a device to check
        from nemo_rl_ext.models.loading import device_problem

        problems += [p for p in (device_problem("policy.device", cfg.policy.device),) if p is not None]
    problems += rollouts_problems(cfg.rollouts)
    problems += dataset_problems(
        "eval.dataset_path",
        dataset_file(cfg),
        cfg.rollouts,
        counts=cfg.rollouts.num_generations_per_prompt,
        counts_key=cfg.key_as_written("rollouts.num_generations_per_prompt"),
        limit=cfg.eval.num_prompts,
        subset=cfg.eval.dataset_subset,
        split=cfg.eval.dataset_split,
    )
    if cfg.on_policy_distillation.enabled:
        agents = dataset_agents(dataset_file(cfg), cfg.rollouts, limit=cfg.eval.num_prompts,
                                subset=cfg.eval.dataset_subset, split=cfg.eval.dataset_split)
        problems += distillation_input_problems(cfg.on_policy_distillation, cfg.policy, sorted(set(agents)))
    return problems


def dataset_file(cfg: EvalConfig) -> Path:
    """`eval.dataset_path` from the CWD; in nemo_gym mode with `gym.launch`, a relative path that is not
    there is looked up in the Gym install (e.g. resources_servers/mcqa/data/example.jsonl); a hub id as it is."""
    if is_hub_id(cfg.eval.dataset_path):
        return Path(cfg.eval.dataset_path)
    gym = cfg.rollouts.gym if cfg.rollouts.mode == "nemo_gym" else None
    launch = gym.launch if gym is not None else None
    return resolve_gym_path(cfg.eval.dataset_path, launch.gym_venv if launch is not None else None)


def check_inputs(cfg: EvalConfig) -> None:
    """Raise one ConfigError listing every `input_problems` of `cfg` (the CLI calls it before loading)."""
    raise_problems(input_problems(cfg), "the eval's inputs")
