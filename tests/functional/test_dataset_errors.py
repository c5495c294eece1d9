"""Bad datasets in the CLIs (issue 37): a parquet file without a prompt column, a `messages` row with a bad
role, a hub id on an offline machine: one message each naming the key and what is wrong, exit 2, no traceback.
The hub case runs as a real process with the `datasets` / hub offline switches set (nothing is downloaded)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from script_main import script_main
from test_cli_errors import assert_one_message

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def main(capsys: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    return functools.partial(script_main, capsys)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import pandas as pd

    folder = tmp_path_factory.mktemp("datasets")
    pd.DataFrame([{"text": "1+1", "answer": "2"}, {"text": "2+2", "answer": "4"}]).to_parquet(folder / "no_prompt.parquet")
    rows = [{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]},
            {"messages": [{"role": "robot", "content": "2+2"}, {"role": "assistant", "content": "4"}]}]
    (folder / "bad_role.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    eval_cfg = folder / "eval.yaml"
    eval_cfg.write_text(yaml.safe_dump({
        "eval": {"dataset_path": str(folder / "bad_role.jsonl"), "save_path": str(folder / "eval_out")},
        "rollouts": {"mode": "native", "max_rollout_turns": 1, "num_generations_per_prompt": 2},
        "policy": {"model_name": "tiny", "generation": {"temperature": 1.0, "max_new_tokens": 4}},
    }))
    grpo_cfg = folder / "grpo.yaml"
    grpo_cfg.write_text(yaml.safe_dump({
        "policy": {"model_name": "tiny", "max_model_len": 128, "generation": {"max_new_tokens": 4}},
        "rollouts": {"num_generations_per_prompt": 2, "max_seq_len": 64},
        "data": {"train_path": str(folder / "no_prompt.parquet")},
        "grpo": {"num_prompts_per_step": 2, "max_num_steps": 1},
        "loss": {"kl_coef": 0.0},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
        "output_dir": str(folder / "grpo_out"),
    }))
    return {"folder": folder, "eval": eval_cfg, "grpo": grpo_cfg}


@pytest.mark.timeout(120)
def test_a_parquet_file_without_a_prompt_column_is_one_error(main, files: dict[str, Path]) -> None:
    path = files["folder"] / "no_prompt.parquet"
    proc = main("run_grpo.py", "--config", files["grpo"])
    assert_one_message(proc, f"data.train_path: {path}: no prompt column: none of 'question', 'prompt', 'messages'",
                       "its columns: ['text', 'answer']")
    assert not (files["folder"] / "grpo_out" / "checkpoints").exists()


@pytest.mark.timeout(120)
def test_a_messages_row_with_a_bad_role_is_one_error(main, files: dict[str, Path]) -> None:
    path = files["folder"] / "bad_role.jsonl"
    proc = main("run_eval.py", "--config", files["eval"])
    assert_one_message(proc, f"eval.dataset_path: {path}: 1 bad row(s)",
                       "line 2: messages[0].role 'robot' is not one of system, user, assistant, tool")


@pytest.mark.timeout(180)
def test_a_hub_id_on_an_offline_machine_is_one_error_naming_the_local_alternatives(files: dict[str, Path]) -> None:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(files["folder"] / "hf_cache"), "HF_HOME": str(files["folder"] / "hf_home")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "run_eval.py"), "--config", str(files["eval"]),
         "eval.dataset_path=nemo-rl-ext-tests/no-such-dataset", "eval.dataset_subset=main", "eval.dataset_split=test"],
        cwd=REPO, capture_output=True, text=True, timeout=170, env=env,
    )
    assert_one_message(proc, "eval.dataset_path: hub dataset nemo-rl-ext-tests/no-such-dataset (subset 'main') "
                       "split 'test' could not be fetched", "use a local copy instead: .jsonl, .json, .parquet",
                       "save_to_disk")


@pytest.mark.timeout(240)
def test_a_grpo_resume_refuses_a_dataset_whose_rows_changed(main, files: dict[str, Path], tiny_model_dir: Path,
                                                            tmp_path: Path) -> None:
    import pandas as pd

    from nemo_rl_ext.config import load_config
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.loop import run_grpo

    data = tmp_path / "rows.parquet"
    rows = [{"prompt": "1+1", "answer": "2"}, {"prompt": "2+2", "answer": "4"}]
    pd.DataFrame(rows).to_parquet(data)
    run = [f"output_dir={tmp_path / 'out'}", f"policy.model_name={tiny_model_dir}", "grpo.save_period=1",
           f"data.train_path={data}", "rollouts.env.name=string_match"]
    run_grpo(load_config(files["grpo"], run, GRPOConfig))
    rows[1]["answer"] = "5"  # the same number of rows, one answer changed
    pd.DataFrame(rows).to_parquet(data)
    proc = main("run_grpo.py", "--config", files["grpo"], *run, "resume=true", "grpo.max_num_steps=2")
    assert_one_message(proc, "cannot resume", "the dataset changed since the checkpoint was written")
