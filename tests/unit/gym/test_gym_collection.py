"""Gym rows as Gym's collector prepares them (agent_name, responses_create_params overrides, task indices),
Gym's shipped server configs (the launcher's policy_model, paths in the Gym install), and the nemo_gym eval's
materialized rows and Gym's aggregate metrics, against fake agents (`nemo_rl_ext.testing.FakeAgents`)."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
import yaml
from pydantic import ValidationError
from test_gym_rollouts import gym_manager

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.data.datasets import gym_datums
from nemo_rl_ext.evals.config import EvalConfig, input_problems
from nemo_rl_ext.evals.driver import run_eval_async
from nemo_rl_ext.gym.config import GymConfig, GymLaunchConfig, resolve_gym_path
from nemo_rl_ext.gym.launcher import (
    POLICY_MODEL_BLOCK,
    GymLauncher,
    missing_config_paths,
    undefined_model_servers,
)
from nemo_rl_ext.testing import FakeAgents, UnusedPolicy

MCQA_LIKE = """\
mcqa:
  resources_servers:
    mcqa:
      entrypoint: app.py
mcqa_simple_agent:
  responses_api_agents:
    simple_agent:
      entrypoint: app.py
      resources_server: {type: resources_servers, name: mcqa}
      model_server: {type: responses_api_models, name: policy_model}
"""
USER_POLICY_MODEL = """\
policy_model:
  responses_api_models:
    openai_model: {entrypoint: app.py, openai_base_url: "${policy_base_url}"}
