"""One line of completions.jsonl as a typed record, and what makes a parsed line readable.

`CompletionLine.to_json()` gives exactly the keys, in exactly the order, that the file has always held, so
files written before this record existed still load and new lines are byte-identical for the same data.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nemo_rl_ext.data.records import PROMPT_TOO_LONG, Completion, PromptGroupRecord, StopReason, is_data_error
from nemo_rl_ext.distillation.scoring import reverse_kl_terms

ERROR = StopReason.ERROR.value
"""The stop_reason of an error completion."""

_REQUIRED: dict[str, tuple[type, ...]] = {
    "prompt_idx": (int,),
    "sample_idx": (int,),
    "agent": (str,),
    "reward": (int, float),
    "stop_reason": (str,),
    "truncated": (bool,),
    "num_turns": (int,),
}
"""The keys every completion line needs (what resume and the summary read), with their JSON types."""

_OPTIONAL: dict[str, tuple[type, ...]] = {
    "answer": (str, type(None)),
    "error": (str, type(None)),
    "metadata": (dict,),
    "env_extras": (dict,),
    "message_log": (list,),
    "reward_components": (dict,),
    "distill": (dict,),
}
"""Keys a line may lack (hand-written or older lines; they read as None / empty), with their JSON types."""


class JsonView(Mapping[str, Any]):
    """Read access to a record by the keys of its JSON form (`record["reward"]` is `record.reward`), so code
    written against the JSON objects keeps working; equality is equality of the JSON forms."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


@dataclass(frozen=True, eq=False)
class LineMessage(JsonView):
    """One message of a completion as the line stores it: its text and token count (ids on request)."""

    role: str
    """"system", "user", "assistant", "tool" or "environment"."""
    content: Any
    """The decoded text of the message."""
    num_tokens: int
    """How many token ids the message contributes to the context."""
    token_ids: tuple[int, ...] | None = None
    """The ids themselves (only when `eval.save_token_ids`); None when not saved."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object in the line's `message_log`."""
        out: dict[str, Any] = {"role": self.role, "content": self.content, "num_tokens": self.num_tokens}
        if self.token_ids is not None:
            out["token_ids"] = list(self.token_ids)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LineMessage:
        """The message of a parsed line (checked by `line_problem`)."""
        ids = obj.get("token_ids")
        return cls(obj["role"], obj.get("content"), obj["num_tokens"], None if ids is None else tuple(ids))


