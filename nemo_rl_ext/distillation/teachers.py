"""Which teacher scores which agent (`teacher_model_by_agent_name`, `default_teacher_alias`,
`strict_agent_name_match`), and the teachers built from that: local models or HTTP servers, one object per
distinct model or URL when `deduplicate_shared_teacher_checkpoints` is on."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.distillation.scoring import TeacherScorer
from nemo_rl_ext.distillation.teacher import Teacher


def is_url(spec: str) -> bool:
    """True for a teacher served over HTTP (`http://` or `https://`)."""
    return spec.startswith(("http://", "https://"))


def default_spec(settings: DistillationSettings) -> str | None:
    """The model or URL of `default_teacher_alias` (an agent name in the mapping stands for that agent's
    teacher), or None."""
    alias = settings.default_teacher_alias
    if alias is None:
        return None
    return settings.teacher_model_by_agent_name.get(alias, alias)


def unmapped_agents(settings: DistillationSettings, agents: Iterable[str]) -> list[str]:
    """The agents (sorted, once each) with no teacher: neither mapped nor covered by a default."""
    if default_spec(settings) is not None:
        return []
    return sorted({a for a in agents if a not in settings.teacher_model_by_agent_name})


def unmapped_problem(settings: DistillationSettings, agents: Iterable[str]) -> str | None:
    """One message listing every agent without a teacher under `strict_agent_name_match`, or None."""
    if not settings.enabled or not settings.strict_agent_name_match:
        return None
    missing = unmapped_agents(settings, agents)
    if not missing:
        return None
    return (f"on_policy_distillation: no teacher for agent(s) {missing} (strict_agent_name_match: add them to "
            "teacher_model_by_agent_name, set default_teacher_alias, or set strict_agent_name_match: false)")


def teacher_specs(settings: DistillationSettings) -> list[str]:
    """Every distinct model or URL the settings name, in order."""
    specs = [*settings.teacher_model_by_agent_name.values()]
    default = default_spec(settings)
    return list(dict.fromkeys(specs + ([default] if default is not None else [])))


@dataclass(frozen=True)
class Placement:
    """Where a local teacher loaded in this process lives, and its precision: the student's (`placement`)."""

    device: str = "cpu"
    """Its torch device (`policy.device`)."""
    dtype: str = "float32"
    """Its weights' torch dtype name."""
    autocast: str | None = None
    """The torch dtype name its forward passes run under autocast in ("bfloat16" under
    `trainer.mixed_precision: bf16`, as the trainer's reference model), or None: the weights' dtype."""


def placement(device: str, dtype: str, mixed_precision: str | None = None) -> Placement:
    """A local teacher as the student's KL reference model is placed (`grpo.build`, `training.fsdp_workers`):
    on `device`, weights in `dtype`, or in float32 computed in bf16 under `mixed_precision: bf16`."""
    if mixed_precision == "bf16":
        return Placement(device, "float32", "bfloat16")
    return Placement(device, dtype)


def local_teachers(where: Placement) -> Callable[[str, DistillationSettings], Teacher]:
    """A `build_scorer` maker: a local teacher loaded in this process at `where`, a URL over HTTP."""
    return lambda spec, settings: build_teacher(spec, settings, where)


def build_teacher(spec: str, settings: DistillationSettings, where: Placement | None = None) -> Teacher:
    """The teacher `spec` names: an `HttpTeacher` for a URL, else a `LocalTeacher` loaded now at `where`
    (default: on the CPU in float32)."""
    if is_url(spec):
        # local: httpx loads only for a teacher over HTTP (light; could move up)
        from nemo_rl_ext.distillation.http_teacher import HttpTeacher

        return HttpTeacher(spec, timeout_s=settings.request_timeout_s, retries=settings.request_retries,
                           retry_backoff_s=settings.retry_backoff_s,
                           max_concurrency=settings.max_concurrent_requests)
    # local: torch and transformers load only for a local teacher
    from nemo_rl_ext.distillation.local_teacher import LocalTeacher

    where = where or Placement()
    return LocalTeacher.load(spec, device=where.device, dtype=where.dtype, autocast=where.autocast,
                             max_batch_tokens=settings.max_batch_tokens)


def build_scorer(
    settings: DistillationSettings, make: Callable[[str, DistillationSettings], Teacher] = build_teacher
) -> TeacherScorer | None:
    """The `TeacherScorer` of `settings` (None when distillation is off): one teacher per distinct model or URL
    (deduplicated) or one per agent (not)."""
    if not settings.enabled:
        return None
    shared: dict[str, Teacher] = {}
    built: list[Teacher] = []

    def teacher(spec: str) -> Teacher:
        if settings.deduplicate_shared_teacher_checkpoints and spec in shared:
            return shared[spec]
        shared[spec] = made = make(spec, settings)
        built.append(made)
        return made

    try:
        by_agent = {agent: teacher(spec) for agent, spec in settings.teacher_model_by_agent_name.items()}
        default = default_spec(settings)
        alias = settings.default_teacher_alias
        default_teacher = (by_agent[alias] if alias in by_agent else teacher(default)) if default else None
    except BaseException:
        for t in built:
            t.close()
        raise
    return TeacherScorer(by_agent, default_teacher, settings.top_k)
