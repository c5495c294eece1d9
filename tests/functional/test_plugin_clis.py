"""Plugins through the shipped CLIs: a small plugin package, written here into a temporary folder and made
importable as an installed one (PYTHONPATH plus a dist-info with `entry_points.txt`, which importlib.metadata
finds), registers an environment (its entry point), a metric and a backend (modules named with `--import`).
run_eval.py and the policy server's CLI, as subprocesses, use what it registers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from policy_server_cli import policy_server_cli

REPO = Path(__file__).resolve().parents[2]
PLUGIN_ANSWER = "the plugin answers"

MODULES = {
    # the entry point: an environment that gives every answer reward 1 (the tiny model never solves arithmetic)
    "t27_plugin_env.py": '''
from nemo_rl_ext.environments import register_environment
from nemo_rl_ext.testing import ScriptedEnvironment


@register_environment("plugin_reward_one")
class RewardOne(ScriptedEnvironment):
    def __init__(self):
        super().__init__(turns=1, reward=1.0, answer=lambda step: step.message_log[-1].content)
''',
    # --import on run_eval.py: a metric
    "t27_plugin_metric.py": '''
from nemo_rl_ext.evals.metrics import MetricDef, register_metric

register_metric(MetricDef(name="plugin_samples", compute=lambda samples, correct, k: float(len(samples.rewards)),
                          per_k=False, description="samples per prompt (a plugin's metric)"))
''',
    # --import on the policy server: a backend that answers every request with the same text
    "t27_plugin_backend.py": f'''
from transformers import AutoTokenizer

from nemo_rl_ext.models.backends import register_backend
from nemo_rl_ext.models.policy import resolve_model_path
from nemo_rl_ext.testing import ScriptedGeneration


@register_backend("plugin_scripted", loads_model_folder=True)
def build(cfg, model, tokenizer, engine_kwargs):
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(resolve_model_path(cfg))
    return ScriptedGeneration(tokenizer, lambda request: {PLUGIN_ANSWER!r}, eos=True, max_model_len=cfg.max_model_len)
''',
}


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """A folder laid out as `pip install --target` leaves an installed package: the modules and a dist-info."""
    site = tmp_path_factory.mktemp("plugin_site")
    for name, text in MODULES.items():
        (site / name).write_text(text)
    dist = site / "t27_plugins-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: t27-plugins\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[nemo_rl_ext.plugins]\nreward_one = t27_plugin_env\n")
    return site


def plugin_env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "PYTHONUNBUFFERED": "1"}


@pytest.mark.timeout(150)
def test_run_eval_uses_an_installed_plugin_and_an_imported_one(plugin_site, tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "run_eval.py"), "--config", "examples/configs/evals/eval.yaml",
         f"policy.model_name={tiny_model_dir}", f"eval.save_path={out}", "eval.num_prompts=2", "eval.ks=[1]",
         "rollouts.num_generations_per_prompt=1", "rollouts.env.name=plugin_reward_one",
         "policy.generation.max_new_tokens=4", "--import", "t27_plugin_metric", "--no-progress"],
        cwd=REPO, env=plugin_env(plugin_site), capture_output=True, text=True, timeout=140,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    # the entry point's environment scored every sample, the --import's metric is in the summary
    assert metrics["mean_reward"] == 1.0 and metrics["pass@1"] == 1.0
    assert metrics["plugin_samples"] == 1.0 and metrics["num_prompts@1"] == 2


@pytest.mark.timeout(150)
def test_policy_server_serves_a_plugin_backend(plugin_site, tiny_model_dir) -> None:
    cmd = [sys.executable, "-m", "nemo_rl_ext.serving.policy_server", "--model", str(tiny_model_dir),
           "--backend", "plugin_scripted", "--import", "t27_plugin_backend", "--port", "0",
           "--max-model-len", "256", "--served-model-name", "tiny"]
    with policy_server_cli(cmd, cwd=REPO, env=plugin_env(plugin_site), start_s=120, stop_s=60) as url:
        reply = httpx.post(f"{url}/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == PLUGIN_ANSWER