@dataclass(frozen=True, eq=False)
class CompletionLine(JsonView):
    """One line of completions.jsonl: a sample's result, or (stop_reason "error") why it failed."""

    prompt_idx: int
    """The dataset row the sample answers."""
    sample_idx: int
    """Which of the prompt's samples this is (0-based)."""
    agent: str
    """The agent (or task) of the prompt; the metrics are also reported per agent."""
    reward: float
    """The sample's reward (0.0 for an error line)."""
    answer: str | None
    """The answer the environment extracted, as text (None: no answer)."""
    stop_reason: str
    """Why the rollout ended: a `StopReason` value ("natural", "truncated", "max_turns", "error")."""
    truncated: bool
    """True when the sample hit the length limit."""
    num_turns: int
    """Assistant turns the rollout took."""
    error: str | None = None
    """For an error line: the infrastructure failure, briefly; None otherwise."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """The prompt's metadata (from the dataset row)."""
    env_extras: Mapping[str, Any] = field(default_factory=dict)
    """What the environment reported about the sample (e.g. `vote_key`, Gym's `gym_result`)."""
    message_log: tuple[LineMessage, ...] = ()
    """The conversation: prompt messages, then the rollout's turns."""
    reward_components: Mapping[str, float] = field(default_factory=dict)
    """The reward's named parts where the environment reports them (written only then, after `message_log`,
    so a line without them is byte-identical to one written before they existed)."""
    distill: Mapping[str, float] = field(default_factory=dict)
    """On-policy distillation in the eval: `reverse_kl_sum` (over the teacher-scored assistant tokens, of
    generation logprob - teacher logprob), `scored_tokens` (their count) and `teacher_logprob_sum`, so shards
    and resumes aggregate as sum / count; empty (and not written) without a teacher."""

    @property
    def is_error(self) -> bool:
        """True for an error completion (an infrastructure failure, not the model's answer)."""
        return self.stop_reason == ERROR

    @property
    def is_data_error(self) -> bool:
        """True for an error line whose row was refused as malformed (`records.DATA_ERROR`): final while the
        row is unchanged, so a resume does not roll it out again."""
        return self.is_error and is_data_error(self.env_extras)

    @property
    def prompt_too_long(self) -> bool:
        """True when the prompt alone left no room to generate (`records.PROMPT_TOO_LONG`)."""
        return self.env_extras.get(PROMPT_TOO_LONG) is not None

    def to_json(self) -> dict[str, Any]:
        """The JSON object written for this line (today's keys, in today's order)."""
        return {
            "prompt_idx": self.prompt_idx,
            "sample_idx": self.sample_idx,
            "agent": self.agent,
            "reward": self.reward,
            "answer": self.answer,
            "stop_reason": self.stop_reason,
            "truncated": self.truncated,
            "num_turns": self.num_turns,
            "error": self.error,
            "metadata": dict(self.metadata),
            "env_extras": dict(self.env_extras),
            "message_log": [m.to_json() for m in self.message_log],
        } | ({"reward_components": dict(self.reward_components)} if self.reward_components else {}) | (
            {"distill": dict(self.distill)} if self.distill else {})

    @classmethod
    def from_json(cls, obj: Any) -> CompletionLine:
        """The line of a parsed JSON object; ValueError saying what is wrong when it is not a completion."""
        problem = line_problem(obj)
        if problem is not None:
            raise ValueError(problem)
        return cls(
            prompt_idx=obj["prompt_idx"],
            sample_idx=obj["sample_idx"],
            agent=obj["agent"],
            reward=float(obj["reward"]),
            answer=obj.get("answer"),
            stop_reason=obj["stop_reason"],
            truncated=obj["truncated"],
            num_turns=obj["num_turns"],
            error=obj.get("error"),
            metadata=obj.get("metadata") or {},
            env_extras=obj.get("env_extras") or {},
            message_log=tuple(LineMessage.from_json(m) for m in obj.get("message_log") or ()),
            reward_components={str(k): float(v) for k, v in (obj.get("reward_components") or {}).items()},
            distill={str(k): float(v) for k, v in (obj.get("distill") or {}).items()},
        )

    @classmethod
    def from_completion(
        cls, record: PromptGroupRecord, sample_idx: int, completion: Completion, save_token_ids: bool
    ) -> CompletionLine:
        """The line for sample `sample_idx` of a rolled-out group (token ids only when `save_token_ids`)."""
        answer = completion.env_extras.get("answer")
        return cls(
            prompt_idx=record.prompt_idx,
            sample_idx=sample_idx,
            agent=record.agent_name,
            reward=float(completion.reward),
            answer=None if answer is None else str(answer),
            stop_reason=completion.stop_reason.value,
            truncated=completion.truncated,
            num_turns=completion.num_turns,
            error=completion.error,
            metadata=dict(record.metadata),
            env_extras={k: v for k, v in completion.env_extras.items() if k not in ("answer", "sample_idx")},
            message_log=tuple(
                LineMessage(m.role, m.content, len(m.token_ids), tuple(m.token_ids) if save_token_ids else None)
                for m in completion.message_log
            ),
            reward_components=dict(completion.reward_components),
            distill=distill_sums(completion),
        )


def distill_sums(completion: Completion) -> dict[str, float]:
    """`reverse_kl_sum`, `scored_tokens` and `teacher_logprob_sum` (the teacher's logprobs of those tokens) of a
    completion the teacher scored (`scoring.reverse_kl_terms`), empty when no token was scored (no teacher, or an error completion)."""
    terms = reverse_kl_terms([completion])
    if not terms:
        return {}
    teacher = [t for m in completion.message_log if m.teacher_logprobs is not None and m.generation_logprobs
               is not None for t in m.teacher_logprobs]
    return {"reverse_kl_sum": math.fsum(terms), "scored_tokens": float(len(terms)),
            "teacher_logprob_sum": math.fsum(teacher)}


def _wrong_type(value: Any, types: tuple[type, ...]) -> bool:
    return not isinstance(value, types) or (bool not in types and isinstance(value, bool))


def _message_problem(i: int, m: Any) -> str | None:
    if not isinstance(m, dict):
        return f"message_log[{i}] is {type(m).__name__}, not an object"
    if not isinstance(m.get("role"), str) or _wrong_type(m.get("num_tokens"), (int,)):
        return f"message_log[{i}] needs a string role and an integer num_tokens"
    ids = m.get("token_ids")
    if ids is not None and (not isinstance(ids, list) or any(_wrong_type(t, (int,)) for t in ids)):
        return f"message_log[{i}].token_ids is not a list of integers"
    return None


def line_problem(row: Any) -> str | None:
    """What is wrong with a parsed line, or None when it is a completion line."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        return f"missing key(s) {missing}"
    checked = {**_REQUIRED, **{k: t for k, t in _OPTIONAL.items() if k in row}}
    bad = [f"{k}={reprlib.repr(row[k])}" for k, types in checked.items() if _wrong_type(row[k], types)]
    if bad:
        return "wrong type: " + ", ".join(bad)
    if row["prompt_idx"] < 0 or row["sample_idx"] < 0:
        return f"negative index: prompt_idx={row['prompt_idx']}, sample_idx={row['sample_idx']}"
    components = row.get("reward_components") or {}
    if any(_wrong_type(v, (int, float)) for v in components.values()):
        return f"reward_components holds a value that is not a number: {reprlib.repr(components)}"
    messages = [p for i, m in enumerate(row.get("message_log") or ()) if (p := _message_problem(i, m))]
    return messages[0] if messages else None
