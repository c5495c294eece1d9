"""Math grading, the math and tool_calculator environments, and the environment registry."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments import (
    EnvironmentInterface,
    EnvironmentReturn,
    MathEnvironment,
    Observation,
    ToolCalculatorEnvironment,
    available_environments,
    create_environment,
    register_environment,
)
from nemo_rl_ext.environments.math_env import extract_answer, grade_answer


def msg(role: str, content: str) -> Message:
    return Message(role=role, content=content, token_ids=())


PROMPT = (msg("system", "You are a math assistant."), msg("user", "What is 6 * 7?"))


def call(expression: str, name: str = "calculator") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'


# --- answer extraction and grading -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the result is \\boxed{42}.", "42"),
        ("first \\boxed{1}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ \\sqrt{x^{2}} }", "\\sqrt{x^{2}}"),
        ("Final answer: 17.", "17"),
        ("The answer is **$3\\pi$**.", "3\\pi"),
        ("I computed 3 then 1,000 apples", "1,000"),
        ("it is -2.5 or 7/8", "7/8"),
        ("<think>maybe \\boxed{5}</think> It is 6", "6"),
        ("The answer is 17<|im_end|>", "17"),
        ("\\boxed{17}.<|im_end|><|endoftext|>", "17"),
        ("no digits here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("response", "truth", "reward"),
    [
        ("So \\boxed{42}.", "42", 1.0),
        ("So \\boxed{41}.", "42", 0.0),
        ("6 times 7 is 42", "42", 1.0),
        ("6 times 7 is 43", "42", 0.0),
        ("Final answer: 42.0", 42, 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("the answer is 1/2", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac12", 1.0),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        ("I don't know", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_grade_answer(response: str, truth: object, reward: float) -> None:
    assert grade_answer(response, truth).reward == reward


@pytest.mark.timeout(30)  # without the guard these hang for minutes or forever
@pytest.mark.parametrize(
    "answer", ["9^{9^{9}}", "2^{2^{2^{5}}}", "(10^{10})^{10^{10}}", "100000000!", "9^{9^{9^{9}}}"]
)
def test_huge_answers_are_wrong_and_fast(answer: str) -> None:
    # math-verify's own timeout is off (it needs the main thread), so these must be refused before sympy
    start = time.perf_counter()
    grade = grade_answer(f"\\boxed{{{answer}}}", "3")
    assert grade.reward == 0.0 and grade.answer == answer
    assert time.perf_counter() - start < 2.0


def test_grading_works_in_a_non_main_thread() -> None:
    results: list[float] = []
    failures: list[BaseException] = []

    def work() -> None:
        try:
            results.append(grade_answer("\\boxed{\\frac{3}{4}}", "0.75").reward)
            results.append(grade_answer("the answer is 12", "13").reward)
        except BaseException as e:  # reported below
            failures.append(e)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=30)
    assert not failures, failures
    assert results == [1.0, 0.0]


# --- the math environment ----------------------------------------------------------------------------


async def test_math_environment_grades_last_assistant_message() -> None:
    env = MathEnvironment()
    logs = [
        (
            *PROMPT,
            msg("assistant", "\\boxed{41}"),
            msg("user", "again"),
            msg("assistant", "It is \\boxed{42}"),
        ),
        (*PROMPT, msg("assistant", "It is 41")),
        (*PROMPT, msg("assistant", "no idea")),
    ]
    metadata = [{"ground_truth": "42", "id": 1}, {"ground_truth": "42"}, {"ground_truth": "42"}]
    result = await env.step(logs, metadata)
    assert isinstance(result, EnvironmentReturn)
    assert list(result.rewards) == [1.0, 0.0, 0.0]
    assert list(result.terminateds) == [True, True, True]
    assert list(result.answers) == ["42", "41", None]
    assert list(result.next_stop_strings) == [None, None, None]
    assert result.metadata[0] == {"ground_truth": "42", "id": 1}


async def test_math_environment_grades_in_a_worker_thread_of_a_running_loop() -> None:
    env = MathEnvironment()
    result = await asyncio.to_thread(
        lambda: asyncio.run(
            env.step([(*PROMPT, msg("assistant", "\\boxed{0.5}"))], [{"ground_truth": "1/2"}])
        )
    )
    assert list(result.rewards) == [1.0]


async def test_math_environment_needs_ground_truth() -> None:
    with pytest.raises(ValueError, match="rollout 1: metadata has no 'ground_truth'"):
        await MathEnvironment().step([PROMPT, PROMPT], [{"ground_truth": "1"}, {}])


# --- the tool_calculator environment -----------------------------------------------------------------


async def test_scripted_three_turn_tool_conversation() -> None:
    env = ToolCalculatorEnvironment()
    log: list[Message] = list(PROMPT)
    metadata: list[dict | None] = [{"ground_truth": "1806", "id": "q1"}]
    turns = [
        f"First 6 * 7.\n{call('6 * 7')}",
        f"Now square and add.\n{call('42 ** 2 + 42')}",
        "So the answer is \\boxed{1806}.",
    ]
    seen: list[tuple[Observation, float, bool, str | None]] = []
    for text in turns:
        log.append(msg("assistant", text))
        result = await env.step([tuple(log)], metadata)
        observation = result.observations[0]
        seen.append((observation, result.rewards[0], result.terminateds[0], result.answers[0]))
        metadata = [dict(result.metadata[0])]
        if not result.terminateds[0]:
            log.append(msg(observation.role, observation.content))
    assert seen[0] == (Observation(role="tool", content="42"), 0.0, False, None)
    assert seen[1] == (Observation(role="tool", content="1806"), 0.0, False, None)
    assert seen[2][1:] == (1.0, True, "1806")
    assert metadata[0] == {"ground_truth": "1806", "id": "q1", "tool_calls": 2, "tool_errors": 0}


async def test_tool_errors_are_observations_not_terminations() -> None:
    env = ToolCalculatorEnvironment()
    logs = [
        (*PROMPT, msg("assistant", call("__import__('os')"))),
        (*PROMPT, msg("assistant", call("1+1", name="search"))),
        (*PROMPT, msg("assistant", "<tool_call>{not json}</tool_call>")),
        (
            *PROMPT,
            msg("assistant", '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'),
        ),
        (*PROMPT, msg("assistant", call("1/0"))),
    ]
    result = await env.step(logs, [{"ground_truth": "42"}] * len(logs))
    contents = [o.content for o in result.observations]
    assert all(o.role == "tool" for o in result.observations)
    assert all(c.startswith("error: ") for c in contents), contents
    assert "function calls are not allowed" in contents[0]
    assert "unknown tool 'search'" in contents[1] and "'calculator'" in contents[1]
    assert "invalid JSON" in contents[2]
    assert "'expression'" in contents[3]
    assert "division by zero" in contents[4]
    assert list(result.rewards) == [0.0] * 5
    assert list(result.terminateds) == [False] * 5
    assert list(result.answers) == [None] * 5
    assert all(m["tool_calls"] == 1 and m["tool_errors"] == 1 for m in result.metadata)


async def test_several_calls_in_one_message_answer_in_order() -> None:
    env = ToolCalculatorEnvironment()
    log = (*PROMPT, msg("assistant", f"{call('2 + 2')}\n{call('10 / 4')}\n{call('1/0')}"))
    result = await env.step([log], [{"ground_truth": "4", "tool_calls": 3, "tool_errors": 1}])
    assert result.observations[0].content == "4\n2.5\nerror: division by zero"
    assert result.metadata[0]["tool_calls"] == 6 and result.metadata[0]["tool_errors"] == 2


async def test_mixed_batch_grades_only_final_answers() -> None:
    env = ToolCalculatorEnvironment()
    logs = [
        (*PROMPT, msg("assistant", call("6*7"))),
        (*PROMPT, msg("assistant", "\\boxed{42}")),
        (*PROMPT, msg("assistant", "\\boxed{41}")),
    ]
    result = await env.step(logs, [{"ground_truth": "42"}, {"ground_truth": "42"}, {"ground_truth": 42}])
    assert list(result.rewards) == [0.0, 1.0, 0.0]
    assert list(result.terminateds) == [False, True, True]
    assert list(result.answers) == [None, "42", "41"]
    assert [m["tool_calls"] for m in result.metadata] == [1, 0, 0]


# --- the registry ------------------------------------------------------------------------------------


def test_builtin_environments_are_registered_on_import() -> None:
    assert {"math", "tool_calculator"} <= set(available_environments())
    assert isinstance(create_environment("math"), MathEnvironment)
    assert isinstance(create_environment("tool_calculator"), ToolCalculatorEnvironment)


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown environment 'maths'") as info:
        create_environment("maths")
    assert "math" in str(info.value) and "tool_calculator" in str(info.value)


def test_register_custom_environment_with_kwargs() -> None:
    @register_environment("test_constant_reward")
    class ConstantReward(EnvironmentInterface):
        def __init__(self, reward: float) -> None:
            self.reward = reward

        async def step(self, message_logs: Sequence, metadata: Sequence) -> EnvironmentReturn:
            n = len(message_logs)
            return EnvironmentReturn(
                [Observation("environment", "")] * n,
                list(metadata),
                [None] * n,
                [self.reward] * n,
                [True] * n,
                [None] * n,
            )

    env = create_environment("test_constant_reward", reward=0.25)
    assert isinstance(env, ConstantReward) and env.reward == 0.25
    assert "test_constant_reward" in available_environments()


def test_registry_refuses_name_clashes_and_non_environments() -> None:
    with pytest.raises(ValueError, match="already registered"):

        @register_environment("math")
        class OtherMath(EnvironmentInterface):
            async def step(self, message_logs: Sequence, metadata: Sequence) -> EnvironmentReturn:
                raise NotImplementedError

    with pytest.raises(TypeError, match="EnvironmentInterface subclass"):
        register_environment("not_an_env")(object)  # type: ignore[arg-type]
    assert "not_an_env" not in available_environments()
    assert isinstance(create_environment("math"), MathEnvironment)


# --- maj@k vote keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spellings",
    [
        ["0.5", "1/2", "\\frac{1}{2}", "\\frac{2}{4}", "\\dfrac12"],
        ["21", "21.", '"21"', "21.0", "$21$", " 21 "],
        ["2\\sqrt{2}", "\\sqrt{8}"],
        ["x = 3", "3"],
        ["x+1", "1 + x"],
    ],
)
async def test_math_vote_keys_group_equivalent_spellings(spellings: list[str]) -> None:
    keys = await MathEnvironment().vote_keys(spellings)
    assert len(set(keys)) == 1 and keys[0] is not None, dict(zip(spellings, keys, strict=True))


async def test_math_vote_keys_keep_different_answers_apart() -> None:
    answers = ["21", "22", "1/2", "1/3", "0.333333", "x+1", "x+2", None]
    keys = await MathEnvironment().vote_keys(answers)
    assert keys[-1] is None
    assert len(set(keys[:-1])) == len(answers) - 1, keys


async def test_math_environment_stores_the_vote_key_with_the_grade() -> None:
    env = MathEnvironment()
    texts = ["\\boxed{0.5}", "so it is \\boxed{\\frac{1}{2}}", "The answer is 1/2.", "\\boxed{0.25}", "\\boxed{1/4}"]
    result = await env.step([(*PROMPT, msg("assistant", t)) for t in texts], [{"ground_truth": "\\frac12"}] * 5)
    assert list(result.rewards) == [1.0, 1.0, 1.0, 0.0, 0.0]
    keys = [e["vote_key"] for e in result.extras]
    assert keys[0] == keys[1] == keys[2] and keys[3] == keys[4] and keys[0] != keys[3]
    assert [e["grading"] for e in result.extras] == ["ok"] * 5


async def test_string_match_and_tool_environments_key_their_answers() -> None:
    string_env = create_environment("string_match", mode="exact", case_sensitive=False)
    logs = [(*PROMPT, msg("assistant", t)) for t in ("Paris", " paris ", "PARIS!")]
    result = await string_env.step(logs, [{"ground_truth": "paris"}] * 3)
    assert [e["vote_key"] for e in result.extras] == ["paris", "paris", "paris!"]
    assert await string_env.vote_keys(["Paris ", None]) == ["paris", None]

    tool_env = ToolCalculatorEnvironment()
    logs = [(*PROMPT, msg("assistant", call("6*7"))), (*PROMPT, msg("assistant", "\\boxed{42.}"))]
    result = await tool_env.step(logs, [{"ground_truth": "42"}] * 2)
    assert result.extras[0] == {} and result.extras[1] == {"vote_key": "42", "grading": "ok"}
    assert await tool_env.vote_keys(["42.", "\\frac{84}{2}"]) == ["42", "42"]


async def test_the_default_vote_key_collapses_whitespace() -> None:
    class Plain(EnvironmentInterface):
        async def step(self, message_logs: Sequence, metadata: Sequence) -> EnvironmentReturn:
            raise NotImplementedError

    assert await Plain().vote_keys([" a  b ", "a b", None]) == ["a b", "a b", None]


# --- hostile tool calls ------------------------------------------------------------------------------


async def test_hostile_tool_calls_are_tool_errors_and_the_rollout_goes_on() -> None:
    env = ToolCalculatorEnvironment()
    deep = '<tool_call>{"name": "calculator", "arguments": ' + "[" * 100_000 + "}</tool_call>"
    deep_in_size = '<tool_call>{"name": "calculator", "arguments": ' + "[" * 10_000 + "}</tool_call>"
    deep_string = '<tool_call>{"name": "calculator", "arguments": "' + "[" * 10_000 + '"}</tool_call>'
    huge = call("1+1").replace('"1+1"', '"1+1", "pad": "' + "x" * 1_000_000 + '"')
    texts = (deep, deep_in_size, deep_string, huge)
    logs = [(*PROMPT, msg("assistant", text)) for text in texts]
    result = await env.step(logs, [{"ground_truth": "2"}] * len(texts))
    assert [o.role for o in result.observations] == ["tool"] * len(texts)
    contents = [o.content for o in result.observations]
    assert all(c.startswith("error: tool call 1") for c in contents), [c[:100] for c in contents]
    assert "characters long" in contents[0] and "characters long" in contents[3]
    assert "nested 10001 levels deep, more than the 64 allowed" in contents[1]
    assert "nested 10000 levels deep, more than the 64 allowed" in contents[2]
    assert all(len(c) < 500 for c in contents)  # the error names the problem, it does not echo the call
    assert list(result.terminateds) == [False] * len(texts) and list(result.rewards) == [0.0] * len(texts)
    assert all(m["tool_calls"] == 1 and m["tool_errors"] == 1 for m in result.metadata)


async def test_tool_call_limits_are_environment_settings() -> None:
    env = create_environment("tool_calculator", max_tool_call_chars=70, max_tool_call_depth=2)
    logs = [
        (*PROMPT, msg("assistant", call("1 + 2 + 3 + 4 + 5 + 6 + 7 + 8"))),
        (*PROMPT, msg("assistant", '<tool_call>{"name": "calculator", "arguments": {"e": [1]}}</tool_call>')),
        (*PROMPT, msg("assistant", call("2*3"))),
    ]
    result = await env.step(logs, [{"ground_truth": "1"}] * 3)
    contents = [o.content for o in result.observations]
    assert "more than the 70 allowed" in contents[0]
    assert "nested 3 levels deep, more than the 2 allowed" in contents[1]
    assert contents[2] == "6"
