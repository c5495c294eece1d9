"""A local teacher scores a record's assistant tokens: the same numbers as a separate forward pass of the
teacher over the same ids, for a multi-turn record with tool turns in between."""

from __future__ import annotations

import pytest
import torch
from tolerances import SAME_MODEL_LOGPROBS, approx

from nemo_rl_ext.data.datasets import datum_from_messages
from nemo_rl_ext.data.records import StopReason
from nemo_rl_ext.distillation.local_teacher import LocalTeacher, _batches
from nemo_rl_ext.distillation.scoring import TeacherScorer
from nemo_rl_ext.environments.tool_env import ToolCalculatorEnvironment
from nemo_rl_ext.experience.rollout_manager import RolloutManager, batch_metrics
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.testing import ScriptedGeneration

TOOL_SCRIPT = [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call><|im_end|>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+5"}}\n</tool_call><|im_end|>',
    "So the answer is \\boxed{17}.<|im_end|>",
]


@pytest.fixture(scope="module")
def teacher(tiny_model_dir):
    """The tiny model loaded again as a teacher (its own copy: the shared fixture model is never frozen here)."""
    t = LocalTeacher.load(str(tiny_model_dir), max_batch_tokens=256)  # small: the group runs in several batches
    yield t
    t.close()


def tool_manager(tok, scorer, counts=2) -> RolloutManager:
    return RolloutManager(
        tokenizer=tok, task_to_env={"calc": ToolCalculatorEnvironment()}, num_generations_per_prompt=counts,
        max_seq_len=1024, policy_generation=ScriptedGeneration(tok, TOOL_SCRIPT),
        generation_config=GenerationConfig(max_new_tokens=64, seed=0), teachers=scorer,
    )


def tool_datum(tok, idx=0):
    return datum_from_messages(tok, idx, [{"role": "user", "content": "What is 3*4 + 5?"}], task_name="calc",
                               extra_env_info={"ground_truth": "17"})


def reference(model, context, output, k):
    """One plain forward of the teacher over context + output: the logprob of each output id, and the top-k."""
    ids = torch.tensor([[*context, *output]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(list(output))[:, None])[:, 0]
    values, indices = logprobs.topk(k, dim=-1)
    return chosen.tolist(), values.tolist(), indices.tolist()


async def test_teacher_scores_every_assistant_turn_as_a_separate_forward(tiny_model_and_tokenizer, teacher):
    model, tok = tiny_model_and_tokenizer
    record = await tool_manager(tok, TeacherScorer({"calc": teacher}, top_k=3)).run_rollout(tool_datum(tok))
    assert len(record.completions) == 2
    for c in record.completions:
        assert [m.role for m in c.message_log] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
        assert c.stop_reason is StopReason.NATURAL
        context: list[int] = []
        for m in c.message_log:
            if m.role != "assistant":
                assert m.teacher_logprobs is None and m.teacher_topk_ids is None
            else:
                chosen, top_values, top_ids = reference(model, context, m.token_ids, 3)
                assert list(m.teacher_logprobs) == approx(chosen, SAME_MODEL_LOGPROBS)
                assert [list(v) for v in m.teacher_topk_logprobs] == [approx(v, SAME_MODEL_LOGPROBS) for v in top_values]
                # the top-3 ids agree wherever their logprobs are apart by more than the rounding (a near-tie
                # may swap between two kernels)
                for got, want, values in zip(m.teacher_topk_ids, top_ids, top_values, strict=True):
                    if min(abs(a - b) for a, b in zip(values, values[1:], strict=False)) > 1e-3:
                        assert list(got) == want
            context += m.token_ids
    terms = [g - t for c in record.completions for m in c.message_log if m.role == "assistant"
             for g, t in zip(m.generation_logprobs, m.teacher_logprobs, strict=True)]
    metrics = record.rollout_metrics
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(terms) / len(terms), rel=1e-12)
    assert metrics["agent/calc/distill/reverse_kl"] == metrics["distill/reverse_kl"]
    assert metrics["distill/teacher_tokens"] == sum(len(c.token_ids) for c in record.completions)
    assert metrics["distill/teacher_time_s"] > 0
    batch = batch_metrics([record], 1.0)
    assert batch["distill/reverse_kl"] == pytest.approx(metrics["distill/reverse_kl"], rel=1e-12)
    assert batch["distill/teacher_tokens_per_s"] > 0


async def test_an_agent_without_a_teacher_is_not_scored(tiny_model_and_tokenizer, teacher):
    _, tok = tiny_model_and_tokenizer
    record = await tool_manager(tok, TeacherScorer({"other": teacher})).run_rollout(tool_datum(tok))
    assert all(m.teacher_logprobs is None for c in record.completions for m in c.message_log)
    assert "distill/reverse_kl" not in record.rollout_metrics


def test_batches_stay_within_the_padded_token_budget():
    seqs = [[1] * n for n in (3, 5, 2, 9, 1)]
    batches = _batches(seqs, 10)
    assert [s for b in batches for s in b] == seqs  # order kept, nothing lost
    assert all(len(b) * max(map(len, b)) <= 10 or len(b) == 1 for b in batches)
    assert [[len(s) for s in b] for b in batches] == [[3, 5], [2], [9], [1]]
