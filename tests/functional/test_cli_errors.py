"""Every user error of the CLIs is one message naming the file, key or line: no traceback, exit code 2.

The scripts run as subprocesses. Every error here is found before a model loads, so each run takes about
the time of its imports; the GRPO resume case first trains one step of a tiny model in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nemo_rl_ext.algorithms.checkpoint import checkpoint_dir
from nemo_rl_ext.config import dump_config, load_config
from nemo_rl_ext.evals.config import EvalConfig

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"question": "1+1", "answer": "2", "agent_name": "alpha"},
    {"question": "2+2", "answer": "4", "agent_name": "beta"},
]


def cli(script: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def assert_one_message(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2, stderr is one `error:` message holding every needle, and no traceback anywhere."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("error:") == 1, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cli")
    data = folder / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    eval_cfg = folder / "eval.yaml"
    eval_cfg.write_text(yaml.safe_dump({
        "eval": {"dataset_path": str(data), "save_path": str(folder / "eval_out"), "num_tests_per_prompt": 2},
        "policy": {"model_name": "tiny", "generation": {"temperature": 1.0, "max_new_tokens": 4}},
    }))
    grpo_cfg = folder / "grpo.yaml"
    grpo_cfg.write_text(yaml.safe_dump({
        "policy": {"model_name": "tiny", "max_model_len": 128, "generation": {"max_new_tokens": 4}},
        "env": {"name": "string_match"},
        "data": {"train_path": str(data)},
        "grpo": {
            "num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_num_steps": 1, "max_seq_len": 64,
        },
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},  # as before
        "logger": {"progress": False, "tensorboard": False, "print_steps": False},
        "output_dir": str(folder / "grpo_out"),
    }))
    bad_yaml = folder / "broken.yaml"
    bad_yaml.write_text("eval:\n  dataset_path: x.jsonl\n  ks: [1, 2\n  save_path: out\n")
    return {"data": data, "eval": eval_cfg, "grpo": grpo_cfg, "bad_yaml": bad_yaml, "folder": folder}


SCRIPTS = {"eval": "run_eval.py", "grpo": "run_grpo.py"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["eval", "grpo"])
def test_yaml_syntax_error_names_the_file_and_line(files: dict[str, Path], which: str) -> None:
    proc = cli(SCRIPTS[which], "--config", files["bad_yaml"])
    assert_one_message(proc, f"{files['bad_yaml']}: not valid YAML", "line 3, column 7")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["eval", "grpo"])
def test_missing_model_folder_is_named(files: dict[str, Path], which: str) -> None:
    missing = files["folder"] / "no_such_model"
    proc = cli(SCRIPTS[which], "--config", files[which], f"policy.model_name={missing}")
    assert_one_message(proc, f"policy.model_name={str(missing)!r} is neither")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("which", "key"), [("eval", "eval.dataset_path"), ("grpo", "data.train_path")])
def test_missing_dataset_file_is_named(files: dict[str, Path], which: str, key: str) -> None:
    missing = files["folder"] / "no_such_rows.jsonl"
    proc = cli(SCRIPTS[which], "--config", files[which], f"{key}={missing}")
    assert_one_message(proc, f"{key}: file not found: {missing}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("which", "key"), [("eval", "eval.num_tests_per_prompt"), ("grpo", "grpo.num_generations_per_prompt")]
)
def test_agent_without_count_and_no_default_is_named(files: dict[str, Path], which: str, key: str) -> None:
    proc = cli(SCRIPTS[which], "--config", files[which], f"{key}={{alpha: 2}}")
    assert_one_message(proc, f"{key}: rows of {files['data']}", "no '_default'", "agent 'beta': rows [1]")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("which", "key"), [("eval", "eval.environment"), ("grpo", "env.name")])
def test_unknown_environment_is_named(files: dict[str, Path], which: str, key: str) -> None:
    proc = cli(SCRIPTS[which], "--config", files[which], f"{key}=no_such_env")
    assert_one_message(proc, key, "unknown environment 'no_such_env'")


@pytest.mark.timeout(60)
def test_eval_resume_with_a_changed_config_lists_the_keys(files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "eval_out"
    out.mkdir()
    earlier = load_config(files["eval"], [f"eval.save_path={out}"], EvalConfig)
    (out / "config.yaml").write_text(dump_config(earlier))
    (out / "completions.jsonl").write_text(json.dumps({"prompt_idx": 0, "sample_idx": 0, "reward": 1.0, "agent": "math", "stop_reason": "natural",
                    "truncated": False, "num_turns": 1}) + "\n")
    changed = "policy.generation.temperature=0.5"
    proc = cli("run_eval.py", "--config", files["eval"], f"eval.save_path={out}", changed)
    assert_one_message(
        proc, f"{out} holds completions of a different config", "policy.generation.temperature: 1.0 -> 0.5"
    )


@pytest.mark.timeout(120)
def test_grpo_resume_with_a_changed_config_lists_the_keys(files: dict[str, Path], tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    from nemo_rl_ext.algorithms.grpo import run_grpo
    from nemo_rl_ext.algorithms.grpo_config import GRPOConfig

    run = [f"output_dir={tmp_path}", f"policy.model_name={tiny_model_dir}", "grpo.save_period=1"]
    run_grpo(load_config(files["grpo"], run, GRPOConfig))
    proc = cli("run_grpo.py", "--config", files["grpo"], *run, "resume=true", "grpo.max_num_steps=2",
               "optimizer.lr=0.5", "loss.clip_high=0.3")
    assert_one_message(
        proc, f"{checkpoint_dir(tmp_path / 'checkpoints', 1)} was saved by a run with a different config",
        "loss.clip_high: 0.2 -> 0.3", "optimizer.lr: 1e-06 -> 0.5",
    )
    assert "max_num_steps:" not in proc.stderr  # a key that may change is not listed as a change


@pytest.mark.timeout(60)
def test_eval_overrides_are_accepted_after_flags(files: dict[str, Path]) -> None:
    missing = files["folder"] / "after_the_flag.jsonl"
    proc = cli("run_eval.py", "--config", files["eval"], "eval.num_prompts=1", "--no-progress",
               f"eval.dataset_path={missing}")
    # the override after --no-progress was parsed and applied: the run stops on the file it names
    assert_one_message(proc, f"eval.dataset_path: file not found: {missing}")


@pytest.mark.timeout(60)
def test_grpo_overrides_are_accepted_around_the_config_flag(files: dict[str, Path]) -> None:
    missing = files["folder"] / "around_the_flag.jsonl"
    proc = cli("run_grpo.py", "grpo.seed=3", "--config", files["grpo"], f"data.train_path={missing}")
    assert_one_message(proc, f"data.train_path: file not found: {missing}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["eval", "grpo"])
def test_an_override_without_equals_is_a_clean_error(files: dict[str, Path], which: str) -> None:
    flags = ["--no-progress"] if which == "eval" else []
    proc = cli(SCRIPTS[which], "--config", files[which], *flags, "grpo.seed")
    assert_one_message(proc, "overrides must look like key.sub=value; got ['grpo.seed']")


@pytest.mark.timeout(60)
def test_rollouts_example_names_a_missing_model(files: dict[str, Path]) -> None:
    missing = files["folder"] / "no_such_model"
    proc = cli("run_rollouts.py", "--model", missing)
    assert_one_message(proc, f"policy.model_name={str(missing)!r} is neither")
