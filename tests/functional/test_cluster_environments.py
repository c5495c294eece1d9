"""Environments hosted in Ray actors by config (`rollouts.env.remote`, in GRPO and the eval alike)
give the same results as in-process ones, and GRPO in nemo_gym mode trains on a two-replica pool; all on
the session's Ray, which every run leaves running."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from nemo_rl_ext.cluster import RemoteEnvironment, RoutedGeneration
from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.evals.profile import without_timings
from nemo_rl_ext.grpo import loop as grpo_module
from nemo_rl_ext.grpo.config import GRPOConfig
from nemo_rl_ext.grpo.loop import GRPO

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def remote_steps(monkeypatch):
    """Every RemoteEnvironment built during the test, with the number of `step` calls it forwarded."""
    built: list[RemoteEnvironment] = []
    real_init, real_call = RemoteEnvironment.__init__, RemoteEnvironment._call

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.steps_forwarded = 0
        built.append(self)

    async def call(self, method, *args):
        if method == "step":
            self.steps_forwarded += 1
        return await real_call(self, method, *args)

    monkeypatch.setattr(RemoteEnvironment, "__init__", init)
    monkeypatch.setattr(RemoteEnvironment, "_call", call)
    return built


def eval_config(model_dir: Path, save: Path, remote: bool) -> EvalConfig:
    return EvalConfig.model_validate({
        "eval": {"dataset_path": str(REPO / "examples/data/arithmetic.jsonl"),
                 "save_path": str(save), "num_prompts": 4, "ks": [1, 2]},
        "rollouts": {"mode": "native", "max_rollout_turns": 1, "num_generations_per_prompt": 2, "max_seq_len": 256,
                     "env": {"name": "math", "remote": remote}},
        "policy": {"model_name": str(model_dir), "max_model_len": 512,
                   "generation": {"max_new_tokens": 8, "temperature": 1.0, "seed": 0}},
    })


def test_an_eval_with_a_remote_math_environment_gives_the_in_process_summary(
    local_ray, tiny_model_dir, tmp_path, remote_steps
):
    local = run_eval(eval_config(tiny_model_dir, tmp_path / "local", remote=False), progress=False)
    assert remote_steps == []
    remote = run_eval(eval_config(tiny_model_dir, tmp_path / "remote", remote=True), progress=False)
    (env,) = remote_steps
    assert env.steps_forwarded == 8  # single_turn: one environment step per sample (4 x 2), all in the actor
    assert local.complete and remote.complete and remote.errors_written == 0
    assert without_timings(remote.summary.to_json()) == without_timings(local.summary.to_json())  # (timings aside)
    rewards = []  # per run: (prompt, sample, reward) of every line, in that order
    for run in ("local", "remote"):
        lines = [json.loads(x) for x in (tmp_path / run / "completions.jsonl").read_text().splitlines()]
        rewards.append(sorted((x["prompt_idx"], x["sample_idx"], x["reward"]) for x in lines))
    assert len(rewards[0]) == 8 and rewards[0] == rewards[1]
    with pytest.raises(RuntimeError, match="shut down"):  # the driver shut the environment's actor down
        asyncio.run(env.step([], []))
    assert local_ray.is_initialized()  # the session's Ray, not the eval's: left running


def grpo_config(model_dir: Path, out: Path, data: Path, remote: bool) -> GRPOConfig:
    return GRPOConfig.model_validate({
        "policy": {"model_name": str(model_dir), "max_model_len": 256,
                   "generation": {"max_new_tokens": 8, "temperature": 1.0, "stop_strings": ["yes"]}},
        "rollouts": {"num_generations_per_prompt": 4, "max_seq_len": 128,
                     "env": {"name": "string_match", "kwargs": {"mode": "similarity"}, "remote": remote,
                             "step_timeout_s": 120}},
        "data": {"train_path": str(data)},
        "grpo": {"num_prompts_per_step": 2, "max_num_steps": 1, "seed": 42},
        "optimizer": {"lr": 3.0e-3, "micro_batch_size": 8},
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},  # as before
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
        "output_dir": str(out),
    })


def test_grpo_with_a_remote_environment_gets_the_in_process_rewards(
    local_ray, tiny_model_dir, tmp_path, monkeypatch, remote_steps
):
    data = tmp_path / "say_yes.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say yes. {w}", "answer": "yes"}) + "\n"
                            for w in ("apple", "river", "blue", "seven")))
    rewards: list[list[list[float]]] = []  # per run: the step's groups' rewards, as the trainer gets them
    real = grpo_module.build_training_batch

    def recording(records, **kwargs):
        rewards.append([[c.reward for c in r.completions] for r in records])
        return real(records, **kwargs)

    monkeypatch.setattr(grpo_module, "build_training_batch", recording)
    for remote in (False, True):
        with GRPO(grpo_config(tiny_model_dir, tmp_path / f"run_{remote}", data, remote)) as grpo:
            env = grpo.task_to_env["string_match"]
            assert isinstance(env, RemoteEnvironment) is remote
            (step,) = grpo.run()
        assert step["rollout/errors"] == 0 and step["train/optimizer_steps"] > 0
    (env,) = remote_steps
    assert env.steps_forwarded == 8  # one step per sample (2 groups x 4), all in the actor
    local, remote = rewards
    assert len(local) == 2 and sum(len(g) for g in local) == 8
    assert len({x for g in local for x in g}) > 1  # dense rewards: the comparison can tell samples apart
    assert remote == local
    with pytest.raises(RuntimeError, match="shut down"):  # GRPO.close shut its actor down
        asyncio.run(env.step([], []))
    assert local_ray.is_initialized()


def test_remote_environment_config_errors_come_in_one_message():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollouts.env.remote=maybe", "rollouts.env.step_timeout_s=0", "rollouts.env.remot=true",
                           "policy.max_model_len=1"], GRPOConfig)
    text = str(err.value)
    for key in ("rollouts.env.remote", "rollouts.env.step_timeout_s", "rollouts.env.remot", "policy.max_model_len"):
        assert key in text, text
    assert "maybe" in text and "Traceback" not in text
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollouts.mode=nemo_gym", "rollouts.gym.head_server_url=http://127.0.0.1:1",
                           "rollouts.env.remote=true", "data.train_path=x.jsonl"], GRPOConfig)
    assert "rollouts.env.remote" in str(err.value) and "native" in str(err.value), str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["eval.dataset_path=x.jsonl", "eval.save_path=out", "rollouts.env.remote=sometimes",
                           "rollouts.env.step_timeout_s=-1"], EvalConfig)
    text = str(err.value)
    assert "rollouts.env.remote" in text and "rollouts.env.step_timeout_s" in text, text
    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollouts.mode=nemo_gym", "eval.dataset_path=x.jsonl", "eval.save_path=out",
                           "rollouts.env.remote=true", "rollouts.gym.head_server_url=http://127.0.0.1:1"], EvalConfig)
    assert "rollouts.env.remote" in str(err.value), str(err.value)


@pytest.mark.gym
@pytest.mark.timeout(900)
def test_one_nemo_gym_grpo_step_on_a_two_replica_pool_refits_both(local_ray, gym_venv, tmp_path, monkeypatch):
    from nemo_rl_ext.models.tiny import build_tiny_model
    from nemo_rl_ext.serving.policy_server import PolicyServer

    servers = []  # (server, the generation it serves) of every policy server built: Gym's one URL
    real_init = PolicyServer.__init__

    def init(self, generation, *args, **kwargs):
        servers.append((self, generation))
        real_init(self, generation, *args, **kwargs)

    monkeypatch.setattr(PolicyServer, "__init__", init)

    model_dir = build_tiny_model(tmp_path / "tiny", seed=0, initializer_range=0.05)
    rows = [json.loads(line) for line in (REPO / "examples/data/gym_arithmetic.jsonl").read_text().splitlines()]
    data = tmp_path / "rows.jsonl"  # dense rewards (string similarity) so the step has signal to train on
    data.write_text("".join(json.dumps({**r, "expected_answer": "what is the answer to it"}) + "\n" for r in rows))
    cfg = GRPOConfig.model_validate({
        "policy": {"model_name": str(model_dir), "max_model_len": 512,
                   "generation": {"max_new_tokens": 8, "temperature": 1.0},
                   "cluster": {"num_replicas": 2, "replica": {"num_cpus": 0.5}}},
        "data": {"train_path": str(data), "shuffle": False},
        "grpo": {"num_prompts_per_step": 2, "max_num_steps": 1, "seed": 3},
        "optimizer": {"lr": 1.0e-3, "micro_batch_size": 8},
        "loss": {"kl_coef": 0.0, "importance_sampling_correction": True, "importance_sampling_cap": 2.0},  # as before
        "rollouts": {"mode": "nemo_gym", "num_generations_per_prompt": {"agent_alpha": 4, "agent_beta": 3},
                     "max_seq_len": 256, "gym": {
            "launch": {"gym_venv": str(gym_venv),
                       "config_paths": [str(REPO / "tests/functional/gym_configs/dense_arithmetic_agents.yaml")]},
            "row_timeout_s": 120}},
        "logger": {"progress": False, "tensorboard_enabled": False, "print_steps": False},
        "output_dir": str(tmp_path / "run"),
    })
    with GRPO(cfg) as grpo:
        pool = grpo.generation.inner
        assert isinstance(pool, RoutedGeneration)
        (step,) = grpo.run()
        m = pool.metrics()
        counts = [m[f"cluster/replica/{i}/requests"] for i in range(2)]
        assert pool.weight_version == 1
        versions = local_ray.get([r.actor.weight_version.remote() for r in pool._replicas], timeout=60)
    assert versions == [1, 1]  # the step's refit reached both replicas
    assert step["rollout/num_samples"] == 7 and step["rollout/errors"] == 0
    assert step["train/optimizer_steps"] > 0 and step["cluster/weight_version"] == 1
    assert sum(counts) == 7 and min(counts) >= 1, counts  # Gym's 7 calls, through one URL, on both replicas
    ((_, served),) = servers  # one URL in front of the pool, serving the step's generation (the salted pool)
    assert served is grpo.generation and grpo.generation.inner is pool
    assert local_ray.is_initialized()
