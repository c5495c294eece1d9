"""The multi-turn `signal_word` environment: the answer depends only on what the environment says.

The model's first turn is free (anything); the environment then replies with the problem's signal word (by
default "Green." or "Red.") as a user turn, and the model's second turn is scored against the answer that
word maps to ("yes" on green, "no" on red). The signal is not in the prompt, so a model that ignores the
environment's reply can do no better than 1 / (number of signals) on average over balanced problems; one
that reads it scores 1. A scripted task for showing that a policy learned to use the environment's reply.

Rows are question/answer rows whose answer is one of the mapped answers; the environment says the signal
word that maps to it (the mapping is one to one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Observation
from nemo_rl_ext.environments.math_env import ground_truth_of, last_assistant_content
from nemo_rl_ext.environments.registry import register_environment
from nemo_rl_ext.environments.string_match import MatchMode, match_reward

SIGNAL_SYSTEM_PROMPT = (
    "Say anything. You will then be told a colour: answer yes if it is green and no if it is red, "
    "with just that word."
)
"""Default system prompt of `signal_word` prompts."""
DEFAULT_SIGNALS = {"Green.": "yes", "Red.": "no"}
"""The default mapping: the environment's reply -> the answer it asks for."""


@register_environment("signal_word", system_prompt=SIGNAL_SYSTEM_PROMPT)
class SignalWordEnvironment(EnvironmentInterface):
    """Two turns: the first is free, the environment answers with the signal word that maps to the row's
    answer (`signals`, word -> answer, one to one), and the second is scored against that answer with
    `match_reward` (`mode`: `exact`, 1.0 only for the whole answer, whitespace stripped; `similarity`, difflib's
    ratio, a denser reward for training a model from scratch; `prefix`). The rollout then ends.

    The answer (and maj@k vote key) of an ended rollout is its second reply, stripped; `extras` has `signal`
    (what the environment said) and `solved` (the reply is exactly the answer).
    """

    def __init__(self, signals: Mapping[str, str] | None = None, mode: MatchMode = "exact") -> None:
        signals = dict(DEFAULT_SIGNALS if signals is None else signals)
        bad = [f"{k!r}: {v!r}" for k, v in signals.items()
               if not (isinstance(k, str) and k.strip() and isinstance(v, str) and v.strip())]
        if len(signals) < 2 or bad:
            raise ValueError(f"signals must map at least 2 non-empty words to non-empty answers, got {signals!r}"
                             + (f" (bad entries: {', '.join(bad)})" if bad else ""))
        if len(set(signals.values())) != len(signals):
            raise ValueError(f"signals must map each word to its own answer (one to one), got {signals!r}")
        if mode not in ("exact", "similarity", "prefix"):
            raise ValueError(f"mode must be 'exact', 'similarity' or 'prefix', got {mode!r}")
        self.signals = signals
        self.signal_of = {answer: word for word, answer in signals.items()}
        self.mode: MatchMode = mode

    def _signal(self, answer: Any, i: int) -> str:
        """The word that asks for the row's answer, or a ValueError naming the rollout and the value."""
        if str(answer) not in self.signal_of:
            raise ValueError(f"rollout {i}: the answer (ground_truth) must be one of {sorted(self.signal_of)} "
                             f"(the signals' answers), got {answer!r}")
        return self.signal_of[str(answer)]

    async def step(
        self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"{len(message_logs)} message logs but {len(metadata)} metadata entries")
        targets = [str(ground_truth_of(m, i)) for i, m in enumerate(metadata)]
        signals = [self._signal(t, i) for i, t in enumerate(targets)]
        steps = [self._one(log, meta, target, signal)
                 for log, meta, target, signal in zip(message_logs, metadata, targets, signals, strict=True)]
        return EnvironmentReturn.from_steps(steps)

    def _one(
        self, log: Sequence[Message], meta: Mapping[str, Any] | None, target: str, signal: str
    ) -> tuple[Observation, dict[str, Any], float, bool, str | None, dict[str, Any]]:
        """(observation, metadata, reward, terminated, answer, extras) of one rollout's latest turn."""
        state = dict(meta or {})
        state["turns"] = int(state.get("turns", 0)) + 1
        if state["turns"] == 1:
            return Observation("user", signal), state, 0.0, False, None, {}
        reply = (last_assistant_content(log) or "").strip()
        reward = match_reward(reply, target, self.mode)
        extras = {"vote_key": reply, "signal": signal, "solved": reply == target}
        return Observation("user", ""), state, reward, True, reply, extras
