"""NeMo Gym launched by the CLIs keeps its files in the run's own folder and fails in one line: a Gym server that
dies during start-up is one `error:` line naming the server, its error and its log file (exit 2, no traceback),
for the eval and for GRPO; a nemo_gym eval leaves its servers' logs in `<save_path>/gym/` (summary.json says
so) and nothing in the temp dir. Each CLI runs as a subprocess with a private TMPDIR, real NeMo Gym 0.7.0
servers, and the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "functional" / "gym_configs"
pytestmark = [pytest.mark.gym]


def cli(script: str, tmpdir: Path, *args: str | Path, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    """Run an example script with `tmpdir` as its (and its children's) temp dir."""
    tmpdir.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / script), *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=os.environ | {"TMPDIR": str(tmpdir)},
    )


def eval_args(gym_venv: Path, model: Path, save: Path, gym_config: Path) -> list[str]:
    """The shipped nemo_gym eval on two rows, one sample each, the tiny model, Gym launched from `gym_config`."""
    return ["--config", str(REPO / "examples/configs/evals/nemo_gym_eval.yaml"), f"eval.save_path={save}",
            f"policy.model_name={model}", "policy.max_model_len=512", "rollouts.max_seq_len=512",
            "policy.generation.max_new_tokens=4", "eval.num_prompts=2", "rollouts.num_generations_per_prompt=1",
            "eval.ks=[1]", f"rollouts.gym.launch.gym_venv={gym_venv}",
            f"rollouts.gym.launch.config_paths=[{gym_config}]", "--no-progress"]


def grpo_args(gym_venv: Path, model: Path, out: Path, gym_config: Path) -> list[str]:
    """One GRPO step over Gym (two rows, two samples each) on the tiny model, as a config file."""
    cfg = {
        "policy": {"model_name": str(model), "max_model_len": 512, "generation": {"max_new_tokens": 4}},
        "data": {"train_path": str(REPO / "examples/data/gym_arithmetic.jsonl"), "shuffle": False},
        "grpo": {"num_prompts_per_step": 2, "max_num_steps": 1},
        "rollouts": {"mode": "nemo_gym", "num_generations_per_prompt": 2, "max_seq_len": 256,
                     "gym": {"launch": {"gym_venv": str(gym_venv), "config_paths": [str(gym_config)]}}},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
        "output_dir": str(out),
    }
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path)]


def assert_one_error_line(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2, no traceback, and exactly one `error:` line on stderr (progress bars of model loading aside)
    holding every needle."""
    out = proc.stderr + proc.stdout
    assert proc.returncode == 2, (proc.returncode, out[-3000:])
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


def leaked(tmpdir: Path) -> list[str]:
    """The Gym launcher's temp folders left in `tmpdir`."""
    return sorted(p.name for p in tmpdir.glob("nemo-gym-*"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", ["run_eval.py", "run_grpo.py"])
def test_a_gym_server_that_dies_at_start_up_is_one_error_line(gym_venv, tiny_model_dir, tmp_path, script):
    crashing = CONFIGS / "crashing_resources_server.yaml"
    run = tmp_path / "run"
    args = (eval_args if script == "run_eval.py" else grpo_args)(gym_venv, tiny_model_dir, run, crashing)
    proc = cli(script, tmp_path / "tmp", *args)
    log = run / "gym" / "arithmetic_equivalence.log"  # in the run's own folder, not in /tmp
    assert_one_error_line(
        proc, "NeMo Gym server 'arithmetic_equivalence' exited during start-up (exit code 1)",
        "ValidationError", f"its log: {log}",
    )
    assert "no_such_rule" in log.read_text()  # the log it names holds the cause
    assert leaked(tmp_path / "tmp") == []


@pytest.mark.timeout(600)
def test_a_nemo_gym_eval_keeps_its_gym_logs_in_its_folder(gym_venv, tiny_model_dir, tmp_path):
    save = tmp_path / "eval"
    proc = cli("run_eval.py", tmp_path / "tmp", *eval_args(gym_venv, tiny_model_dir, save,
                                                           REPO / "examples/configs/gym/arithmetic_agents.yaml"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((save / "summary.json").read_text())
    assert summary["gym_logs"] == "gym" and summary["num_completions"] == 2
    logs = sorted(p.name for p in (save / "gym").glob("*.log"))
    assert {"agent_alpha.log", "agent_beta.log"} <= set(logs), logs
    assert f"NeMo Gym server logs in {save / 'gym'}/" in proc.stdout
    assert leaked(tmp_path / "tmp") == []  # before: a /tmp/nemo-gym-XXXX folder per run, successful ones too
