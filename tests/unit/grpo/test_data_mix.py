"""Several datasets in one GRPO run (`data.datasets`): weighted, seeded draws, each row routed to its dataset's
environment; the draws continue exactly after a resume; the held-out validation split is seeded."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from nemo_rl_ext.grpo.config import GRPOConfig


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def mixed_cfg(tmp_path: Path) -> GRPOConfig:
    arithmetic = write_jsonl(tmp_path / "a.jsonl", [{"question": f"A{i}: 1 + 1?", "answer": "2"} for i in range(10)])
    words = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"B{i}: say yes", "ground_truth": "yes"} for i in range(6)])
    return GRPOConfig.model_validate({
        "policy": {"model_name": "tiny"},
        "data": {"datasets": [
            {"path": str(arithmetic), "weight": 3.0, "env": {"name": "math"}},
            {"path": str(words), "weight": 1.0, "env": {"name": "string_match", "kwargs": {"mode": "exact"}}},
        ]},
        "grpo": {"seed": 7},
    })


def test_two_datasets_3_to_1_mix_and_each_row_goes_to_its_environment(mixed_cfg: GRPOConfig,
                                                                       tiny_model_and_tokenizer: Any) -> None:
    from nemo_rl_ext.experience.build import build_rollouts
    from nemo_rl_ext.grpo.data_rows import run_sources, training_stream
    from nemo_rl_ext.models.generation.interfaces import GenerationConfig
    from nemo_rl_ext.testing.scripted_generation import ScriptedGeneration

    _, tokenizer = tiny_model_and_tokenizer
    sources = run_sources(mixed_cfg, train=True, validates=False)
    stream = training_stream(mixed_cfg, tokenizer, sources, None)
    draws = stream.next(400)
    from_a = [d for d in draws if d.message_log[-1].content.startswith("A")]
    # a draw is from A with p = 3/4: 400 draws give 300 from A, binomial sd sqrt(400 * 3/4 * 1/4) = 8.7; 4 sd
    assert abs(len(from_a) - 300) <= 4 * math.sqrt(400 * 0.75 * 0.25), len(from_a)
    print(f"{len(from_a)} of 400 draws from the weight-3 dataset")
    assert all(d.task_name == "math" for d in from_a)
    assert all(d.task_name == "string_match" for d in draws if d not in from_a)
    assert len({d.idx for d in draws}) == 16  # every row drawn, prompt indices distinct across the datasets
    # the draws continue exactly where a checkpoint's position says
    again = training_stream(mixed_cfg, tokenizer, sources, None)
    again.load_state_dict(stream.state_dict())
    assert [d.idx for d in again.next(50)] == [d.idx for d in stream.next(50)]
    # routing: a reply of "yes" is right for string_match's rows (exact match) and wrong for math's
    generation = ScriptedGeneration(tokenizer, lambda request: "yes", eos=True)
    _, manager = build_rollouts(mixed_cfg.rollouts.model_copy(update={"num_generations_per_prompt": 1}), tokenizer,
                                generation, (), generation_config=GenerationConfig(max_new_tokens=8, seed=0),
                                more_envs=[e.env for e in mixed_cfg.data.datasets])
    assert set(manager.task_to_env) == {"math", "string_match"}

    async def roll_out() -> list[Any]:
        try:
            return (await manager.run_rollouts(draws[:12], progress=False))[0]
        finally:
            await manager.shutdown()

    records = asyncio.run(roll_out())
    rewards = {r.prompt_idx: r.completions[0].reward for r in records}
    assert rewards == {d.idx: (0.0 if d in from_a else 1.0) for d in draws[:12]}
    assert 0.0 in rewards.values() and 1.0 in rewards.values()


def test_a_table_among_several_datasets_is_tokenized_only_where_drawn(mixed_cfg: GRPOConfig, tmp_path: Path,
                                                                      tiny_model_and_tokenizer: Any) -> None:
    import pandas as pd

    from nemo_rl_ext.grpo.data_rows import run_sources, training_stream

    _, tokenizer = tiny_model_and_tokenizer
    pd.DataFrame([{"prompt": f"C{i}: say yes", "ground_truth": "yes"} for i in range(50)]).to_parquet(tmp_path / "c.parquet")
    data = mixed_cfg.data.model_copy(update={"datasets": (*mixed_cfg.data.datasets,
                                                         mixed_cfg.data.datasets[1].model_copy(update={"path": tmp_path / "c.parquet"}))})
    cfg = mixed_cfg.model_copy(update={"data": data})
    stream = training_stream(cfg, tokenizer, run_sources(cfg, train=True, validates=False), None)
    table = stream.streams[2].datums
    assert table.agent_pairs() == [(16 + i, "string_match") for i in range(50)]  # prompt indices after A's and B's
    drawn = [d for d in stream.next(40) if d.idx >= 16]
    assert drawn and len(table.datums._made) == len({d.idx for d in drawn}) < 50


def test_a_resume_refuses_changed_datasets_and_each_is_split_for_validation(mixed_cfg: GRPOConfig, tmp_path: Path,
                                                                            tiny_model_and_tokenizer: Any) -> None:
    from nemo_rl_ext.grpo.data_rows import run_sources, training_stream, validation_datums

    _, tokenizer = tiny_model_and_tokenizer
    state = training_stream(mixed_cfg, tokenizer, run_sources(mixed_cfg, train=True, validates=False), None).state_dict()
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"B{i}: say no", "ground_truth": "no"} for i in range(6)])
    changed = training_stream(mixed_cfg, tokenizer, run_sources(mixed_cfg, train=True, validates=False), None)
    with pytest.raises(ValueError, match="the datasets changed since the checkpoint was written"):
        changed.load_state_dict(state)
    held = mixed_cfg.model_copy(update={"data": mixed_cfg.data.model_copy(update={"split_validation_size": 2})})
    sources = run_sources(held, train=True, validates=True)
    assert [len(s.rows) for s in sources] == [8, 4] and [len(s.val_rows) for s in sources] == [2, 2]
    val = validation_datums(held, tokenizer, sources)
    assert [d.task_name for d in val] == ["math", "math", "string_match", "string_match"]
    assert len({d.idx for d in val}) == 4
    train_prompts = {r.get("question") or r.get("prompt") for s in sources for r in s.rows}
    assert not train_prompts & {d.message_log[-1].content for d in val}
