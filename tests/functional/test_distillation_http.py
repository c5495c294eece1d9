"""A teacher served over HTTP by our policy server (its CLI in a subprocess, over the session's tiny model):
its scores of a multi-turn tool record equal a separate forward pass of the teacher; the checks before any
model loads accept it and refuse a dead URL and a student with another tokenizer; a teacher killed mid-run
turns the groups it was to score into error completions (no scores recorded), and a restarted one scores them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from policy_server_cli import policy_server_cli, start_policy_server
from teacher_checks import assert_scores_match_forward, tool_datum, tool_manager

from nemo_rl_ext.data.records import StopReason
from nemo_rl_ext.distillation.checks import distillation_problems
from nemo_rl_ext.distillation.config import DistillationSettings
from nemo_rl_ext.distillation.http_teacher import HttpTeacher
from nemo_rl_ext.distillation.scoring import TeacherScorer
from nemo_rl_ext.models.loading import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}


def server_cmd(model_dir: Path) -> list[str]:
    return [sys.executable, "-m", "nemo_rl_ext.serving.policy_server", "--model", str(model_dir), "--port", "0",
            "--dtype", "float32", "--max-model-len", "1024", "--log-level", "info"]


@contextlib.contextmanager
def killable_server(model_dir: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """The policy server CLI and its URL; the test may SIGKILL it (it is killed at the end either way)."""
    proc, url, _ = start_policy_server(server_cmd(model_dir), cwd=REPO, env=ENV, start_s=120)
    try:
        yield url, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


async def test_http_teacher_scores_like_a_forward_pass_and_passes_the_checks(
    tiny_model_dir, tiny_model_and_tokenizer, tmp_path
):
    model, tok = tiny_model_and_tokenizer
    other = load_tokenizer(tiny_model_dir)
    other.add_special_tokens({"additional_special_tokens": ["<|not_the_teachers|>"]})
    with policy_server_cli(server_cmd(tiny_model_dir), cwd=REPO, env=ENV, start_s=120, stop_s=60) as url:
        teacher = HttpTeacher(url, timeout_s=60)
        record = await tool_manager(tok, TeacherScorer({"calc": teacher}, top_k=4)).run_rollout(tool_datum(tok))
        assert_scores_match_forward(record, model, 4)
        assert record.rollout_metrics["distill/reverse_kl"] == record.rollout_metrics["agent/calc/distill/reverse_kl"]

        settings = DistillationSettings(enabled=True, teacher_model_by_agent_name={"calc": url})
        assert distillation_problems(settings, ["calc"], tok) == []
        [mismatch] = distillation_problems(settings, ["calc"], other)
        assert url in mismatch and "another tokenizer" in mismatch
    dead = DistillationSettings(enabled=True, teacher_model_by_agent_name={"calc": url}, health_timeout_s=2)
    [problem] = distillation_problems(dead, ["calc"], tok)
    assert f"teacher {url!r}: GET /health did not answer" in problem


async def test_teacher_killed_mid_run_gives_error_completions_and_a_restarted_one_scores_them(
    tiny_model_dir, tiny_model_and_tokenizer
):
    model, tok = tiny_model_and_tokenizer
    datums = [tool_datum(tok, i) for i in range(3)]
    with killable_server(tiny_model_dir) as (url, proc):
        teacher = HttpTeacher(url, timeout_s=10, retries=1, retry_backoff_s=0.05)
        manager = tool_manager(tok, TeacherScorer({"calc": teacher}, top_k=2))
        records = []
        stream = manager.stream_rollouts(datums, max_concurrent_prompts=1)
        async with contextlib.aclosing(stream):
            async for record in stream:
                records.append(record)
                if len(records) == 1:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(timeout=30)
    first, *failed = records
    assert_scores_match_forward(first, model, 2)
    assert len(failed) == 2
    for record in failed:
        for c in record.completions:
            assert c.stop_reason is StopReason.ERROR and c.reward == 0.0 and c.env_extras["teacher_error"]
            assert c.error.startswith(f"teacher {url}: TeacherError") and "2 attempt(s)" in c.error
            assert all(m.teacher_logprobs is None for m in c.message_log)  # nothing recorded as a score
        assert record.rollout_metrics["rollout/errors"] == 2 and "distill/reverse_kl" not in record.rollout_metrics
    with killable_server(tiny_model_dir) as (url, _):  # resume: the failed prompts again, the teacher back
        manager = tool_manager(tok, TeacherScorer({"calc": HttpTeacher(url, timeout_s=60)}, top_k=2))
        again, _ = await manager.run_rollouts([datums[r.prompt_idx] for r in failed], progress=False)
    for record in again:
        assert_scores_match_forward(record, model, 2)