"""


def row(text: str, agent: str | None = None, **extra) -> dict:
    r = {"responses_create_params": {"input": [{"role": "user", "content": text}]}, **extra}
    if agent:
        r["agent_ref"] = {"name": agent}
    return r


@pytest.fixture
def fake_gym_venv(tmp_path) -> Path:
    """A directory shaped like a Gym venv: resources_servers/mcqa/{configs,data} in its site-packages."""
    site = tmp_path / "gym-venv" / "lib" / "python3.13" / "site-packages" / "resources_servers" / "mcqa"
    (site / "configs").mkdir(parents=True)
    (site / "data").mkdir()
    (site / "configs" / "mcqa.yaml").write_text(MCQA_LIKE)
    (site / "data" / "example.jsonl").write_text(json.dumps(row("q1")) + "\n" + json.dumps(row("q2")) + "\n")
    return tmp_path / "gym-venv"


# ---- 1. rows without agent_ref -----------------------------------------------------------------------


def test_rows_without_agent_ref_take_gym_agent_name(tiny_model_and_tokenizer, agents):
    rows = [row("a"), row("b", "agent_beta"), row("c")]
    datums = gym_datums(rows, agent_name="agent_alpha")
    assert [d.agent for d in datums] == ["agent_alpha", "agent_beta", "agent_alpha"]
    assert [d.extra_env_info["agent_ref"] for d in datums] == [
        {"name": "agent_alpha"}, {"name": "agent_beta"}, {"name": "agent_alpha"}]
    assert "agent_ref" not in rows[0]  # the caller's rows are not changed
    with pytest.raises(ValueError, match=r"2 Gym row\(s\) lack responses_create_params or agent_ref.name: "
                                         r"rows \[0, 2\] \(gym.agent_name names"):
        gym_datums(rows)
    assert GymConfig.model_validate({"agent_urls": {"a": "http://x"}, "policy_port": 1,
                                     "agent_name": "a"}).agent_name == "a"
    # per-agent counts apply to the resolved name, and the rows sent carry it
    _, tok = tiny_model_and_tokenizer
    mgr = gym_manager(tok, agents, {"agent_alpha": 3, "agent_beta": 1}, agent_name="agent_alpha")
    inputs = [mgr.impl._build_inputs(d) for d in datums]
    assert [len(x) for x in inputs] == [3, 1, 3]
    assert {r["agent_ref"]["name"] for r in inputs[0] + inputs[2]} == {"agent_alpha"}
    # a datum without agent_ref in its row (built elsewhere) gets gym.agent_name too
    bare = gym_datums([row("d")], agent_name="x")[0]
    bare = type(bare)(0, (), "nemo_gym", extra_env_info=row("d"))
    assert [r["agent_ref"] for r in mgr.impl._build_inputs(bare)] == [{"name": "agent_alpha"}] * 3


def test_eval_input_check_resolves_gym_agent_name(tmp_path, fake_gym_venv):
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [row("a"), row("b", "other"), row("c")]) + "\n")
    base = {"eval": {"dataset_path": str(data), "save_path": str(tmp_path / "o")},
            "rollouts": {"mode": "nemo_gym", "num_generations_per_prompt": {"mine": 2, "other": 1},
                         "gym": {"agent_urls": {"mine": "http://x"}, "policy_port": 1}},
            "policy": {"generation": {"top_k": None, "temperature": 1.0}}}
    assert any("rows [0, 2]" in p for p in input_problems(EvalConfig.model_validate(base)))
    base["rollouts"]["gym"]["agent_name"] = "mine"
    assert not [p for p in input_problems(EvalConfig.model_validate(base)) if "dataset_path" in p
                or "num_generations_per_prompt" in p]


# ---- 2. Gym's server configs used unchanged -------------------------------------------------------------


def test_the_launcher_defines_the_policy_model_the_shipped_configs_call(tmp_path, fake_gym_venv):
    cfg = GymLaunchConfig(gym_venv=fake_gym_venv, config_paths=["resources_servers/mcqa/configs/mcqa.yaml"],
                          work_dir=tmp_path / "work")
    launcher = GymLauncher(cfg, policy_base_url="http://127.0.0.1:1/v1", policy_model_name="policy")
    shipped = fake_gym_venv / "lib/python3.13/site-packages/resources_servers/mcqa/configs/mcqa.yaml"
    assert launcher.config_paths == [shipped]  # relative, not in the CWD: found in the Gym install
    assert undefined_model_servers([shipped]) == ["policy_model"]
    launcher.work_dir = cfg.work_dir
    cfg.work_dir.mkdir()
    launcher._define_model_servers()
    ours, given = launcher.config_paths
    assert given == shipped and shipped.read_text() == MCQA_LIKE  # the shipped file is used unchanged
    block = yaml.safe_load(ours.read_text())
    assert block == {"policy_model": POLICY_MODEL_BLOCK}
    model = block["policy_model"]["responses_api_models"]["vllm_model"]
    assert model["return_token_id_information"] is True and model["base_url"] == "${policy_base_url}"
    # a policy_model the user defines wins: nothing is added
    user = tmp_path / "user_policy.yaml"
    user.write_text(USER_POLICY_MODEL)
    assert undefined_model_servers([shipped, user]) == []
    launcher2 = GymLauncher(GymLaunchConfig(gym_venv=fake_gym_venv, config_paths=[shipped, user]),
                            policy_base_url="http://127.0.0.1:1/v1", policy_model_name="policy")
    launcher2.work_dir = tmp_path / "work2"
    launcher2.work_dir.mkdir()
    launcher2._define_model_servers()
    assert launcher2.config_paths == [shipped, user] and not list(launcher2.work_dir.iterdir())


def test_the_policy_model_block_takes_gym_completions_mode_keys(tmp_path, fake_gym_venv):
    extra = {"use_completions_api": True, "render_chat_template": True, "tokenizer": "/models/tiny"}
    cfg = GymLaunchConfig(gym_venv=fake_gym_venv, config_paths=["resources_servers/mcqa/configs/mcqa.yaml"],
                          work_dir=tmp_path, policy_model=extra)
    launcher = GymLauncher(cfg, policy_base_url="http://127.0.0.1:1/v1", policy_model_name="policy")
    launcher.work_dir = tmp_path
    launcher._define_model_servers()
    model = yaml.safe_load(launcher.config_paths[0].read_text())["policy_model"]["responses_api_models"]["vllm_model"]
    assert model == {**POLICY_MODEL_BLOCK["responses_api_models"]["vllm_model"], **extra}
    with pytest.raises(ValidationError) as info:
        GymLaunchConfig(gym_venv=fake_gym_venv, config_paths=["x.yaml"],
                        policy_model={"base_url": "http://elsewhere", "model": "m"})
    assert "['base_url', 'model'] are set by the launcher" in str(info.value)
    with pytest.raises(ValidationError, match="render_chat_template: true needs tokenizer"):
        GymLaunchConfig(gym_venv=fake_gym_venv, config_paths=["x.yaml"], policy_model={"render_chat_template": True})


def test_a_missing_gym_config_is_one_error_naming_it(tmp_path, fake_gym_venv, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = GymLaunchConfig(gym_venv=fake_gym_venv, config_paths=[
        "resources_servers/mcqa/configs/mcqa.yaml", "resources_servers/nope/configs/nope.yaml", "/abs/x.yaml"])
    problems = missing_config_paths(cfg)
    assert len(problems) == 2
    assert "file not found: resources_servers/nope/configs/nope.yaml" in problems[0]
    assert "in the Gym install" in problems[0] and "file not found: /abs/x.yaml" in problems[1]
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row("a", "mcqa_simple_agent")) + "\n")
    ecfg = EvalConfig.model_validate({
        "eval": {"dataset_path": "resources_servers/mcqa/data/example.jsonl", "save_path": "o"},
        "rollouts": {"mode": "nemo_gym", "gym": {"launch": cfg.model_dump(), "agent_name": "mcqa_simple_agent"}},
        "policy": {"generation": {"top_k": None}}})
    found = input_problems(ecfg)
    assert [p for p in found if "gym.launch" in p] == problems  # the dataset was found in the Gym install
    assert not [p for p in found if "dataset_path" in p]
    assert resolve_gym_path("resources_servers/mcqa/data/example.jsonl", fake_gym_venv).is_file()


# ---- 3. collection parity -------------------------------------------------------------------------------


def test_responses_create_params_overrides_and_shared_task_indices(tiny_model_and_tokenizer, agents):
    _, tok = tiny_model_and_tokenizer
    rows = [row("same", "agent_alpha", k=1), row("other", "agent_alpha"), row("same", "agent_alpha", k=1)]
    overrides = {"parallel_tool_calls": False, "metadata": {"m": "1"}}
    datums = gym_datums(rows, responses_create_params=overrides)
    mgr = gym_manager(tok, agents, 2, responses_create_params=overrides)
    inputs = [mgr.impl._build_inputs(d) for d in datums]
    # identical rows share Gym's task index; rollout indices go on across them, as in Gym's collector
    assert [[(r["_ng_task_index"], r["_ng_rollout_index"]) for r in x] for x in inputs] == [
        [(0, 0), (0, 1)], [(1, 0), (1, 1)], [(0, 2), (0, 3)]]
    params = inputs[1][0]["responses_create_params"]
    # row | overrides (top-level keys replaced), then policy.generation's sampling and the seed
    assert params["parallel_tool_calls"] is False and params["input"] == rows[1]["responses_create_params"]["input"]
    assert params["metadata"]["m"] == "1" and "seed" in json.loads(params["metadata"]["extra_body"])
    assert (params["temperature"], params["max_output_tokens"]) == (0.9, 77)
    # a row's own _ng_task_index is kept (Gym 0.7.0 honours a caller-provided one)
    assert [d.metadata["gym_task_index"] for d in gym_datums([*rows, row("z", "a", _ng_task_index=7)])] == [
        0, 1, 0, 7]
    with pytest.raises(ValidationError, match=r"\['temperature'\] are set from policy.generation"):
        GymConfig.model_validate({"agent_urls": {"a": "u"}, "policy_port": 1,
                                  "responses_create_params": {"temperature": 0.1}})


def nemo_gym_eval(tmp_path, agents: FakeAgents, **gym) -> EvalConfig:
    data = tmp_path / "rows.jsonl"
    alpha = None if "agent_name" in gym else "agent_alpha"  # rows without agent_ref only with gym.agent_name
    rows = [row("x", alpha), row("y", "agent_beta"), row("x", alpha)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return EvalConfig.model_validate({
        "eval": {"dataset_path": str(data), "save_path": str(tmp_path / "out")},
        "rollouts": {"mode": "nemo_gym", "num_generations_per_prompt": {"agent_alpha": 2, "agent_beta": 1},
                     "gym": {"agent_urls": agents.agent_urls(), "serve_policy": False, **gym}},
        "policy": {"generation": {"top_k": None, "temperature": 1.0, "seed": 5, "max_new_tokens": 9}},
    })


async def test_the_eval_materializes_the_rows_it_sends_and_resumes_from_them(
        tiny_model_and_tokenizer, agents, tmp_path):
    _, tok = tiny_model_and_tokenizer
    policy = UnusedPolicy(tok)
    cfg = nemo_gym_eval(tmp_path, agents, agent_name="agent_alpha",
                        responses_create_params={"parallel_tool_calls": False})
    result = await run_eval_async(cfg, generation=policy, progress=False)
    assert result.complete
    sent_file = tmp_path / "out" / "gym_rows.jsonl"
    written = [orjson.loads(x) for x in sent_file.read_bytes().splitlines()]
    received = sorted(({k: v for k, v in r.items() if k != "agent"} for r in agents.rows),
                      key=lambda r: (r["_ng_task_index"], r["_ng_rollout_index"]))
    # exactly the bodies POSTed: prompt order, then sample order
    assert sorted(written, key=lambda r: (r["_ng_task_index"], r["_ng_rollout_index"])) == received
    assert [(r["agent_ref"]["name"], r["_ng_task_index"], r["_ng_rollout_index"]) for r in written] == [
        ("agent_alpha", 0, 0), ("agent_alpha", 0, 1), ("agent_beta", 1, 0), ("agent_alpha", 0, 2),
        ("agent_alpha", 0, 3)]
    assert all(r["responses_create_params"]["parallel_tool_calls"] is False for r in written)

    # a resumed run sends the rows of the file (here edited by hand, to see that they are the ones sent)
    lines = (tmp_path / "out" / "completions.jsonl").read_bytes().splitlines()
    (tmp_path / "out" / "completions.jsonl").write_bytes(b"\n".join(lines[:-1]) + b"\n")  # one sample lost
    edited = [{**r, "audit_mark": i} for i, r in enumerate(written)]
    sent_file.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in edited))
    agents.rows.clear()
    again = await run_eval_async(cfg, generation=policy, progress=False)
    assert again.complete and again.completions_written == 1
    lost = orjson.loads(lines[-1])["prompt_idx"]  # its group is rolled out again, from the file's rows
    assert sorted(r["audit_mark"] for r in agents.rows) == {0: [0, 1], 1: [2], 2: [3, 4]}[lost]

    # a rows file that does not fit the eval is a user error naming it
    sent_file.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in written[:2]))
    (tmp_path / "out" / "completions.jsonl").write_bytes(b"\n".join(lines[:-1]) + b"\n")
    with pytest.raises(ConfigError, match=r"gym_rows.jsonl: 2 row\(s\), but this eval sends 5"):
        await run_eval_async(cfg, generation=policy, progress=False)


# ---- 4. Gym's aggregate metrics -----------------------------------------------------------------------


async def test_gyms_aggregate_metrics_are_in_the_summary_and_report(tiny_model_and_tokenizer, agents, tmp_path):
    _, tok = tiny_model_and_tokenizer
    policy = UnusedPolicy(tok)
    result = await run_eval_async(nemo_gym_eval(tmp_path, agents), generation=policy, progress=False)
    # the fake agents answer reward 1.0 (agent_alpha) / 0.5 (agent_beta); their /aggregate_metrics averages
    gym = result.summary["gym_metrics"]
    assert gym == {"agent_alpha": {"agent_metrics": {"mean/reward": 1.0}, "key_metrics": {}},
                   "agent_beta": {"agent_metrics": {"mean/reward": 0.5}, "key_metrics": {}}}
    assert orjson.loads((tmp_path / "out" / "summary.json").read_bytes())["gym_metrics"] == gym
    on_disk = orjson.loads((tmp_path / "out" / "gym_aggregate_metrics.json").read_bytes())
    assert on_disk["agent_beta"]["agent_metrics"] == {"mean/reward": 0.5}
    report = (tmp_path / "out" / "report.md").read_text()
    assert "NeMo Gym's aggregate metrics" in report and "`agent_beta`: no key metrics" in report
