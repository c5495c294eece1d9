"""Run several lm-evaluation-harness evaluations in one process and write their per-request answers as JSON.

    python lm_eval_runs.py SPEC.json OUT.json

SPEC.json: {"include_path": <folder of task YAMLs>, "runs": {name: {"model": ..., "model_args": ...,
"tasks": [...], "apply_chat_template": bool}}}. Each run is `lm_eval.simple_evaluate` with the same `--model`,
`--model_args` and `--apply_chat_template` as the `lm_eval` command line of docs/serving.md (the command line
parses into these arguments); one process for all runs, so lm-eval, torch and transformers are imported once.
OUT.json: {name: {task: {doc_id: resps}}} with lm-eval's raw answers per request (`resps`: a loglikelihood
request's [logprob sum, is_greedy], a generate_until request's text).
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    import lm_eval
    from lm_eval.tasks import TaskManager

    with open(spec_path) as f:
        spec = json.load(f)
    tasks = TaskManager(include_path=spec["include_path"])
    answers: dict[str, dict] = {}
    for name, run in spec["runs"].items():
        results = lm_eval.simple_evaluate(
            model=run["model"], model_args=run["model_args"], tasks=run["tasks"], task_manager=tasks,
            apply_chat_template=run.get("apply_chat_template", False), device="cpu", batch_size=1, log_samples=True,
        )
        answers[name] = {
            task: {str(s["doc_id"]): s["resps"] for s in samples} for task, samples in results["samples"].items()
        }
    with open(out_path, "w") as f:
        json.dump(answers, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
