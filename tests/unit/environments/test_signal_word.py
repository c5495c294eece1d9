"""The signal_word environment on hand-made rollouts: the reply it gives, the score of the second turn, the
ceiling of a policy that ignores the reply, bad settings and answers."""

from __future__ import annotations

import asyncio

import pytest

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments import SignalWordEnvironment, create_environment, environment_entry


def _log(*turns: str) -> list[Message]:
    """A message log: the question, then assistant turns with a (placeholder) reply between them."""
    log = [Message(role="user", content="Green: yes. Red: no.", token_ids=())]
    for turn in turns:
        log += [Message(role="assistant", content=turn, token_ids=()), Message(role="user", content="-", token_ids=())]
    return log[:-1]


def _play(env: SignalWordEnvironment, answer: str, turns: list[str]):
    """Step the environment through the turns as the rollout loop does (metadata carried along)."""
    meta: dict = {"ground_truth": answer}
    steps = []
    for i, _ in enumerate(turns):
        ret = asyncio.run(env.step([_log(*turns[: i + 1])], [meta]))
        meta = dict(ret.metadata[0])
        steps.append((ret.observations[0].content, ret.rewards[0], ret.terminateds[0], ret.answers[0]))
        if ret.terminateds[0]:
            break
    return steps, ret


def test_the_first_turn_gets_the_signal_and_the_second_is_scored_against_its_answer():
    steps, ret = _play(SignalWordEnvironment(), "yes", ["whatever 7", " yes "])
    assert steps == [("Green.", 0.0, False, None), ("", 1.0, True, "yes")]
    assert ret.extras[0] == {"vote_key": "yes", "signal": "Green.", "solved": True}
    steps, ret = _play(SignalWordEnvironment(), "no", ["yes", "yes"])  # the first turn is not scored
    assert steps == [("Red.", 0.0, False, None), ("", 0.0, True, "yes")]
    assert ret.extras[0]["solved"] is False and ret.observations[0].role == "user"


def test_a_policy_that_ignores_the_reply_scores_at_most_one_over_the_signals():
    env = SignalWordEnvironment(signals={"a": "1", "b": "2", "c": "3"})
    problems = ["1", "2", "3"] * 2
    for fixed in ("1", "2", "3", "x"):  # the same second turn whatever the environment said
        solved = sum(_play(env, answer, ["hi", fixed])[0][-1][1] for answer in problems)
        assert solved <= len(problems) / 3
    reading = {"a": "1", "b": "2", "c": "3"}  # the second turn the reply asks for
    assert sum(_play(env, answer, ["hi", reading[env.signal_of[answer]]])[0][-1][1] for answer in problems) == 6


def test_similarity_mode_pays_partial_credit_and_one_only_for_the_answer():
    env = SignalWordEnvironment(mode="similarity")
    assert _play(env, "yes", ["", "yes"])[0][-1][1] == 1.0
    assert _play(env, "yes", ["", "the yes"])[0][-1][1] == pytest.approx(2 * 3 / (7 + 3))
    assert _play(env, "no", ["", "yes"])[0][-1][1] == 0.0


def test_bad_settings_and_answers_are_refused_by_name():
    with pytest.raises(ValueError, match="at least 2"):
        SignalWordEnvironment(signals={"Green.": "yes"})
    with pytest.raises(ValueError, match=r"bad entries: 'Red.': ''"):
        SignalWordEnvironment(signals={"Green.": "yes", "Red.": ""})
    with pytest.raises(ValueError, match="one to one"):
        SignalWordEnvironment(signals={"Green.": "yes", "Red.": "yes"})
    with pytest.raises(ValueError, match="mode"):
        SignalWordEnvironment(mode="fuzzy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rollout 1: the answer .* one of \['no', 'yes'\] .* got 'maybe'"):
        asyncio.run(SignalWordEnvironment().step([_log("hi"), _log("hi")],
                                                 [{"ground_truth": "yes"}, {"ground_truth": "maybe"}]))


def test_it_is_registered_with_its_prompt():
    entry = environment_entry("signal_word")
    assert "green" in (entry.system_prompt or "")
    env = create_environment("signal_word", signals={"L": "1", "R": "2"}, mode="prefix")
    assert isinstance(env, SignalWordEnvironment) and env.signal_of == {"1": "L", "2": "R"}
