"""The eval with a teacher (on-policy distillation's scorer in the eval's rollouts): the tiny model scored by
itself has a student-teacher KL of ~0, scored by another tiny model (other weights, same tokenizer) a KL > 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_eval import make_cfg

from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.models.tiny import build_tiny_model
from tests.tolerances import ENGINE_LOGPROBS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def distill_eval(tiny_model_dir: Path, generation, out: Path, teacher: Path):
    cfg = make_cfg(tiny_model_dir, out, num_prompts=3)
    cfg = type(cfg).model_validate({**cfg.model_dump(), "on_policy_distillation": {
        "enabled": True, "default_teacher_alias": str(teacher)}})
    result = run_eval(cfg, generation=generation, progress=False)
    lines = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and not [x for x in lines if x["stop_reason"] == "error"]
    for x in lines:  # every generated token was scored, once
        assert x["distill"]["scored_tokens"] == sum(m["num_tokens"] for m in x["message_log"]
                                                    if m["role"] == "assistant")
    return result.summary["metrics"], lines


def kl_bound(lines) -> tuple[float, float]:
    """The scored tokens of `lines` and the bound of their summed KL terms when the teacher is the student's own
    weights: each term is engine logprob - forward-pass logprob, |g - t| <= atol + rtol |t| (ENGINE_LOGPROBS),
    so the sum is at most n * atol + rtol * sum |t|, with t <= 0."""
    n = sum(x["distill"]["scored_tokens"] for x in lines)
    return n, n * ENGINE_LOGPROBS["atol"] - ENGINE_LOGPROBS["rtol"] * sum(x["distill"]["teacher_logprob_sum"]
                                                                           for x in lines)


@pytest.mark.timeout(60)
def test_the_same_model_as_teacher_gives_kl_0_and_another_model_kl_above_0(tiny_model_dir, generation,
                                                                           tmp_path) -> None:
    same, lines = distill_eval(tiny_model_dir, generation, tmp_path / "same", tiny_model_dir)
    n, bound = kl_bound(lines)
    assert abs(same["distill/reverse_kl"]) * n <= bound, (same["distill/reverse_kl"], bound / n)
    agent = lines[0]["agent"]
    assert same["distill/scored_tokens"] == n and same[f"distill/reverse_kl/{agent}"] == same["distill/reverse_kl"]
    other_dir = build_tiny_model(tmp_path / "other", seed=1)
    other, _ = distill_eval(tiny_model_dir, generation, tmp_path / "other_eval", other_dir)
    # another random model disagrees by far more than rounding: its KL is hundreds of the bound above
    assert other["distill/reverse_kl"] > 100 * bound / n, other["distill/reverse_kl"]
    print("KL same", same["distill/reverse_kl"], "bound", bound / n, "KL other", other["distill/reverse_kl"])
    assert other["pass@1"] == same["pass@1"]  # the teacher scores; it does not change the samples (seeded)


@pytest.mark.timeout(120)
def test_a_teacher_down_leaves_error_completions_that_a_resume_scores(tiny_model_dir, generation,
                                                                      tmp_path) -> None:
    import socket
    import subprocess

    from test_distillation_http import ENV, REPO, server_cmd

    with socket.socket() as s:  # a free port: nothing listens there until the server below starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = make_cfg(tiny_model_dir, tmp_path / "eval", num_prompts=3)
    cfg = type(cfg).model_validate({**cfg.model_dump(), "on_policy_distillation": {
        "enabled": True, "default_teacher_alias": f"http://127.0.0.1:{port}/v1", "request_retries": 0,
        "request_timeout_s": 10}})
    down = run_eval(cfg, generation=generation, progress=False)
    assert down.summary["num_errors"] == 12 and "distill/reverse_kl" not in down.summary["metrics"]
    lines = [json.loads(x) for x in (tmp_path / "eval" / "completions.jsonl").read_text().splitlines()]
    assert all(x["stop_reason"] == "error" and "teacher" in x["error"] and "distill" not in x for x in lines)
    cmd = [*server_cmd(tiny_model_dir)]
    cmd[cmd.index("--port") + 1] = str(port)
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "listening on http://" in line:
                break
        # how the teacher is reached may change on resume (experience/resume_keys.py), which teacher may not
        teacher = cfg.on_policy_distillation.model_copy(update={"request_retries": 2, "request_timeout_s": 60})
        up = run_eval(cfg.model_copy(update={"on_policy_distillation": teacher}), generation=generation,
                      progress=False)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert up.summary["num_errors"] == 0 and up.summary["num_completions"] == 12
    # the same weights served over HTTP (float32): the KL is ~0, within the bound of the test above
    n, bound = kl_bound([json.loads(x) for x in (tmp_path / "eval" / "completions.jsonl").read_text().splitlines()
                         if '"distill"' in x])
    assert abs(up.summary["metrics"]["distill/reverse_kl"]) * n <= bound, up.summary["metrics"]
    assert up.summary["metrics"]["distill/scored_tokens"] == n
