"""The per-step table of sampled rollouts that the trackers log."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nemo_rl_ext.data.records import PromptGroupRecord

SAMPLE_COLUMNS = ("prompt", "answer", "reward", "agent")
"""The columns of the per-step table of sampled rollouts."""


def sample_rows(records: Sequence[PromptGroupRecord], count: int) -> list[list[Any]]:
    """The first completion of each of the first `count` groups: [prompt, answer, reward, agent]."""
    rows = []
    for record in records[:count]:
        if not record.completions:
            continue
        completion = record.completions[0]
        prompt = record.prompt[-1].content if record.prompt else ""
        answer = "".join(m.content for m in completion.message_log[len(record.prompt):])
        rows.append([prompt, answer, float(completion.reward), completion.agent_name or record.agent_name])
    return rows
