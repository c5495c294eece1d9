"""A grading worker killed mid-grade (SIGKILL, as the out-of-memory killer does) in a real eval: the sample is
an error completion (not scored, counted in num_errors, exit 3), and a resume re-grades it to the right reward.

The kill happens in the real grading pool's worker process (`testing.KilledGradingMathEnvironment`) while a
flag file exists; the policy is scripted to answer every prompt right, so any 0 would be a fault scored as
a wrong answer.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pytest

from nemo_rl_ext.config import load_config
from nemo_rl_ext.environments.registry import register_environment
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.models.generation import FinishReason
from nemo_rl_ext.testing import KilledGradingMathEnvironment, ScriptedGeneration, ScriptedRequest

REPO = Path(__file__).resolve().parents[2]
ARITHMETIC = REPO / "examples" / "data" / "arithmetic.jsonl"
ROWS = [json.loads(line) for line in ARITHMETIC.read_text().splitlines()][:6]
KILLED_TRUTHS = [ROWS[0]["answer"], ROWS[3]["answer"]]
"""The ground truths whose grading workers are killed while the flag exists (prompts 0 and 3)."""

register_environment("grading_fault_test")(KilledGradingMathEnvironment)


def cli_args(model: Path, save_path: Path, flag: Path, kill_truths: list[str] | None) -> list[str]:
    kill = [f"rollouts.env.kwargs.kill_truths={json.dumps(kill_truths)}"] if kill_truths is not None else []
    return [
        "--config", str(REPO / "examples" / "configs" / "evals" / "eval.yaml"),
        f"policy.model_name={model}",
        f"eval.save_path={save_path}",
        f"eval.dataset_path={ARITHMETIC}",
        "rollouts.env.name=grading_fault_test",
        f"rollouts.env.kwargs.kill_flag={flag}",
        "rollouts.env.kwargs.grading_workers=2",
        *kill,
        f"eval.num_prompts={len(ROWS)}",
        "rollouts.max_seq_len=256",
        "policy.max_model_len=512",
        "policy.generation.max_new_tokens=16",
    ]


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def right_answers(tokenizer) -> ScriptedGeneration:
    """Answers each arithmetic question with its dataset answer, boxed."""

    def reply(request: ScriptedRequest) -> str:
        row = next(r for r in ROWS if r["question"] in request.prompt_text)
        return f"The answer is \\boxed{{{row['answer']}}}."

    return ScriptedGeneration(tokenizer, reply, eos=True, finish_reason=FinishReason.EOS, max_model_len=512)


@pytest.mark.timeout(180)
def test_a_killed_grading_worker_is_an_error_that_a_resume_regrades(tiny_model_and_tokenizer, tiny_model_dir, tmp_path):
    _, tok = tiny_model_and_tokenizer
    flag = tmp_path / "kill-graders"
    flag.touch()
    args = cli_args(tiny_model_dir, tmp_path / "out", flag, KILLED_TRUTHS)
    cfg = load_config(args[1], args[2:], EvalConfig)

    first = run_eval(cfg, generation=right_answers(tok), progress=False)
    lines = read_lines(first.paths.completions)
    errors = [x for x in lines if x["stop_reason"] == "error"]
    assert sorted({x["prompt_idx"] for x in errors}) == [0, 3] and len(errors) == 8  # 2 prompts x 4 samples
    assert all(x["error"].startswith("GradingUnavailableError: a grading worker died") for x in errors)
    assert all("SIGKILL" in x["error"] and x["reward"] == 0.0 for x in errors)
    scored = [x for x in lines if x["stop_reason"] != "error"]
    assert len(scored) == 16 and all(x["reward"] == 1.0 and x["env_extras"]["grading"] == "ok" for x in scored)
    summary = first.summary
    assert summary["num_errors"] == 8 and summary["status"] == "errors_left" and first.errors_left
    assert summary["metrics"]["num_samples"] == 16  # the errors are not samples with reward 0
    assert summary["metrics"]["mean_reward"] == 1.0

    flag.unlink()  # the fault is gone: the resume re-grades exactly the errored samples
    resumed = run_eval(cfg, generation=right_answers(tok), progress=False)
    assert resumed.retried == 8 and resumed.errors_written == 0 and resumed.skipped_completions == 16
    new = read_lines(resumed.paths.completions)[len(lines):]
    assert sorted((x["prompt_idx"], x["sample_idx"]) for x in new) == sorted(
        (x["prompt_idx"], x["sample_idx"]) for x in errors
    )
    assert all(x["stop_reason"] == "natural" and x["reward"] == 1.0 for x in new)
    assert resumed.summary["num_errors"] == 0 and resumed.summary["status"] == "ok"
    assert resumed.summary["metrics"]["num_samples"] == 24 and resumed.summary["metrics"]["mean_reward"] == 1.0


@pytest.mark.timeout(240)
def test_the_cli_exits_3_while_graders_die_and_0_once_they_do_not(tiny_model_dir, tmp_path, capsys) -> None:
    """The tiny model's answers, every grading worker killed: exit 3 naming the errors; then a resume: exit 0."""
    main = runpy.run_path(str(REPO / "examples" / "run_eval.py"))["main"]
    flag = tmp_path / "kill-graders"
    flag.touch()
    args = [*cli_args(tiny_model_dir, tmp_path / "out", flag, None), "--no-progress"]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "error: 24 error sample(s) left" in err and "Traceback" not in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["num_errors"] == 24 and summary["status"] == "errors_left"

    flag.unlink()
    assert main(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["num_errors"] == 0 and summary["status"] == "ok" and summary["metrics"]["num_samples"] == 24
    final = [x for x in read_lines(tmp_path / "out" / "completions.jsonl") if x["stop_reason"] != "error"]
    assert len(final) == 24 and all(x["env_extras"]["grading"] in ("ok", "timeout") for x in final)
