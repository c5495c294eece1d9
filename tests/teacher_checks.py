"""Helpers shared by the distillation tests (a local teacher in the unit tests, one over HTTP in the functional
tests): a three-turn tool rollout with the tiny model's tokenizer, and the check that a record's teacher scores
are those of a separate forward pass of the teacher over the same ids.

Importable from any test module because pytest puts this folder (the one holding conftest.py) on sys.path.
"""

from __future__ import annotations

from tolerances import SAME_MODEL_LOGPROBS, approx

from nemo_rl_ext.data.datasets import datum_from_messages
from nemo_rl_ext.data.records import PromptGroupRecord, StopReason
from nemo_rl_ext.environments.tool_env import ToolCalculatorEnvironment
from nemo_rl_ext.experience.rollout_manager import RolloutManager
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.testing import ScriptedGeneration, forward_logprobs
from nemo_rl_ext.testing.reference import forward_top_logprobs

TOOL_SCRIPT = [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+5"}}\n</tool_call><|im_end|>',
    "So the answer is \\boxed{17}.<|im_end|>",
]
"""Three assistant turns with two calculator tool turns between them."""
TOOL_ROLES = ["user", "assistant", "tool", "assistant", "tool", "assistant"]
TIE = 1e-3
"""Two top-k logprobs closer than this may swap places between two kernels (rounding is ~1e-5 here): the ids
are compared only where the logprobs are further apart."""


def tool_manager(tok, scorer, counts: int = 2, **kwargs) -> RolloutManager:
    """A native RolloutManager over the scripted three-turn tool rollout, with `scorer` as its teachers."""
    return RolloutManager(
        tokenizer=tok, task_to_env={"calc": ToolCalculatorEnvironment()}, num_generations_per_prompt=counts,
        max_seq_len=1024, policy_generation=ScriptedGeneration(tok, TOOL_SCRIPT),
        generation_config=GenerationConfig(max_new_tokens=64, seed=0), teachers=scorer, **kwargs,
    )


def tool_datum(tok, idx: int = 0):
    """A calculator question for agent `calc`."""
    return datum_from_messages(tok, idx, [{"role": "user", "content": f"What is 3*4 + 5? ({idx})"}],
                               task_name="calc", extra_env_info={"ground_truth": "17"})


def assert_scores_match_forward(record: PromptGroupRecord, model, top_k: int) -> None:
    """Every completion is the three-turn tool rollout, and each assistant message's teacher logprobs (and
    top-k) equal a separate forward pass of `model` over the same ids (`SAME_MODEL_LOGPROBS`); no other
    message is scored."""
    for c in record.completions:
        assert [m.role for m in c.message_log] == TOOL_ROLES and c.stop_reason is StopReason.NATURAL
        context: list[int] = []
        for m in c.message_log:
            if m.role != "assistant":
                assert m.teacher_logprobs is None and m.teacher_topk_ids is None
            else:
                want = forward_logprobs(model, context, m.token_ids, 1.0).tolist()
                assert list(m.teacher_logprobs) == approx(want, SAME_MODEL_LOGPROBS)
                values, ids = forward_top_logprobs(model, context, m.token_ids, top_k)
                assert [list(v) for v in m.teacher_topk_logprobs] == [approx(v, SAME_MODEL_LOGPROBS) for v in values]
                for got, want_ids, vals in zip(m.teacher_topk_ids, ids, values, strict=True):
                    if min(a - b for a, b in zip(vals, vals[1:], strict=False)) > TIE:
                        assert list(got) == want_ids
            context += m.token_ids
