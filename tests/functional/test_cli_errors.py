"""Every user error of the CLIs is one message naming the file, key or line: no traceback, exit code 2.

Every error here is found before a model loads. A subprocess of a script spends seconds importing torch,
transformers and peft before its `main` runs, so each script runs as a real process in one test (`cli`: the YAML
syntax error of `run_eval.py` and `run_grpo.py`; `run_rollouts.py`, which has no `main(argv)`) and the other cases
call the script's `main` in-process (the `main` fixture, `script_main`: its exit code, stdout and stderr, log
records and warnings printed as a fresh process prints them). The GRPO resume cases first train a tiny model
in-process.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from script_main import script_main

from nemo_rl_ext.config import dump_config, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.training.checkpoint import checkpoint_dir

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


@pytest.fixture
def main(capsys: pytest.CaptureFixture[str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`main(SCRIPT, *args)`: the script's `main` in this process, shaped as `cli`'s result (`script_main`)."""
    return functools.partial(script_main, capsys)


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
        "eval": {"dataset_path": str(data), "save_path": str(folder / "eval_out")},
        "rollouts": {"mode": "native", "max_rollout_turns": 1, "num_generations_per_prompt": 2},
        "policy": {"model_name": "tiny", "generation": {"temperature": 1.0, "max_new_tokens": 4}},
    }))
    grpo_cfg = folder / "grpo.yaml"
    grpo_cfg.write_text(yaml.safe_dump({
        "policy": {"model_name": "tiny", "max_model_len": 128, "generation": {"max_new_tokens": 4}},
        "rollouts": {"num_generations_per_prompt": 2, "max_seq_len": 64, "env": {"name": "string_match"}},
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 2, "max_num_steps": 1},
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},  # as before
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
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
def test_missing_model_folder_is_named(main, files: dict[str, Path], which: str) -> None:
    missing = files["folder"] / "no_such_model"
    proc = main(SCRIPTS[which], "--config", files[which], f"policy.model_name={missing}")
    assert_one_message(proc, f"policy.model_name={str(missing)!r} is neither")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("which", "key"), [("eval", "eval.dataset_path"), ("grpo", "data.train_path")])
def test_missing_dataset_file_is_named(main, files: dict[str, Path], which: str, key: str) -> None:
    missing = files["folder"] / "no_such_rows.jsonl"
    proc = main(SCRIPTS[which], "--config", files[which], f"{key}={missing}")
    assert_one_message(proc, f"{key}: file not found: {missing}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("which", "key"),
    [("eval", "rollouts.num_generations_per_prompt"), ("grpo", "rollouts.num_generations_per_prompt")],
)
def test_agent_without_count_and_no_default_is_named(main, files: dict[str, Path], which: str, key: str) -> None:
    proc = main(SCRIPTS[which], "--config", files[which], f"{key}={{alpha: 2}}")
    assert_one_message(proc, f"{key}: rows of {files['data']}", "no '_default'", "agent 'beta': rows [1]")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("which", "key"), [("eval", "rollouts.env.name"), ("grpo", "rollouts.env.name")])
def test_unknown_environment_is_named(main, files: dict[str, Path], which: str, key: str) -> None:
    proc = main(SCRIPTS[which], "--config", files[which], f"{key}=no_such_env")
    assert_one_message(proc, key, "unknown environment 'no_such_env'")


