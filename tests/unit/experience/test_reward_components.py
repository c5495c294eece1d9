"""Named reward components: a native environment's step results summed over turns, NeMo Gym's /verify fields
named by `rollouts.gym.reward_components`, and one clear error for a missing or non-numeric one."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from nemo_rl_ext.data.datasets import datum_from_messages
from nemo_rl_ext.data.records import RewardComponentError, StopReason
from nemo_rl_ext.environments.interfaces import Observation
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.experience.fault_policy import FaultPolicy
from nemo_rl_ext.experience.gym_results import result_to_completion
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.gym.config import GymConfig
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.testing import ScriptedEnvironment, ScriptedGeneration

CAPTURED = Path(__file__).parents[2] / "data" / "gym" / "collector-output-rollouts.jsonl"
"""Two /run results captured from NeMo Gym's example_single_tool_call agent (ng_collect_rollouts); their
/verify response has no field beyond `reward`, so the tests add the ones a multi-reward server returns at the
same level (Gym's /run result is the /verify response: a subclass's fields sit beside `reward`)."""


def manager(tokenizer, env: ScriptedEnvironment, on_error: str = "record") -> RolloutManager:
    return RolloutManager(
        tokenizer=tokenizer, task_to_env={"formatter": env}, num_generations_per_prompt=2, max_seq_len=512,
        policy_generation=ScriptedGeneration(tokenizer, ["ab", "cd"]),
        generation_config=GenerationConfig(max_new_tokens=8, seed=0),
        fault_policy=FaultPolicy(on_error=on_error),
    )


def datum(tokenizer):
    return datum_from_messages(tokenizer, 0, [{"role": "user", "content": "go"}], "formatter")


async def test_native_components_are_summed_over_turns_and_written_to_the_line(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    env = ScriptedEnvironment(
        turns=2, reward=lambda s: float(s.turn), observation=Observation("user", "again"),
        reward_components=lambda s: {"correct": float(s.turn), "format": 0.5},
    )
    records, _ = await manager(tok, env).run_rollouts([datum(tok)], progress=False)
    for c in records[0].completions:
        assert c.stop_reason is StopReason.NATURAL and c.num_turns == 2
        assert c.reward_components == {"correct": 3.0, "format": 1.0}  # turn 1 + turn 2, 0.5 + 0.5
        line = CompletionLine.from_completion(records[0], 0, c, save_token_ids=False)
        assert line.to_json()["reward_components"] == {"correct": 3.0, "format": 1.0}
        assert CompletionLine.from_json(json.loads(json.dumps(line.to_json()))).reward_components == line.reward_components


async def test_an_environment_without_components_writes_lines_as_before(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    records, _ = await manager(tok, ScriptedEnvironment(reward=1.0)).run_rollouts([datum(tok)], progress=False)
    c = records[0].completions[0]
    assert c.reward_components == {}
    obj = CompletionLine.from_completion(records[0], 0, c, save_token_ids=False).to_json()
    assert "reward_components" not in obj  # a line without components has exactly the keys it always had
    assert CompletionLine.from_json(obj).reward_components == {}


@pytest.mark.parametrize("on_error", ["record", "raise"])
async def test_a_non_numeric_component_is_one_error_naming_the_environment_and_the_field(
    tiny_model_and_tokenizer, on_error
):
    _, tok = tiny_model_and_tokenizer
    env = ScriptedEnvironment(reward=1.0, reward_components={"correct": 1.0, "format": "yes"})
    with pytest.raises(RewardComponentError, match=r"environment 'formatter': .*field 'format' is not a finite number"):
        await manager(tok, env, on_error).run_rollouts([datum(tok)], progress=False)


def captured() -> list[dict]:
    """The captured results with their second model call's prompt ids made to extend the first call's prompt and
    generation (+ two ids for the tool output), as our policy server's are: the captured run's fake model server
    answered every call with the same prompt ids, which `result_to_completion` refuses (prefix property)."""
    results = [json.loads(line) for line in CAPTURED.read_text().splitlines() if line.strip()]
    for result in results:
        first, _, second = result["response"]["output"]
        second["prompt_token_ids"] = first["prompt_token_ids"] + first["generation_token_ids"] + [7, 8]
    return results


def test_gym_verify_fields_named_by_the_config_become_components(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    result = {**captured()[0], "reward": 1.5, "correct": 1.0, "format_ok": 0.5, "judge_note": "fine"}
    c = result_to_completion(result, "single_tool_call", tok, ("correct", "format_ok"))
    assert c.stop_reason is StopReason.NATURAL and c.reward == 1.5
    assert c.reward_components == {"correct": 1.0, "format_ok": 0.5}
    assert result_to_completion(result, "single_tool_call", tok).reward_components == {}  # none named: none read


def test_gym_nemo_rl_style_reward_components_mapping_is_read_too(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    result = {**captured()[1], "reward_components": {"correct": 1.0, "format_ok": 0.0}}
    c = result_to_completion(result, "single_tool_call", tok, ("correct", "format_ok"))
    assert c.reward_components == {"correct": 1.0, "format_ok": 0.0}


def test_gym_missing_or_non_numeric_fields_are_one_error_naming_the_server_and_the_fields(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    result = {**copy.deepcopy(captured()[0]), "format_ok": "yes"}
    with pytest.raises(RewardComponentError) as err:
        result_to_completion(result, "single_tool_call", tok, ("correct", "format_ok"))
    message = str(err.value)
    assert "environment 'example_single_tool_call_environment_server'" in message
    assert "field 'correct' is missing" in message and "field 'format_ok' is not a finite number" in message


def test_gym_config_takes_the_field_names():
    cfg = GymConfig.model_validate({"head_server_url": "http://127.0.0.1:9", "policy_port": 9,
                                    "reward_components": ["correct", "format_ok"]})
    assert cfg.reward_components == ("correct", "format_ok")
