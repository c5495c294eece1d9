"""The multi-turn `tool_calculator` environment: run the model's calculator calls, grade its final answer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nemo_rl_ext.data.records import Message
from nemo_rl_ext.data.tool_calls import MAX_TOOL_CALL_CHARS, MAX_TOOL_CALL_DEPTH, ToolCall, parse_tool_calls
from nemo_rl_ext.environments.calculator import (
    CALCULATOR_SYSTEM_PROMPT,
    CalculatorError,
    evaluate_expression,
    format_number,
)
from nemo_rl_ext.environments.grading_pool import DEFAULT_GRADING_TIMEOUT_S, DEFAULT_GRADING_WORKERS
from nemo_rl_ext.environments.interfaces import EnvironmentInterface, EnvironmentReturn, Observation
from nemo_rl_ext.environments.math_env import (
    MathGrader,
    grade_extras,
    ground_truth_of,
    last_assistant_content,
)
from nemo_rl_ext.environments.registry import register_environment

CALCULATOR_TOOL_NAME = "calculator"
"""The one tool this environment offers."""


@register_environment("tool_calculator", system_prompt=CALCULATOR_SYSTEM_PROMPT)
class ToolCalculatorEnvironment(EnvironmentInterface):
    """Math with a calculator tool: a message with `<tool_call>`s gets their results back (reward 0, not
    terminated); a message without any is the final answer, graded like `math` (reward 1/0, terminated).

    Per-rollout metadata carries the input metadata plus running counts `tool_calls` (calls attempted,
    malformed ones included) and `tool_errors` (calls whose result is an error). The rollout loop caps turns.
    A call longer than `max_tool_call_chars` or nested deeper than `max_tool_call_depth` is malformed: its
    error goes back to the model like any other. Final answers are graded like `math` (same deadline,
    `extras` with `vote_key` and `grading`).
    """

    def __init__(
        self,
        grading_timeout_s: float = DEFAULT_GRADING_TIMEOUT_S,
        grading_workers: int = DEFAULT_GRADING_WORKERS,
        max_tool_call_chars: int = MAX_TOOL_CALL_CHARS,
        max_tool_call_depth: int = MAX_TOOL_CALL_DEPTH,
    ) -> None:
        self.grader = MathGrader(grading_timeout_s, grading_workers)
        self.max_tool_call_chars = max_tool_call_chars
        self.max_tool_call_depth = max_tool_call_depth

    async def step(
        self, message_logs: Sequence[Sequence[Message]], metadata: Sequence[Mapping[str, Any] | None]
    ) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"{len(message_logs)} message logs but {len(metadata)} metadata entries")
        n = len(message_logs)
        truths = [ground_truth_of(m, i) for i, m in enumerate(metadata)]
        observations = [Observation(role="environment", content="")] * n
        new_metadata: list[dict[str, Any]] = []
        rewards, terminateds = [0.0] * n, [False] * n
        answers: list[str | None] = [None] * n
        extras: list[dict[str, Any]] = [{} for _ in range(n)]
        finals: list[int] = []
        for i, (log, meta) in enumerate(zip(message_logs, metadata, strict=True)):
            state = dict(meta or {})
            state.setdefault("tool_calls", 0)
            state.setdefault("tool_errors", 0)
            parsed = parse_tool_calls(
                last_assistant_content(log) or "", self.max_tool_call_chars, self.max_tool_call_depth
            )
            if parsed.calls or parsed.errors:
                results = [_run_call(call) for call in parsed.calls] + [f"error: {e}" for e in parsed.errors]
                state["tool_calls"] += len(results)
                state["tool_errors"] += sum(r.startswith("error:") for r in results)
                observations[i] = Observation(role="tool", content="\n".join(results))
            else:
                finals.append(i)
            new_metadata.append(state)
        if finals:
            grades = await self.grader.grade(
                [last_assistant_content(message_logs[i]) or "" for i in finals], [truths[i] for i in finals]
            )
            for i, grade in zip(finals, grades, strict=True):
                rewards[i], terminateds[i], answers[i] = grade.reward, True, grade.answer
                extras[i] = grade_extras(grade)
        return EnvironmentReturn(
            observations=observations,
            metadata=new_metadata,
            next_stop_strings=[None] * n,
            rewards=rewards,
            terminateds=terminateds,
            answers=answers,
            extras=extras,
        )

    async def vote_keys(self, answers: Sequence[str | None]) -> list[str | None]:
        """Final answers are math answers: math-verify equivalence, as in `math`."""
        return await self.grader.vote_keys(answers)


def _run_call(call: ToolCall) -> str:
    """The text result of one tool call: the calculator's value, or "error: ..."."""
    if call.name != CALCULATOR_TOOL_NAME:
        return f"error: unknown tool {call.name!r}; the only tool is {CALCULATOR_TOOL_NAME!r}"
    expression = call.arguments.get("expression")
    if isinstance(expression, int | float) and not isinstance(expression, bool):
        expression = str(expression)
    if not isinstance(expression, str):
        return "error: calculator needs a string argument 'expression'"
    try:
        return format_number(evaluate_expression(expression))
    except CalculatorError as e:
        return f"error: {e}"
