"""The shipped on-policy distillation recipe, examples/configs/recipes/opd.yaml, as a user runs it: the file
itself with only the overrides a small run needs (the tiny model as the student, a small data file, 2 steps of
2 prompts x 2 samples), its teacher our policy server CLI over another tiny model in a subprocess on 127.0.0.1,
`examples/run_grpo.py --config` in a subprocess, then `run_grpo.py export` of the run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from child_env import one_thread_env
from policy_server_cli import policy_server_cli
from test_distillation_http import ENV, server_cmd

from nemo_rl_ext.config import load_config
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.metrics_logger import read_metrics
from nemo_rl_ext.models.loading import load_model_and_tokenizer

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "configs" / "recipes" / "opd.yaml"
STEPS = 2


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """The leaf values of a nested mapping by dotted key (an empty mapping is a leaf)."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_every_key_of_the_recipe_is_a_setting_and_its_teacher_is_served_over_http() -> None:
    written = leaves(yaml.safe_load(RECIPE.read_text()))
    cfg = load_config(RECIPE, [], GRPOConfig)
    settings = leaves(cfg.model_dump(mode="json"))
    # each key the file writes is a key of the validated config with the file's value (none dropped, renamed or
    # coerced to something else)
    assert {k: settings.get(k, "<missing>") for k in written} == written
    distill = cfg.on_policy_distillation
    assert distill.enabled and distill.default_teacher_alias.startswith(("http://", "https://"))
    assert not distill.teacher_model_by_agent_name  # every agent's teacher is the URL


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=one_thread_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(600)
def test_the_shipped_recipe_distils_from_a_teacher_served_over_http(tiny_model_dir, tmp_path) -> None:
    from nemo_rl_ext.models.tiny import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", seed=1)  # other weights, the student's tokenizer
    rows = [json.loads(x) for x in (REPO / "examples/data/arithmetic.jsonl").read_text().splitlines()[:4]]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "opd"
    with policy_server_cli(server_cmd(teacher), cwd=REPO, env=ENV, start_s=120, stop_s=60) as url:
        assert url.startswith("http://127.0.0.1:")
        proc = run([sys.executable, str(REPO / "examples" / "run_grpo.py"), "--config", str(RECIPE),
                    f"policy.model_name={tiny_model_dir}", f"data.train_path={data}", f"output_dir={out}",
                    f"grpo.max_num_steps={STEPS}", "grpo.num_prompts_per_step=2",
                    "rollouts.num_generations_per_prompt=2", "optimizer.micro_batch_size=2",
                    "policy.generation.max_new_tokens=8", f"on_policy_distillation.default_teacher_alias={url}"],
                   timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [m for m in read_metrics(out / "metrics.jsonl") if m.get("step", 0) > 0]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:  # every step: the teacher scored every completion, none failed, and the update distilled
        assert m["rollout/errors"] == 0 and m["rollout/num_samples"] == 4, m
        assert m["distill/scored_tokens"] > 0 and not m.get("distill/teacher_failures"), m
        for key in ("distill/reverse_kl", "train/distill/reverse_kl"):
            assert isinstance(m[key], float) and math.isfinite(m[key]), (key, m)
        assert m["distill/reverse_kl"] > 1.0, m  # another random model: a real KL (~10 nats a token)
    printed = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(printed) == STEPS and all("| distill_kl " in line for line in printed), proc.stdout[-2000:]
    saved = yaml.safe_load((out / "config.yaml").read_text())["on_policy_distillation"]
    assert saved["default_teacher_alias"] == url and saved["kl_type"] == "reverse"

    export = run([sys.executable, str(REPO / "examples" / "run_grpo.py"), "export", str(out)], timeout=240)
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    folder = out / "export" / f"step_{STEPS}"
    assert f"exported step {STEPS}" in export.stdout and str(folder) in export.stdout
    model, tokenizer = load_model_and_tokenizer(folder)  # the LoRA adapters merged: a plain model folder
    assert type(model).__name__ == "Qwen2ForCausalLM" and tokenizer.chat_template
