"""The `on_policy_distillation` section (NeMo-RL's names): which teacher scores which agent's completions, and
how the update combines the teacher's scores with the environment's reward."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nemo_rl_ext.config import StrictModel


class DistillationSettings(StrictModel):
    """On-policy distillation: a frozen teacher scores every assistant token the student sampled."""

    enabled: bool = Field(default=False, description="Score completions with a teacher and train toward it.")
    teacher_model_by_agent_name: dict[str, str] = Field(
        default_factory=dict,
        description="Teacher per agent: a model name the loaders know, a model folder, or the http(s):// URL of "
        "an OpenAI-compatible server that returns prompt logprobs (`/v1/completions` with echo).",
    )
    default_teacher_alias: str | None = Field(
        default=None,
        description="The teacher of agents not in teacher_model_by_agent_name (a model or URL as there, or one "
        "of its agent names: that agent's teacher); None: such agents are refused (strict) or not distilled.",
    )
    strict_agent_name_match: bool = Field(
        default=True,
        description="An agent with no teacher (no entry and no default) is a config error listing every such "
        "agent; false: its completions are trained on the reward alone.",
    )
    deduplicate_shared_teacher_checkpoints: bool = Field(
        default=True, description="Agents whose teachers are the same model or URL share one loaded teacher."
    )
    kl_type: Literal["reverse", "forward", "mixed"] = Field(
        default="reverse",
        description="reverse: per-token advantage -(log pi_student - log pi_teacher) on the sampled tokens; "
        "forward: KL(teacher || student) over the teacher's top-k (renormalised within k); mixed: "
        "mixed_kl_weight * forward + (1 - mixed_kl_weight) * reverse.",
    )
    mixed_kl_weight: float = Field(
        default=0.5, ge=0.0, le=1.0, description="The forward term's weight when kl_type is mixed."
    )
    top_k: int = Field(
        default=0, ge=0, description="Teacher top-k logprobs kept per token (needed by forward and mixed); 0: none."
    )
    reward_weight: float = Field(
        default=0.0,
        ge=0.0,
        description="Weight of the environment's (GRPO) advantage added to the distillation advantage; "
        "0: pure distillation.",
    )
    max_batch_tokens: int = Field(
        default=16384, ge=1, description="A local teacher's forward passes: most padded tokens per batch."
    )
    request_timeout_s: float = Field(
        default=120.0, gt=0, description="A teacher over HTTP: the deadline of one scoring request."
    )
    request_retries: int = Field(
        default=2, ge=0, description="A teacher over HTTP: extra attempts of a failed or timed-out request."
    )
    retry_backoff_s: float = Field(
        default=0.5, ge=0, description="A teacher over HTTP: the first retry's delay; doubles each retry."
    )
    max_concurrent_requests: int = Field(
        default=16, ge=1, description="A teacher over HTTP: most scoring requests in flight at once."
    )
    health_timeout_s: float = Field(
        default=10.0, gt=0, description="A teacher over HTTP: the deadline of the checks before any model loads."
    )

    @model_validator(mode="after")
    def _coherent(self) -> DistillationSettings:
        """Settings the teachers cannot serve, all in one error, before any model loads: a kl_type over the
        teacher's top-k with top_k 0; distillation enabled with no teacher at all (a run that distils nothing)."""
        problems = []
        if self.kl_type in ("forward", "mixed") and self.top_k == 0:
            problems.append(f"kl_type {self.kl_type} is computed over the teacher's top-k: set top_k > 0")
        if self.enabled and not self.teacher_model_by_agent_name and self.default_teacher_alias is None:
            problems.append("on_policy_distillation.enabled needs a teacher: set teacher_model_by_agent_name "
                            "({agent: model, folder or http(s):// URL}) or default_teacher_alias")
        if problems:
            raise ValueError("; ".join(problems))
        return self
