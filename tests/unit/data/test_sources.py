"""Datasets through Hugging Face `datasets` (`data.hf_source`, `data.sources`, `data.columns`): every format gives
the same datums, bad rows are named at once, a table's datums are made when drawn, the fingerprint follows the
rows. Local files only (the hub case is tests/functional/test_dataset_errors.py, offline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nemo_rl_ext.experience.config import RolloutsConfig

PROBLEMS = [{"question": f"What is {a} + {b}?", "answer": str(a + b), "source": f"p{a}"}
            for a, b in [(1, 2), (3, 4), (10, 5), (7, 7), (2, 9), (12, 30), (0, 6), (8, 1)]]
MATH = RolloutsConfig(env={"name": "math", "system_prompt": "Put the answer in \\boxed{}."})


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def the_same_problems(folder: Path) -> dict[str, Path]:
    """The 8 problems as JSONL, parquet, CSV, a save_to_disk folder, and a messages JSONL (the answer as a
    trailing assistant message) and messages parquet."""
    import datasets
    import pandas as pd

    frame = pd.DataFrame(PROBLEMS)
    frame.to_parquet(folder / "p.parquet")
    frame.to_csv(folder / "p.csv", index=False)
    datasets.Dataset.from_list(PROBLEMS).save_to_disk(str(folder / "saved"))
    chats = [{"messages": [{"role": "user", "content": p["question"]}, {"role": "assistant", "content": p["answer"]}],
              "source": p["source"]} for p in PROBLEMS]
    pd.DataFrame(chats).to_parquet(folder / "m.parquet")
    return {"jsonl": write_jsonl(folder / "p.jsonl", PROBLEMS), "parquet": folder / "p.parquet",
            "csv": folder / "p.csv", "save_to_disk": folder / "saved",
            "messages": write_jsonl(folder / "m.jsonl", chats), "messages_parquet": folder / "m.parquet"}


def datum_view(datum: Any) -> tuple[Any, ...]:
    return (datum.idx, tuple(tuple(m.token_ids) for m in datum.message_log), tuple(m.role for m in datum.message_log),
            datum.extra_env_info["ground_truth"], datum.extra_env_info["source"], datum.metadata["source"],
            datum.task_name, datum.agent)


def test_every_format_gives_the_same_datums(tmp_path: Path, tiny_model_and_tokenizer: Any) -> None:
    from nemo_rl_ext.experience.build import load_rollout_rows, make_datums

    _, tokenizer = tiny_model_and_tokenizer
    views = {}
    for kind, path in the_same_problems(tmp_path).items():
        datums = make_datums(MATH, tokenizer, load_rollout_rows(MATH, path))
        views[kind] = [datum_view(d) for d in datums]
    reference = views.pop("jsonl")
    assert len(reference) == 8 and reference[3][3] == "14" and reference[3][2] == ("system", "user")
    assert len({tuple(v[1]) for v in reference}) == 8  # eight different prompts
    for kind, view in views.items():
        assert view == reference, kind


def test_a_prompt_column_as_text_or_chat_and_tools_reach_the_template(tmp_path: Path, tiny_model_and_tokenizer: Any) -> None:
    from nemo_rl_ext.data.datasets import datum_from_messages
    from nemo_rl_ext.experience.build import load_rollout_rows, make_datums

    _, tokenizer = tiny_model_and_tokenizer
    tool = {"type": "function", "function": {"name": "add", "description": "Add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    rows = [{"prompt": "What is 1 + 2?", "ground_truth": "3"},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
             "answer": "4", "tools": [tool], "level": 3}]
    text, chat = make_datums(MATH, tokenizer, load_rollout_rows(MATH, write_jsonl(tmp_path / "r.jsonl", rows)))
    assert text.message_log[-1].content == "What is 1 + 2?" and text.extra_env_info["ground_truth"] == "3"
    expected = datum_from_messages(tokenizer, 1, rows[1]["prompt"], "math", tools=[tool])
    assert [m.token_ids for m in chat.message_log] == [m.token_ids for m in expected.message_log]
    assert chat.message_log[0].content == "Be brief."  # the row's own system message, not the environment's
    assert chat.extra_env_info == {"level": 3, "ground_truth": "4"}  # every other column reaches the environment


def test_bad_rows_are_named_at_once(tmp_path: Path) -> None:
    import pandas as pd

    from nemo_rl_ext.experience.build import load_rollout_rows

    pd.DataFrame([{"text": "1+1", "answer": "2"}] * 3).to_parquet(tmp_path / "no_prompt.parquet")
    with pytest.raises(ValueError) as err:
        load_rollout_rows(MATH, tmp_path / "no_prompt.parquet")
    assert "no_prompt.parquet: no prompt column: none of 'question', 'prompt', 'messages'" in str(err.value)
    assert "['text', 'answer']" in str(err.value) and "row 0" not in str(err.value)  # one message, not one per row
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1"}]},
            {"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "1"}]},
            {"messages": [{"role": "user", "content": "hi"}]},
            {"question": "", "answer": "1"},
            {"messages": [{"role": "user", "content": 5}], "answer": "1"}]
    with pytest.raises(ValueError) as err:
        load_rollout_rows(MATH, write_jsonl(tmp_path / "bad.jsonl", rows))
    message = str(err.value)
    assert "bad.jsonl: 4 bad row(s)" in message and "line 1" not in message
    assert "line 2: messages[0].role 'robot' is not one of system, user, assistant, tool" in message
    assert "line 3: missing key(s) ['answer']" in message
    assert "line 4: 'question' must be a non-empty string" in message
    assert "line 5: messages[0].content must be a string, got int" in message
    chats = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
             {"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    pd.DataFrame(chats).to_parquet(tmp_path / "bad_role.parquet")
    with pytest.raises(ValueError, match=r"bad_role.parquet: 1 bad row\(s\):\n  row 1: messages\[0\].role 'robot'"):
        load_rollout_rows(MATH, tmp_path / "bad_role.parquet")


def test_a_table_is_read_row_by_row_and_its_datums_made_when_drawn(tmp_path: Path, tiny_model_and_tokenizer: Any) -> None:
    from nemo_rl_ext.data.hf_source import RowTable
    from nemo_rl_ext.data.sources import LazyDatums
    from nemo_rl_ext.experience.build import load_rollout_rows, make_datums

    _, tokenizer = tiny_model_and_tokenizer
    rows = load_rollout_rows(MATH, the_same_problems(tmp_path)["parquet"])
    assert isinstance(rows, RowTable) and len(rows) == 8 and rows[-1]["question"] == PROBLEMS[7]["question"]
    datums = make_datums(MATH, tokenizer, rows)
    assert isinstance(datums, LazyDatums) and not datums._made
    assert datums[5].extra_env_info["ground_truth"] == "42" and set(datums._made) == {5}
    assert datums.agent_pairs() == [(i, "math") for i in range(8)] and set(datums._made) == {5}
    view = rows[2:4]
    assert isinstance(view, RowTable) and [r["answer"] for r in view] == ["15", "14"]


def test_the_fingerprint_follows_the_rows_and_a_resume_refuses_changed_ones(tmp_path: Path) -> None:
    import pandas as pd

    from nemo_rl_ext.data.records import DatumSpec
    from nemo_rl_ext.data.sources import load_rows, rows_fingerprint
    from nemo_rl_ext.grpo.prompt_stream import PromptStream

    def fingerprint(rows: list[dict[str, Any]], name: str) -> str:
        pd.DataFrame(rows).to_parquet(tmp_path / name)
        return rows_fingerprint(load_rows(tmp_path / name))

    changed = [dict(p) for p in PROBLEMS]
    changed[6]["answer"] = "7"
    same, again, other = fingerprint(PROBLEMS, "a.parquet"), fingerprint(PROBLEMS, "b.parquet"), fingerprint(changed, "c.parquet")
    assert same == again != other
    assert rows_fingerprint(PROBLEMS) != rows_fingerprint(changed)
    datums = [DatumSpec(i, message_log=(), task_name="math") for i in range(8)]
    state = PromptStream(datums, seed=0, fingerprint=same).state_dict()
    PromptStream(datums, seed=0, fingerprint=again).load_state_dict(state)
    with pytest.raises(ValueError, match="the dataset changed since the checkpoint was written"):
        PromptStream(datums, seed=0, fingerprint=other).load_state_dict(state)


def test_split_validation_is_seeded_and_disjoint(tmp_path: Path) -> None:
    from nemo_rl_ext.data.sources import load_rows, split_validation

    table = load_rows(the_same_problems(tmp_path)["parquet"])
    train, val = split_validation(table, 0.25, seed=3)
    train_again, val_again = split_validation(load_rows(tmp_path / "p.parquet"), 2, seed=3)
    assert [r["source"] for r in val] == [r["source"] for r in val_again] and len(val) == 2 and len(train) == 6
    assert {r["source"] for r in train} | {r["source"] for r in val} == {p["source"] for p in PROBLEMS}
    _, list_val = split_validation(PROBLEMS, 2, seed=3)  # JSONL rows: the same draw
    assert [r["source"] for r in list_val] == [r["source"] for r in val]
    with pytest.raises(ValueError, match="leaves 0 validation"):
        split_validation(PROBLEMS, 0.01, seed=3)


def test_question_answer_jsonl_rows_come_back_as_they_were(tmp_path: Path) -> None:
    from nemo_rl_ext.experience.build import load_rollout_rows

    rows = [*PROBLEMS, {"question": 17, "answer": 17, "agent_name": "alpha", "extra": {"a": [1]}}]
    assert load_rollout_rows(MATH, write_jsonl(tmp_path / "qa.jsonl", rows)) == rows
