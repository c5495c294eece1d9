"""Messages with `content: null` through every renderer: tool-call-only assistant turns, and the empty assistant
turn that Gym puts after a call refused for context length. vLLM's OpenAI server renders None content as "";
SmolLM2's real chat template reads `message['content']` and fails on None, the tiny model's accepts it. Every
test runs with both tokenizers."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from nemo_rl_ext.data.chat import ObservationFormatter, tokenize_prompt
from nemo_rl_ext.models.smollm2 import smollm2_path
from nemo_rl_ext.serving.policy_server import PolicyServer, PolicyService
from nemo_rl_ext.testing import ScriptedGeneration

TOKENIZERS = ["tiny", "smollm2"]
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
QUESTION = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in sf, la?"}]


def call(city: str, call_id: str) -> dict:
    """An OpenAI tool call as Gym sends it back (arguments as a JSON string)."""
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def tool_only(city: str, call_id: str, **token_ids) -> dict:
    """A tool-call-only assistant turn: content null."""
    return {"role": "assistant", "content": None, "tool_calls": [call(city, call_id)], **token_ids}


def tool_result(city: str, call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": f"The weather in {city} is cold."}


def vllm_ids(tok, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt ids vLLM's OpenAI server gives `messages`: None content rendered as "", arguments decoded."""
    rendered = []
    for m in messages:
        m = {k: v for k, v in m.items() if not k.endswith("token_ids") and k != "generation_log_probs"}
        m["content"] = m.get("content") or ""
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        rendered.append(m)
    text = tok.apply_chat_template(rendered, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def replies(tokenizer, texts: list[str]) -> ScriptedGeneration:
    """Answers each request with the ids of the next text of `texts` (ended by EOS); records the prompts."""
    return ScriptedGeneration(tokenizer, list(texts), pick="call", eos=True)


@pytest.fixture(scope="module", params=TOKENIZERS)
def tok(request, tiny_model_and_tokenizer):
    """The tiny model's tokenizer, or SmolLM2-135M-Instruct's (converted offline once; only the tokenizer loads)."""
    if request.param == "tiny":
        return tiny_model_and_tokenizer[1]
    return AutoTokenizer.from_pretrained(smollm2_path())


@pytest.fixture
def service(tok) -> PolicyService:
    return PolicyService(replies(tok, []), tok)


def test_a_tool_call_only_turn_renders_as_empty_content(tok, service) -> None:
    messages = [*QUESTION, tool_only("sf", "c1"), tool_result("sf", "c1")]
    answer = service.tokenize({"messages": messages, "tools": [WEATHER_TOOL]})
    assert answer["tokens"] == vllm_ids(tok, messages, [WEATHER_TOOL])


def test_the_empty_turn_gym_puts_after_a_refused_call_renders_as_empty_content(tok, service) -> None:
    messages = [*QUESTION, {"role": "assistant", "content": None}, {"role": "user", "content": "And now?"}]
    assert service.tokenize({"messages": messages})["tokens"] == vllm_ids(tok, messages)


def test_a_third_call_after_two_tool_only_turns_is_served_token_exactly(tok) -> None:
    """What Gym sends on its third model call: two earlier tool-only turns (content null), each with the ids it
    was generated from and as. The prompt continues the last one's ids; the first is rendered as "" content."""
    calls = ['<tool_call>{"name": "get_weather", "arguments": {"city": "sf"}}</tool_call>',
             '<tool_call>{"name": "get_weather", "arguments": {"city": "la"}}</tool_call>',
             "Cold in both."]
    generation = replies(tok, calls)
    with PolicyServer(generation, tok) as server:
        messages = list(QUESTION)
        for i in range(3):
            body = {"messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 32}
            response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            message = response.json()["choices"][0]["message"]
            if i < 2:
                assert message["content"] is None and len(message["tool_calls"]) == 1
                city = json.loads(message["tool_calls"][0]["function"]["arguments"])["city"]
                messages = [*messages, {k: message[k] for k in ("role", "content", "tool_calls", "prompt_token_ids",
                                                                "generation_token_ids", "generation_log_probs")},
                            tool_result(city, message["tool_calls"][0]["id"])]
    assert message["content"] == "Cold in both."
    first, second, third = generation.prompts
    assert first == vllm_ids(tok, QUESTION, [WEATHER_TOOL])
    # every later prompt starts with the previous prompt and generation, exactly
    generated = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in calls]
    assert second[: len(first) + len(generated[0])] == first + generated[0]
    assert third[: len(second) + len(generated[1])] == second + generated[1]
    assert "The weather in la is cold." in tok.decode(third[len(second) + len(generated[1]) :])


def test_datum_prompts_render_none_content_as_empty(tok) -> None:
    messages = [*QUESTION, tool_only("sf", "c1"), tool_result("sf", "c1")]
    prompt = tokenize_prompt(tok, messages)
    assert [t for m in prompt for t in m.token_ids] == vllm_ids(tok, messages)
    assert prompt[2].content == ""


def test_an_observation_with_none_content_renders_as_empty(tok) -> None:
    formatter = ObservationFormatter(tok)
    assert formatter.render("tool", None, True) == formatter.render("tool", "", True)
    assert "None" not in formatter.render("tool", None, False)


def test_text_after_turn_needs_the_turn_rendered_exactly_once(tok) -> None:
    """One function finds the template's text after an assistant turn, for observations and continuations alike;
    a template that drops or repeats the turn is refused (an observation frame) or a 400 (a continuation)."""
    from nemo_rl_ext.data.chat import TURN_MARK, TurnNotRendered, text_after_turn
    from nemo_rl_ext.serving.api_errors import ApiError

    assert text_after_turn(f"a{TURN_MARK}</s>\nnext", drop_eos="</s>") == "\nnext"
    assert text_after_turn(f"a{TURN_MARK}</s>\nnext") == "</s>\nnext"
    for rendered in ("no turn here", f"{TURN_MARK} twice {TURN_MARK}"):
        with pytest.raises(TurnNotRendered, match="not once"):
            text_after_turn(rendered)
    drops_assistant = "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    continued = {"role": "assistant", "content": "hi", "prompt_token_ids": [1, 2], "generation_token_ids": [3]}
    trusting = PolicyService(replies(tok, []), tok, trust_request_chat_template=True)
    with pytest.raises(ApiError, match=r"messages\[1\].*exactly once") as err:
        trusting.tokenize({"messages": [QUESTION[1], continued], "chat_template": drops_assistant})
    assert err.value.param == "messages.1"
    with pytest.raises(TurnNotRendered):
        ObservationFormatter(_with_template(tok, drops_assistant)).render("tool", "x", True)


def _with_template(tok, template: str):
    """A copy of `tok` whose chat template is `template`."""
    import copy

    clone = copy.deepcopy(tok)
    clone.chat_template = template
    return clone
