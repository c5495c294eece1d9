"""The multi-turn `guess_number` environment: the model guesses a secret number, the environment answers
"Higher." or "Lower." until the guess is right or the guesses run out.

The reward depends on what the environment said in earlier turns: a model that ignores the feedback can only
guess blindly, one that reads it can narrow the range (binary search solves a range of 2**k - 1 numbers in k
guesses). Rows are question/answer rows whose answer, the secret, is an integer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_rl_ext.data.datasets import RowPrompt, qa_row
from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Observation
from nemo_rl_ext.environments.math_env import ground_truth_of, last_assistant_content
from nemo_rl_ext.environments.registry import register_environment

GUESS_SYSTEM_PROMPT = (
    "Guess the secret whole number. Reply with just one number. After each wrong guess you are told whether the "
    "secret is higher or lower; use that for your next guess."
)
"""Default system prompt of `guess_number` prompts."""
HIGHER, LOWER, NO_GUESS = "Higher.", "Lower.", "Reply with just one whole number."
"""The environment's replies to a guess below the secret, above it, and to a reply with no number."""

_INTEGER = re.compile(r"-?\d+")


def parse_guess(text: str | None) -> int | None:
    """The guess in a reply: its last integer ("I guess 7" -> 7, "7" -> 7), None when it has none."""
    found = _INTEGER.findall(text or "")
    return int(found[-1]) if found else None


def secret_of(value: Any, where: str) -> int:
    """The secret as an int ("7", 7), or a ValueError naming where it came from and the value."""
    try:
        if isinstance(value, bool) or str(value).strip() != str(int(str(value).strip())):
            raise ValueError
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{where}: the secret (ground_truth) must be a whole number, got {value!r}") from None


def guess_row(row: Mapping[str, Any], *, question_key: str = "question", answer_key: str = "answer") -> RowPrompt:
    """Question/answer rows whose answer (the secret) is a whole number; another answer is refused."""
    prompt = qa_row(row, question_key=question_key, answer_key=answer_key)
    secret_of(row[answer_key], f"answer {answer_key!r}")
    return prompt


@register_environment("guess_number", system_prompt=GUESS_SYSTEM_PROMPT, row_adapter=guess_row)
class GuessNumberEnvironment(EnvironmentInterface):
    """Guess the number: each assistant turn is a guess (the last integer of the reply, `parse_guess`).

    A right guess ends the rollout with reward `discount ** (guesses - 1)` (1.0 on the first guess); a wrong one
    gets "Higher." or "Lower." back as a `user` message (reward 0), a reply without a number gets "Reply with just
    one whole number." (it counts as a guess). After `max_guesses` wrong guesses the rollout ends with reward 0.
    Per-rollout metadata carries the input metadata plus `guesses` (turns so far). The answer (and maj@k vote
    key) of an ended rollout is its last guess; `extras` has `guesses` and `solved`.
    """

    def __init__(self, max_guesses: int = 4, discount: float = 1.0) -> None:
        if not isinstance(max_guesses, int) or isinstance(max_guesses, bool) or max_guesses < 1:
            raise ValueError(f"max_guesses must be an integer >= 1, got {max_guesses!r}")
        if not 0.0 < discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {discount!r}")
        self.max_guesses = max_guesses
        self.discount = discount

    async def step(
        self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"{len(message_logs)} message logs but {len(metadata)} metadata entries")
        secrets = [secret_of(ground_truth_of(m, i), f"rollout {i}") for i, m in enumerate(metadata)]
        steps = [self._one(log, meta, secret) for log, meta, secret in zip(message_logs, metadata, secrets, strict=True)]
        return EnvironmentReturn.from_steps(steps)

    def _one(
        self, log: Sequence[Message], meta: Mapping[str, Any] | None, secret: int
    ) -> tuple[Observation, dict[str, Any], float, bool, str | None, dict[str, Any]]:
        """(observation, metadata, reward, terminated, answer, extras) of one rollout's latest guess."""
        state = dict(meta or {})
        state["guesses"] = int(state.get("guesses", 0)) + 1
        guess = parse_guess(last_assistant_content(log))
        answer = None if guess is None else str(guess)
        if guess == secret:
            reward = self.discount ** (state["guesses"] - 1)
            return (Observation("user", ""), state, reward, True, answer,
                    {"vote_key": answer, "guesses": state["guesses"], "solved": True})
        reply = NO_GUESS if guess is None else (HIGHER if secret > guess else LOWER)
        over = state["guesses"] >= self.max_guesses
        extras = {"vote_key": answer, "guesses": state["guesses"], "solved": False} if over else {}
        return Observation("user", "" if over else reply), state, 0.0, over, answer if over else None, extras
