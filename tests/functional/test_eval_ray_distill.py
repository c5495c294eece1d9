"""The eval with a teacher on 2 Ray eval workers (the session's local Ray, the tiny model as student, another tiny
model as a local teacher that each worker loads for itself): every line's distillation sums, the merged summary's
`distill/reverse_kl` and its token count equal those of the same eval in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_eval_ray_shards import WORKER_CPUS, config, held_prompts, wait_for_each_other

from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.evals.ray_lease_queue import run_ray_eval
from nemo_rl_ext.models.tiny import build_tiny_model

PROMPTS = 8
SAMPLES = 2  # test_eval_shard_jobs.SAMPLES, the samples per prompt of its overrides


def distill_lines(root: Path) -> dict[tuple[int, int], dict]:
    """Each completion line's `distill` sums, by (prompt, sample)."""
    lines = [json.loads(x) for x in (root / "completions.jsonl").read_text().splitlines()]
    return {(x["prompt_idx"], x["sample_idx"]): x.get("distill") for x in lines}


@pytest.mark.timeout(600)
def test_ray_workers_with_a_teacher_report_the_one_process_kl(local_ray, tiny_model_dir, generation,
                                                              tmp_path) -> None:
    teacher = build_tiny_model(tmp_path / "teacher", seed=1)  # other weights, the student's tokenizer
    # one prompt in flight, here and in each worker: the engine then batches the same rows (a group's samples)
    # on both sides (with several groups in one batch, padding changes the engine's logprobs by ~1e-5)
    distill = (f"eval.num_prompts={PROMPTS}", "eval.max_concurrent_prompts=1", "on_policy_distillation.enabled=true",
               f"on_policy_distillation.default_teacher_alias={teacher}")
    one = run_eval(config(tiny_model_dir, tmp_path / "one", *distill), generation=generation, progress=False)
    met = tmp_path / "first-prompts"
    met.mkdir()
    ray = run_ray_eval(config(tiny_model_dir, tmp_path / "ray", *distill, "eval.ray_workers=2", WORKER_CPUS),
                       progress=False, on_written=wait_for_each_other(met))
    assert one.summary is not None and ray.summary is not None and ray.complete
    held = [held_prompts(tmp_path / "ray" / "shards" / f"worker-{k}") for k in range(2)]
    assert held[0] and held[1] and sorted(held[0] + held[1]) == list(range(PROMPTS)), held  # both workers scored

    # every line scored (no error), by the teacher in the worker that rolled it out, as in one process: each
    # worker runs the same kernels on the same shapes (one torch thread, the same batches of a group) as this
    # process, so each line's sums are bit-identical
    mine, theirs = distill_lines(tmp_path / "one"), distill_lines(tmp_path / "ray")
    assert len(mine) == PROMPTS * SAMPLES and all(d and d["scored_tokens"] > 0 for d in mine.values()), mine
    assert theirs == mine

    a, b = one.summary["metrics"], ray.summary["metrics"]
    assert b["distill/scored_tokens"] == a["distill/scored_tokens"] == sum(d["scored_tokens"] for d in mine.values())
    # the summary is the sum of the lines' sums over the sum of their counts; the merge orders the lines as the
    # one-process run does, but a merge that reordered them would only reorder a float sum of 16 terms of one
    # sign (each line's KL: another random model, ~10 nats a token): at most 16 ulps of the sum, far below 1e-12
    assert b["distill/reverse_kl"] == pytest.approx(a["distill/reverse_kl"], rel=1e-12, abs=0)
    assert a["distill/reverse_kl"] > 1.0, a  # another model: a real KL, not the ~0 of a teacher equal to the student
    agent_keys = sorted(k for k in a if k.startswith("distill/reverse_kl/"))
    assert agent_keys and {k: b[k] for k in agent_keys} == pytest.approx({k: a[k] for k in agent_keys}, rel=1e-12)
