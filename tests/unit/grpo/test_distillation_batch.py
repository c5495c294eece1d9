"""A GRPO step's training batch carries the teacher's scores of its records (sync and async GRPO both build it with
`build_training_batch`), aligned with the trained tokens, with the group advantages beside them."""

from __future__ import annotations

import pytest

from nemo_rl_ext.data.records import Completion, Message, PromptGroupRecord, StopReason
from nemo_rl_ext.grpo.batch import build_training_batch


def test_the_batch_carries_each_completions_teacher_scores():
    prompt = (Message("user", "q", (1, 2, 3)),)
    completions = tuple(
        Completion(
            message_log=(*prompt, Message("assistant", "a", (4, 5), (-0.1, -0.2), teacher_logprobs=(-0.5 - i, -0.7))),
            reward=float(i), truncated=False, stop_reason=StopReason.NATURAL, num_turns=1, agent_name="math",
        )
        for i in range(2)
    )
    batch = build_training_batch([PromptGroupRecord(0, prompt, {}, {}, completions, {}, agent_name="math")])
    assert [x.teacher_logprobs.tolist() for x in batch.items] == [
        pytest.approx([0, 0, 0, -0.5, -0.7]), pytest.approx([0, 0, 0, -1.5, -0.7])]
    assert all(x.teacher_mask.tolist() == x.loss_mask.tolist() == [0, 0, 0, 1, 1] for x in batch.items)
    assert [x.agent_name for x in batch.items] == ["math", "math"]
    assert batch.advantages.tolist() == pytest.approx([-1.0, 1.0], rel=1e-5)