@pytest.mark.timeout(60)
def test_eval_resume_with_a_changed_config_lists_the_keys(main, files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "eval_out"
    out.mkdir()
    earlier = load_config(files["eval"], [f"eval.save_path={out}"], EvalConfig)
    (out / "config.yaml").write_text(dump_config(earlier))
    (out / "completions.jsonl").write_text(json.dumps({"prompt_idx": 0, "sample_idx": 0, "reward": 1.0, "agent": "math", "stop_reason": "natural",
                    "truncated": False, "num_turns": 1}) + "\n")
    changed = "policy.generation.temperature=0.5"
    proc = main("run_eval.py", "--config", files["eval"], f"eval.save_path={out}", changed)
    assert_one_message(
        proc, f"{out} holds completions of a different config", "policy.generation.temperature: 1.0 -> 0.5"
    )


@pytest.mark.timeout(120)
def test_grpo_resume_with_a_changed_config_lists_the_keys(main, files: dict[str, Path], tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.loop import run_grpo

    run = [f"output_dir={tmp_path}", f"policy.model_name={tiny_model_dir}", "grpo.save_period=1"]
    run_grpo(load_config(files["grpo"], run, GRPOConfig))
    proc = main("run_grpo.py", "--config", files["grpo"], *run, "resume=true", "grpo.max_num_steps=2",
               "optimizer.lr=0.5", "loss.clip_high=0.3")
    assert_one_message(
        proc, f"{checkpoint_dir(tmp_path / 'checkpoints', 1)} was saved by a run with a different config",
        "loss.clip_high: 0.2 -> 0.3", "optimizer.lr: 1e-06 -> 0.5",
    )
    assert "max_num_steps:" not in proc.stderr  # a key that may change is not listed as a change


@pytest.mark.timeout(60)
def test_eval_overrides_are_accepted_after_flags(main, files: dict[str, Path]) -> None:
    missing = files["folder"] / "after_the_flag.jsonl"
    proc = main("run_eval.py", "--config", files["eval"], "eval.num_prompts=1", "--no-progress",
               f"eval.dataset_path={missing}")
    # the override after --no-progress was parsed and applied: the run stops on the file it names
    assert_one_message(proc, f"eval.dataset_path: file not found: {missing}")


@pytest.mark.timeout(60)
def test_grpo_overrides_are_accepted_around_the_config_flag(main, files: dict[str, Path]) -> None:
    missing = files["folder"] / "around_the_flag.jsonl"
    proc = main("run_grpo.py", "grpo.seed=3", "--config", files["grpo"], f"data.train_path={missing}")
    assert_one_message(proc, f"data.train_path: file not found: {missing}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["eval", "grpo"])
def test_an_override_without_equals_is_a_clean_error(main, files: dict[str, Path], which: str) -> None:
    flags = ["--no-progress"] if which == "eval" else []
    proc = main(SCRIPTS[which], "--config", files[which], *flags, "grpo.seed")
    assert_one_message(proc, "overrides must look like key.sub=value; got ['grpo.seed']")


@pytest.mark.timeout(60)
def test_rollouts_example_names_a_missing_model(files: dict[str, Path]) -> None:
    missing = files["folder"] / "no_such_model"
    proc = cli("run_rollouts.py", "--model", missing)
    assert_one_message(proc, f"policy.model_name={str(missing)!r} is neither")


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> contents): what a refused run must leave as it was."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("refusal", ["changed config", "changed rows"])
def test_a_refused_eval_resume_leaves_the_folder_as_it_was(main, files: dict[str, Path], tmp_path: Path,
                                                           refusal: str) -> None:
    from nemo_rl_ext.evals.store import check_dataset, row_digests

    out = tmp_path / "eval_out"
    out.mkdir()
    earlier = load_config(files["eval"], [f"eval.save_path={out}"], EvalConfig)
    (out / "config.yaml").write_text(dump_config(earlier))
    line = {"prompt_idx": 0, "sample_idx": 0, "reward": 1.0, "agent": "math", "stop_reason": "natural",
            "truncated": False, "num_turns": 1}
    # a whole line, then the torn last line a killed run leaves: a resume that goes ahead cuts it
    (out / "completions.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(line)[:25])
    rows = [{"question": "1+1", "answer": "3"}, ROWS[1]] if refusal == "changed rows" else ROWS
    check_dataset(out / "dataset_fingerprint.json", str(files["data"]), row_digests(rows), resuming=False)
    before = folder_bytes(out)
    changed = ["policy.generation.temperature=0.5"] if refusal == "changed config" else []
    proc = main("run_eval.py", "--config", files["eval"], f"eval.save_path={out}", *changed)
    needle = ("policy.generation.temperature: 1.0 -> 0.5" if refusal == "changed config"
              else f"{files['data']} changed since the completions in {out} were written")
    assert_one_message(proc, needle)
    assert folder_bytes(out) == before  # the torn line is still there: nothing was repaired, nothing recorded


@pytest.mark.timeout(180)
def test_a_copied_eval_folder_resumes(main, files: dict[str, Path], tiny_model_dir: Path, generation, tmp_path: Path) -> None:
    import shutil

    from nemo_rl_ext.evals.driver import run_eval

    common = [f"policy.model_name={tiny_model_dir}", "rollouts.num_generations_per_prompt=1"]
    first = tmp_path / "first"
    cfg = load_config(files["eval"], [*common, f"eval.save_path={first}"], EvalConfig)
    result = run_eval(cfg, generation=generation, progress=False, stop_after_groups=1)  # one of two prompts
    assert not result.complete and result.completions_written == 1
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    proc = main("run_eval.py", "--config", files["eval"], *common, f"eval.save_path={copy}", "--no-progress")
    # eval.save_path only says where the folder is: the copy resumes (the other prompt), not refused
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume: 1 completion(s) already in" in proc.stdout, proc.stdout
    lines = [json.loads(x) for x in (copy / "completions.jsonl").read_text().splitlines()]
    assert sorted((x["prompt_idx"], x["sample_idx"]) for x in lines) == [(0, 0), (1, 0)]
    assert (copy / "completions.jsonl").read_bytes().startswith((first / "completions.jsonl").read_bytes())
    assert yaml.safe_load((copy / "config.yaml").read_text())["eval"]["save_path"] == str(copy)


@pytest.mark.timeout(300)
def test_grpo_resume_never_overwrites_step_folders_it_cannot_resume(main, files: dict[str, Path], tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    import shutil

    from nemo_rl_ext.config import ConfigError
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.loop import GRPO, run_grpo
    from nemo_rl_ext.grpo.metrics_logger import read_metrics
    from nemo_rl_ext.training.checkpoint import MARKER_FILE, list_checkpoints

    def config(out: Path, *more: str) -> list[str]:
        return [f"output_dir={out}", f"policy.model_name={tiny_model_dir}", "grpo.save_period=1",
                "keep_last_checkpoints=null", *more]

    run = tmp_path / "run"
    run_grpo(load_config(files["grpo"], config(run, "grpo.max_num_steps=2"), GRPOConfig))
    torn, mixed = tmp_path / "torn", tmp_path / "mixed"
    shutil.copytree(run, torn)
    shutil.copytree(run, mixed)
    for step in (1, 2):  # weights intact, but no save finished: nothing to resume from
        (checkpoint_dir(torn / "checkpoints", step) / MARKER_FILE).unlink()
    before = folder_bytes(torn)

    proc = main("run_grpo.py", "--config", files["grpo"], *config(torn, "resume=true", "grpo.max_num_steps=3"))
    assert_one_message(
        proc, f"resume=true, but {torn} holds no complete checkpoint", "2 step folder(s)",
        "step_00000001, step_00000002", f"no {MARKER_FILE}", "2 step record(s)", "resume=restart",
    )
    assert folder_bytes(torn) == before  # nothing overwritten: weights, metrics.jsonl, config.yaml
    with pytest.raises(ConfigError, match="resume=restart"):  # a fresh run in that folder is refused too
        GRPO(load_config(files["grpo"], config(torn), GRPOConfig))
    assert folder_bytes(torn) == before

    # said explicitly: start over at step 0, the earlier run's step folders and metrics gone
    history = run_grpo(load_config(files["grpo"], config(torn, "resume=restart", "grpo.max_num_steps=1"), GRPOConfig))
    assert [h["step"] for h in history] == [1]
    assert [m["step"] for m in read_metrics(torn / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in (torn / "checkpoints").iterdir()) == ["step_00000001"]
    assert list_checkpoints(torn / "checkpoints") == [checkpoint_dir(torn / "checkpoints", 1)]

    # step metrics but no checkpoint at all (e.g. save_period 0): refused as well, naming them
    metrics_only = tmp_path / "metrics_only"
    metrics_only.mkdir()
    shutil.copy(run / "metrics.jsonl", metrics_only / "metrics.jsonl")
    with pytest.raises(ConfigError, match=r"holds no complete checkpoint to continue from, only 2 step record\(s\)"):
        GRPO(load_config(files["grpo"], config(metrics_only, "resume=true"), GRPOConfig))
    assert (metrics_only / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()

    # some complete, some not: today's fallback, from the newest complete checkpoint
    (checkpoint_dir(mixed / "checkpoints", 2) / MARKER_FILE).unlink()
    history = run_grpo(load_config(files["grpo"], config(mixed, "resume=true", "grpo.max_num_steps=2"), GRPOConfig))
    assert [h["step"] for h in history] == [2]
    assert [m["step"] for m in read_metrics(mixed / "metrics.jsonl")] == [1, 2]
