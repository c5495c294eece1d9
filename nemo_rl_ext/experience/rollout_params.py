"""The constructor parameters both rollout implementations share, checked the same way by each."""

from __future__ import annotations

from collections.abc import Mapping

from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.data.generation_counts import GenerationCounts

TokenizerType = PreTrainedTokenizerBase
"""What rollouts tokenize with (NeMo-RL's `rollout_manager.TokenizerType`)."""


def check_common_parameters(
    num_generations_per_prompt: int | Mapping[str, int] | GenerationCounts, max_seq_len: int
) -> tuple[GenerationCounts | None, list[str]]:
    """The parsed per-agent counts (None if they are bad) and every problem with the two parameters."""
    problems = []
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
        problems.append(f"max_seq_len must be an int >= 2, got {max_seq_len!r}")
    counts = None
    if isinstance(num_generations_per_prompt, GenerationCounts):
        counts = num_generations_per_prompt
    else:
        try:
            counts = GenerationCounts.parse(num_generations_per_prompt)
        except ValueError as exc:
            problems.append(str(exc))
    return counts, problems
