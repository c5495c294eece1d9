"""The records that rollouts produce and that trainers and evals read (one small typed record per concept)."""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_rl_ext.config import ConfigError


@dataclass(frozen=True)
class Message:
    """One chat message with the exact token ids that represent it in the model's context."""

    role: str
    """"system", "user", "assistant", "tool" or "environment"."""
    content: str
    """The decoded text of the message."""
    token_ids: tuple[int, ...]
    """The ids this message contributes to the context, chat-template tokens included."""
    generation_logprobs: tuple[float, ...] | None = None
    """For assistant messages: the engine's logprob of each id in `token_ids`; None otherwise."""
    generation_weight_versions: tuple[int, ...] | None = None
    """For assistant messages: the weight version each id was generated under (a message that crossed a
    weight update shows its spans); None otherwise."""
    teacher_logprobs: tuple[float, ...] | None = None
    """For assistant messages scored by a distillation teacher: the teacher's logprob of each id in
    `token_ids` (the student's exact ids, in the full context before them); None otherwise."""
    teacher_topk_ids: tuple[tuple[int, ...], ...] | None = None
    """With `on_policy_distillation.top_k` > 0: the teacher's k most likely ids at each position of
    `token_ids`; None otherwise."""
    teacher_topk_logprobs: tuple[tuple[float, ...], ...] | None = None
    """The teacher's logprobs of `teacher_topk_ids` (same shape); None otherwise."""

    def __post_init__(self) -> None:
        for name in ("generation_logprobs", "generation_weight_versions", "teacher_logprobs",
                     "teacher_topk_ids", "teacher_topk_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.token_ids):
                raise ValueError(
                    f"{self.role} message has {len(self.token_ids)} token ids but {len(values)} {name.replace('_', ' ')}"
                )


class StopReason(str, enum.Enum):
    """Why a rollout ended."""

    NATURAL = "natural"
    TRUNCATED = "truncated"
    MAX_TURNS = "max_turns"
    ERROR = "error"


ERROR_KIND = "error_kind"
"""`Completion.env_extras` key of an error completion whose cause is the row itself, not infrastructure."""
DATA_ERROR = "data"
"""`env_extras[ERROR_KIND]` of a row the server refused as malformed (Gym's HTTP 4xx): retrying the unchanged
row cannot help, so a resumed eval does not retry it, and the eval exits 2 naming the row."""
PROMPT_TOO_LONG = "prompt_too_long"
"""`Completion.env_extras` key of a rollout that never generated because its prompt alone left no room under
the context limit: `{"prompt_tokens": n or None, "limit": m or None}` (n: the prompt's length where known)."""


class RewardComponentError(ConfigError):
    """An environment returned a named reward component that is missing or not a finite number (a user error:
    the environment or its config must change; retrying cannot help)."""


def check_reward_components(env: str, components: Any, required: Sequence[str] = ()) -> dict[str, float]:
    """`components` as {name: float}; one `RewardComponentError` naming `env` and every missing (`required`
    but absent) or non-numeric field. Booleans are refused (a flag is not a score)."""
    if not isinstance(components, Mapping):
        raise RewardComponentError(
            f"environment {env!r}: reward components must be a mapping of name -> number, got "
            f"{type(components).__name__}"
        )
    problems = [f"field {name!r} is missing" for name in required if name not in components]
    out: dict[str, float] = {}
    for name, value in components.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            problems.append(f"field {str(name)!r} is not a finite number (got {value!r})")
        else:
            out[str(name)] = float(value)
    if problems:
        raise RewardComponentError(f"environment {env!r}: reward component " + "; ".join(problems))
    return out


def is_data_error(completion_env_extras: Mapping[str, Any]) -> bool:
    """True when the env_extras mark an error completion caused by a malformed row (`DATA_ERROR`)."""
    return completion_env_extras.get(ERROR_KIND) == DATA_ERROR


@dataclass(frozen=True)
class Completion:
    """One scored rollout of a prompt."""

    message_log: tuple[Message, ...]
    """The prompt messages followed by every generated and environment message, each with its token ids."""
    reward: float
    """Total reward of the rollout (summed over turns)."""
    truncated: bool
    """True when a length limit (max_seq_len, max_new_tokens, max_model_len) cut the rollout short."""
    stop_reason: StopReason
    """Why the rollout ended."""
    num_turns: int
    """Number of model generations in the rollout."""
    agent_name: str
    """The agent (or task) that produced the rollout."""
    env_extras: Mapping[str, Any] = field(default_factory=dict)
    """Environment-specific data: the extracted answer, the raw Gym result, ..."""
    error: str | None = None
    """None, or a short description of what failed (then stop_reason is ERROR)."""
    latency_s: float | None = field(default=None, compare=False)
    """Wall seconds from the start of this rollout to its end (native: the single rollout, every turn and
    environment step; nemo_gym: the row's /run call, retries included); None when not measured. A
    measurement, not content: completions that differ only here are equal, and an eval writes it to
    timings.jsonl, never to completions.jsonl (whose bytes must not depend on the clock)."""
    reward_components: Mapping[str, float] = field(default_factory=dict)
    """Named parts of the reward ({name: value}, summed over turns like `reward`) where the environment
    reports them (multi-reward, GDPO); empty: the environment reports only the scalar `reward`."""

    @property
    def token_ids(self) -> tuple[int, ...]:
        """All ids of the rollout, in context order."""
        return tuple(t for m in self.message_log for t in m.token_ids)


@dataclass(frozen=True)
class PromptGroupRecord:
    """N completions of one prompt, scored, with the metrics of the group's rollouts.

    The first seven fields are NeMo-RL's (`nemo_rl.experience.interfaces.PromptGroupRecord`), in its order,
    so `PromptGroupRecord(prompt_idx, prompt, extra_env_info, metadata, completions, rollout_metrics)` builds
    one as there; ours follow with defaults. Lists given for `prompt` / `completions` are stored as tuples.
    """

    prompt_idx: int
    """Index of the prompt in its dataset."""
    prompt: tuple[Message, ...]
    """The prompt messages (the start of every completion's message_log)."""
    extra_env_info: Mapping[str, Any]
    """What the environment or Gym agent needs to score this prompt (ground truth, Gym row, ...)."""
    metadata: Mapping[str, Any]
    """Anything the dataset row carried that is not used by the rollout."""
    completions: tuple[Completion, ...]
    """The N completions, in rollout-index order."""
    rollout_metrics: Mapping[str, float]
    """Flat, slash-namespaced metrics of this group's rollouts."""
    loss_multiplier: float = 1.0
    """Weight of the group's tokens in the training loss (NeMo-RL's): 1 trains on it, 0 leaves it out."""
    agent_name: str = ""
    """The agent that the group's generation count was looked up for; "" takes the completions' agent."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(self.prompt))
        object.__setattr__(self, "completions", tuple(self.completions))
        if not self.agent_name:
            agents = {c.agent_name for c in self.completions}
            if len(agents) == 1:
                object.__setattr__(self, "agent_name", agents.pop())
        m = self.loss_multiplier
        if isinstance(m, bool) or not isinstance(m, int | float) or not math.isfinite(m) or m < 0:
            raise ValueError(f"prompt {self.prompt_idx}: loss_multiplier must be a finite float >= 0, got {m!r}")


@dataclass(frozen=True)
class DatumSpec:
    """One dataset row, ready for rollout: the prompt is already tokenized."""

    idx: int
    """Index of the row in its dataset."""
    message_log: tuple[Message, ...]
    """Prompt messages with token ids (chat template applied, generation prompt on the last one)."""
    task_name: str
    """Name of the environment that scores the row (key of `task_to_env`)."""
    extra_env_info: Mapping[str, Any] = field(default_factory=dict)
    """Ground truth and other data for the environment; for Gym rows, the Gym row itself."""
    agent_name: str | None = None
    """Agent the row belongs to; None means the task name is the agent."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Anything else the row carried."""
    stop_strings: tuple[str, ...] | None = None
    """Stop strings of every model turn the environment names none for (NeMo-RL's `stop_strings`); None: the
    generation config's."""
    loss_multiplier: float = 1.0
    """Weight of the row's tokens in the training loss (NeMo-RL's): its record carries it; 0 leaves it out."""

    @property
    def agent(self) -> str:
        """The key used for per-agent generation counts and metrics."""
        return self.agent_name or self.task_name
