"""NeMo Gym doubles: fake agent servers that answer `/run` with scripted Gym results, and a policy they never call.

`FakeAgents` serves two agents (`agent_alpha`, `agent_beta`) and a head server's `/server_instances` on one
127.0.0.1 port; the text of a row's last input message scripts what `/run` does (see `FakeAgents`). Every
result is `gym_result`: a two-call rollout (a function call with its token ids, the tool's output, a final
message with its token ids) whose ids are `PROMPT`, `GEN_1`, `TOOL` and `GEN_2`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from nemo_rl_ext.serving.threaded_server import ThreadedServer
from nemo_rl_ext.testing.scripted_generation import ScriptedGeneration

AGENTS = ("agent_alpha", "agent_beta")
"""The agents `FakeAgents` serves."""
PROMPT = [1, 5, 9, 14]
"""Prompt ids of a result's first model call."""
GEN_1 = [21, 22, 23]
"""Ids the first call generated (the function call)."""
TOOL = [31, 32]
"""Ids of the tool output between the two calls."""
GEN_2 = [41, 42, 2]
"""Ids the second call generated (the final message)."""


def gym_result(
    reward: float, prompt: list[int] = PROMPT, second_prompt: list[int] | None = None, status: str = "completed"
) -> dict[str, Any]:
    """A two-call Gym result: function_call, its output, then the final message (token bundles on the items).

    `second_prompt` (default: `prompt` + `GEN_1` + `TOOL`) is the second call's prompt; `status="incomplete"`
    adds Gym's `max_output_tokens` reason.
    """
    second_prompt = second_prompt if second_prompt is not None else prompt + GEN_1 + TOOL
    return {
        "response": {
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": [
                {"type": "function_call", "name": "get_weather", "arguments": "{}", "call_id": "c1",
                 "prompt_token_ids": prompt, "generation_token_ids": GEN_1,
                 "generation_log_probs": [-0.1, -0.2, -0.3]},
                {"type": "function_call_output", "call_id": "c1", "output": "cold"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "42"}],
                 "prompt_token_ids": second_prompt, "generation_token_ids": GEN_2,
                 "generation_log_probs": [-0.4, -0.5, -0.6]},
            ],
        },
        "reward": reward,
        "num_tool_calls": 1,
        "mask_sample": False,
        "failure_kind": None,
        "failure_reason": None,
    }


def refused_result(reward: float = 0.0) -> dict[str, Any]:
    """What Gym 0.7.0 answers when the policy server refused the first model call for context length (a 400 in
    vLLM's "maximum context length" wording): an empty assistant message without token ids, the response
    `incomplete`, and the verifier's reward."""
    empty = {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
             "content": [{"type": "output_text", "text": "", "annotations": []}]}
    return {"response": {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
                         "output": [empty]},
            "reward": reward, "failure_kind": None, "failure_reason": None}


INVALID_ROW_BODY = {"detail": [{"type": "string_type", "loc": ["body", "responses_create_params", "input"],
                                "msg": "Input should be a valid string", "input": 5}]}
"""The HTTP 422 body a Gym agent answers for a row its request model refuses (FastAPI's validation error)."""


class FakeAgents:
    """Gym agent servers at `<url>/<agent>/run`, and a head server's `/server_instances`; `with FakeAgents() as
    agents:` serves them on 127.0.0.1.

    The text of a row's last input message scripts `/run`:

    - `fail N`: HTTP 500 (Gym's "Hit an exception calling an inner server") for the first N attempts of each
      (text, rollout index), then a result;
    - `hang`: answers after 30 s; `sleep S`: after S seconds;
    - a key of `error_bodies`: HTTP 500 with that raw body (e.g. a captured nested Gym error);
    - `badprefix`: a result whose second prompt does not extend the first call's prompt + generation;
    - `invalid`: HTTP 422 with `INVALID_ROW_BODY` (Gym refused the row as malformed);
    - `too long`: `refused_result` (the prompt alone was too long for the policy's context);
    - anything else: `gym_result` with reward 1.0 from `agent_alpha`, 0.5 from `agent_beta`.

    A row without `responses_create_params` gets Gym's 422. Every accepted row is kept in `rows` (with its
    agent under "agent"); `/aggregate_metrics` averages the rewards it is sent, after `aggregate_delay_s`.
    """

    def __init__(self, error_bodies: Mapping[str, str] | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        """Every row `/run` accepted, in order, with "agent" added."""
        self.failures: Counter = Counter()
        """Scripted failures served so far, per (text, rollout index)."""
        self.error_bodies: dict[str, str] = dict(error_bodies or {})
        """Message text -> raw body of an HTTP 500 answer (may be added to before a request)."""
        self.url = ""
        """Root URL while serving."""
        self.aggregate_delay_s = 0.0
        """Seconds `/aggregate_metrics` waits before answering (a slow or stuck aggregate)."""
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/{agent}/run")
        async def run(agent: str, request: Request):
            row = await request.json()
            if "responses_create_params" not in row:
                return JSONResponse({"detail": "responses_create_params: Field required"}, status_code=422)
            self.rows.append({"agent": agent, **row})
            text = row["responses_create_params"]["input"][-1]["content"]
            key = (text, row.get("_ng_rollout_index"))
            if text.startswith("fail") and self.failures[key] < int(text.split()[1]):
                self.failures[key] += 1
                return JSONResponse("Hit an exception calling an inner server", status_code=500)
            if text == "hang":
                await asyncio.sleep(30)
            if text.startswith("sleep "):
                await asyncio.sleep(float(text.split()[1]))
            if text in self.error_bodies:
                return Response(self.error_bodies[text], status_code=500, media_type="application/json")
            if text == "badprefix":
                return gym_result(1.0, second_prompt=[7, 7] + GEN_1)
            if text == "invalid":
                return JSONResponse(INVALID_ROW_BODY, status_code=422)
            if text == "too long":
                return refused_result()
            return gym_result(1.0 if agent == "agent_alpha" else 0.5)

        @app.post("/{agent}/aggregate_metrics")
        async def aggregate(agent: str, request: Request):
            body = await request.json()
            await asyncio.sleep(self.aggregate_delay_s)
            rewards = [r["reward"] for r in body["verify_responses"]]
            return {"agent_metrics": {"mean/reward": sum(rewards) / len(rewards)}, "key_metrics": {}}

        @app.get("/server_instances")
        async def instances():
            return [
                {"config_path": name, "server_type": "responses_api_agents", "url": f"{self.url}/{name}"}
                for name in AGENTS
            ] + [{"config_path": "policy_model", "server_type": "responses_api_models", "url": "http://x"}]

        self.server = ThreadedServer(app, name="fake gym agents", graceful_shutdown_s=0.2)
        """The HTTP server (stop it to play a dead agent server)."""

    def agent_urls(self) -> dict[str, str]:
        """Agent name -> its URL (what `gym.agent_urls` takes)."""
        return {a: f"{self.url}/{a}" for a in AGENTS}

    def __enter__(self) -> FakeAgents:
        self.server.start()
        self.url = self.server.url
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.stop()


class UnusedPolicy(ScriptedGeneration):
    """A policy that must never be called (nothing is scripted: a call fails the test), for rollouts whose
    agents answer without a model, as `FakeAgents` does."""

    def __init__(self, tokenizer: Any = None, max_model_len: int = 1024) -> None:
        super().__init__(tokenizer, (), max_model_len=max_model_len)
