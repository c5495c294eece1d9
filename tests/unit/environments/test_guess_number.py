"""The guess_number environment on hand-made games: feedback, rewards, the guess cap, bad rows."""

from __future__ import annotations

import asyncio

import pytest

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments import create_environment, environment_entry
from nemo_rl_ext.environments.guess_number import (
    HIGHER,
    LOWER,
    NO_GUESS,
    GuessNumberEnvironment,
    guess_row,
    parse_guess,
)


def _log(*guesses: str) -> list[Message]:
    """A message log: the question, then each guess followed by a reply (the last guess has none yet)."""
    log = [Message(role="user", content="Guess 1 to 10.", token_ids=())]
    for guess in guesses:
        log += [Message(role="assistant", content=guess, token_ids=()), Message(role="user", content="-", token_ids=())]
    return log[:-1]


def _play(env: GuessNumberEnvironment, secret: str, guesses: list[str]):
    """Step the environment through the guesses as the rollout loop would (metadata carried along)."""
    meta: dict = {"ground_truth": secret}
    steps = []
    for i, _ in enumerate(guesses):
        ret = asyncio.run(env.step([_log(*guesses[: i + 1])], [meta]))
        meta = dict(ret.metadata[0])
        steps.append((ret.observations[0].content, ret.rewards[0], ret.terminateds[0], ret.answers[0]))
        if ret.terminateds[0]:
            break
    return steps, meta, ret


def test_feedback_says_which_way_and_a_right_guess_ends_with_reward_1():
    steps, meta, ret = _play(GuessNumberEnvironment(max_guesses=4), "7", ["5", "I guess 9", "7"])
    assert steps == [(HIGHER, 0.0, False, None), (LOWER, 0.0, False, None), ("", 1.0, True, "7")]
    assert meta["guesses"] == 3 and ret.observations[0].role == "user"
    assert ret.extras[0] == {"vote_key": "7", "guesses": 3, "solved": True}


def test_discount_pays_later_guesses_less():
    steps, _, _ = _play(GuessNumberEnvironment(max_guesses=4, discount=0.5), "3", ["1", "2", "3"])
    assert steps[-1][1:3] == (0.25, True)  # 0.5 ** (3 - 1)
    first, _, _ = _play(GuessNumberEnvironment(discount=0.5), "3", ["3"])
    assert first == [("", 1.0, True, "3")]


def test_running_out_of_guesses_ends_with_reward_0_and_no_guess_counts():
    steps, _, ret = _play(GuessNumberEnvironment(max_guesses=2), "3", ["no idea", "1"])
    assert steps == [(NO_GUESS, 0.0, False, None), ("", 0.0, True, "1")]
    assert ret.extras[0] == {"vote_key": "1", "guesses": 2, "solved": False}


def test_parse_guess_takes_the_last_integer():
    assert parse_guess("7") == 7 and parse_guess("between 1 and 10: 4") == 4 and parse_guess("-3") == -3
    assert parse_guess("seven") is None and parse_guess(None) is None


def test_bad_settings_and_rows_are_refused_by_name():
    with pytest.raises(ValueError, match="max_guesses"):
        GuessNumberEnvironment(max_guesses=0)
    with pytest.raises(ValueError, match="discount"):
        GuessNumberEnvironment(discount=0.0)
    with pytest.raises(ValueError, match="rollout 0: the secret .* got '7.5'"):
        asyncio.run(GuessNumberEnvironment().step([_log("7")], [{"ground_truth": "7.5"}]))
    with pytest.raises(ValueError, match="answer 'answer': the secret .* got 'seven'"):
        guess_row({"question": "Guess.", "answer": "seven"})
    assert guess_row({"question": "Guess.", "answer": "7"}).extra_env_info == {"ground_truth": "7"}


def test_it_is_registered_with_its_prompt_and_row_adapter():
    entry = environment_entry("guess_number")
    assert entry.row_adapter is guess_row and "higher or lower" in (entry.system_prompt or "")
    assert isinstance(create_environment("guess_number", max_guesses=3), GuessNumberEnvironment)


def test_rows_with_a_bad_secret_are_named_when_the_data_loads():
    from nemo_rl_ext.data.datasets import qa_datums
    from nemo_rl_ext.models.tiny import build_tokenizer

    rows = [{"question": "Guess.", "answer": "3"}, {"question": "Guess.", "answer": "7.5"}]
    with pytest.raises(ValueError, match=r"row 1: ValueError: answer 'answer': the secret .* got '7.5'"):
        qa_datums(build_tokenizer(), rows, "guess_number", row_adapter=environment_entry("guess_number").row_adapter)
