"""NeMo Gym resources server `arithmetic_grader`: grades a numeric answer the way the project's `math` environment
reads it, without math-verify.

Run BY THE NEMO GYM VENV's python (Gym 0.7.0), as Gym runs every server: `python app.py` in this folder, the
config in NEMO_GYM_CONFIG_DICT. The project's launcher finds this folder itself (docs/nemo_gym.md, "The project's
arithmetic grader"). It imports only Gym and `nemo_rl_ext.data.answers` (standard library), found from this
file's place in the project.

`/verify` takes the row's `expected_answer` (a number, e.g. "-12") and answers:
- `reward`: 1.0 when the number the answer gives (`answer_number`: the last `\\boxed{}`, else a "final answer: ..."
  line, else the last number, as the `math` environment extracts it) equals the expected number, else 0.0;
- `strict`: 1.0 when the whole answer, stripped of surrounding whitespace, is the expected answer (bench/learning.py's
  strict reading), for `rollouts.gym.reward_components`;
- `extracted_answer`: the number read, as text (None when the answer gives none).
A row whose `expected_answer` is not a number is refused (HTTP 422 naming the value), not scored 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fastapi import HTTPException
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseRunRequest,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from pydantic import ConfigDict

PROJECT_ROOT = Path(__file__).resolve().parents[5]
"""The folder holding the `nemo_rl_ext` package (this file is nemo_rl_ext/gym/servers/resources_servers/<name>/)."""
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

from nemo_rl_ext.data.answers import (  # noqa: E402
    answer_number,
    clean_answer,
    number_correct,
    parse_number,
    strict_correct,
)


class ArithmeticGraderConfig(BaseResourcesServerConfig):
    """The server's config block (Gym's common keys only)."""

    name: str = "arithmetic_grader"


class ArithmeticRunRequest(BaseRunRequest):
    """A row: Gym's responses_create_params plus the expected number (other keys are kept)."""

    model_config = ConfigDict(extra="allow")

    expected_answer: str


class ArithmeticVerifyRequest(ArithmeticRunRequest, BaseVerifyRequest):
    """The row and the model's response."""


class ArithmeticVerifyResponse(BaseVerifyResponse):
    """Gym's verify response plus the strict reading and the number read."""

    model_config = ConfigDict(extra="allow")

    strict: float
    extracted_answer: str | None


def answer_text(body: BaseVerifyRequest) -> str:
    """The text of the response's last message (its output_text parts), "" when it has none."""
    messages = [output for output in body.response.output if output.type == "message"]
    if not messages:
        return ""
    return "".join(part.text for part in messages[-1].content if part.type == "output_text")


class ArithmeticGraderServer(SimpleResourcesServer):
    """Grades arithmetic answers: the lenient number reading as the reward, the strict one beside it."""

    ray_enabled = False
    config: ArithmeticGraderConfig

    async def verify(self, body: ArithmeticVerifyRequest) -> ArithmeticVerifyResponse:
        if parse_number(clean_answer(body.expected_answer)) is None:  # every answer would score 0: refuse the row
            raise HTTPException(status_code=422, detail=f"arithmetic_grader: the row's expected_answer "
                                f"{body.expected_answer!r} is not a number (e.g. '-12', '3.5', '7/2')")
        text = answer_text(body)
        value = answer_number(text)
        return ArithmeticVerifyResponse(
            **body.model_dump(),
            reward=1.0 if number_correct(text, body.expected_answer) else 0.0,
            strict=1.0 if strict_correct(text, body.expected_answer) else 0.0,
            extracted_answer=None if value is None else str(value),
        )


if __name__ == "__main__":
    ArithmeticGraderServer.run_webserver()
