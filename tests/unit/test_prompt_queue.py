"""The lease queue of an eval on Ray workers (without Ray), the eval.ray_workers rules, and which prompts a resumed
Ray eval queues again."""

from __future__ import annotations

from pathlib import Path

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.prompt_queue import PromptQueue
from nemo_rl_ext.evals.ray_shards import group_configs, todo_items, worker_store
from nemo_rl_ext.evals.shards import ShardRecord
from nemo_rl_ext.evals.store import CompletionStore

BASE = ["eval.dataset_path=data.jsonl", "eval.save_path=out", "policy.generation.seed=0"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def items(*prompts: int) -> list[tuple[int, int]]:
    return [(0, p) for p in prompts]


def test_workers_lease_in_order_and_a_slow_worker_takes_fewer() -> None:
    queue = PromptQueue(items(*range(6)))
    assert queue.lease("fast", 2) == items(0, 1)
    assert queue.lease("slow") == items(2)
    queue.complete("fast", items(0, 1))
    assert queue.lease("fast", 2) == items(3, 4)
    queue.complete("fast", items(3, 4))
    assert queue.lease("fast", 2) == items(5)
    assert queue.lease("fast") == []  # nothing pending, but "slow" still holds 2: ask again later
    status = queue.status()
    assert (status.pending, status.leased, status.done, status.finished) == (0, {"fast": 1, "slow": 1}, 4, False)
    queue.complete("slow", items(2))
    queue.complete("fast", items(5))
    assert queue.lease("slow") is None and queue.status().finished  # every item done: stop


def test_a_dead_workers_leases_go_back_to_the_front_of_the_queue() -> None:
    queue = PromptQueue(items(*range(5)))
    assert queue.lease("a", 2) == items(0, 1)
    assert queue.lease("b", 1) == items(2)
    queue.complete("a", items(0))
    assert queue.release("a") == items(1)  # what it held and had not completed
    assert queue.release("a") == []  # released once
    assert queue.lease("b", 3) == items(1, 3, 4)  # the returned item first, then the rest in order
    queue.complete("b", items(1, 2, 3, 4))
    status = queue.status()
    assert status.finished and status.requeued == 1 and status.leased == {}


def test_an_expired_lease_goes_back_and_a_late_completion_still_counts() -> None:
    clock = Clock()
    queue = PromptQueue(items(0, 1, 2), lease_timeout_s=10, clock=clock)
    assert queue.lease("hung") == items(0)
    clock.now = 5
    assert queue.lease("ok") == items(1)
    clock.now = 11
    assert queue.expire() == {"hung": items(0)}  # "ok" leased at 5: 6 s old, kept
    assert queue.status().leased == {"ok": 1}
    queue.complete("hung", items(0))  # it finished after all (its lines are on disk): done, not leased again
    assert queue.lease("ok", 3) == items(2)
    queue.complete("ok", items(1, 2))
    assert queue.lease("ok") is None and queue.status().requeued == 1
    assert PromptQueue(items(0), lease_timeout_s=None).expire() == {}


def test_a_completion_while_another_worker_holds_the_item_releases_that_lease() -> None:
    clock = Clock()
    queue = PromptQueue(items(0, 1), lease_timeout_s=1, clock=clock)
    queue.lease("a")
    clock.now = 2
    queue.expire()
    assert queue.lease("b") == items(0)  # re-leased to b
    queue.complete("a", items(0))  # a's lines landed first
    assert queue.status().leased == {} and queue.release("b") == []  # b's death gives nothing back


def test_bad_queue_input() -> None:
    with pytest.raises(ValueError, match="queued once"):
        PromptQueue(items(0, 0))
    with pytest.raises(ValueError, match="n must be >= 1"):
        PromptQueue(items(0)).lease("a", 0)
    assert PromptQueue([]).lease("a") is None


def test_ray_workers_refuse_what_they_cannot_run_all_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["eval.dataset_path=data.jsonl", "eval.save_path=out", "eval.ray_workers=2",
                           "eval.shard=0/2", "policy.cluster={num_replicas: 2}"], EvalConfig)
    msg = str(info.value)
    assert "3 problem(s)" in msg
    assert "eval.shard: can't be combined with eval.ray_workers" in msg and "(got '0/2')" in msg
    assert "policy.generation.seed: must be set with eval.ray_workers (or use eval.seeds)" in msg
    assert "policy.cluster.num_replicas: must be 1 with eval.ray_workers" in msg and "(got 2)" in msg
    with pytest.raises(ConfigError, match=r"eval.seed_index: can't be combined with eval.ray_workers"):
        load_config(None, [*BASE, "eval.ray_workers=2", "eval.seeds=[1,2]", "eval.seed_index=0"], EvalConfig)
    with pytest.raises(ConfigError, match=r"eval.ray_workers: Input should be greater than or equal to 1"):
        load_config(None, [*BASE, "eval.ray_workers=0"], EvalConfig)
    cfg = load_config(None, ["eval.dataset_path=d.jsonl", "eval.save_path=o", "eval.ray_workers=2",
                             "eval.seeds=[3,7]"], EvalConfig)  # each seed is the seed of its group
    assert cfg.eval.on_ray and [(s, c.policy.generation.seed) for s, c in group_configs(cfg)] == [(3, 3), (7, 7)]
    assert not load_config(None, BASE, EvalConfig).eval.on_ray


GYM = [*BASE, "rollouts.mode=nemo_gym"]
LAUNCH = "rollouts.gym.launch={gym_venv: /gym, config_paths: [agents.yaml]}"
RUNNING = ["rollouts.gym.head_server_url=http://127.0.0.1:11000", "rollouts.gym.policy_port=8000"]


def gym_problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*GYM, *overrides], EvalConfig)
    return str(info.value)


def test_ray_workers_in_nemo_gym_mode_launch_a_gym_each_and_refuse_what_is_bound_to_one_port() -> None:
    cfg = load_config(None, [*GYM, LAUNCH, "eval.ray_workers=2"], EvalConfig)  # each worker launches its Gym
    assert cfg.eval.on_ray and cfg.rollouts.gym.launch.mode == "direct"
    msg = gym_problems(LAUNCH, "eval.ray_workers=2", "rollouts.gym.launch.mode=ng_run", "rollouts.gym.policy_port=5000")
    assert "2 problem(s)" in msg
    assert ("rollouts.gym.policy_port: must be 0 (a free port each) with eval.ray_workers=2 would serve 2 policy "
            "servers (one per worker and seed) (got 5000)") in msg
    assert "rollouts.gym.launch.mode: ng_run's head server listens on rollouts.gym.launch.head_server_port" in msg
    assert "use mode direct (got 'ng_run')" in msg
    msg = gym_problems(*RUNNING, "eval.ray_workers=2")  # a running Gym's model server calls one policy URL
    assert "1 problem(s)" in msg and "rollouts.gym.head_server_url: a running Gym's model server calls one " in msg
    assert "use rollouts.gym.launch (each worker starts its own Gym) or eval.ray_workers=1 without eval.seeds" in msg
    assert "(got 'http://127.0.0.1:11000')" in msg
    msg = gym_problems("rollouts.gym.agent_urls={agent_alpha: 'http://127.0.0.1:9'}", "rollouts.gym.policy_port=8000",
                       "eval.ray_workers=1", "eval.seeds=[1,2]")  # one worker, but a policy server per seed
    assert "rollouts.gym.agent_urls: a running Gym's" in msg and "eval.ray_workers=1 x 2 eval.seeds would serve 2" in msg
    with pytest.raises(ConfigError, match=r"gym.launch.mode: ng_run's head server"):  # a Gym per seed, too
        load_config(None, [*GYM, LAUNCH, "rollouts.gym.launch.mode=ng_run", "eval.ray_workers=1", "eval.seeds=[1,2]"],
                    EvalConfig)
    for ok in ([*RUNNING, "eval.ray_workers=1"],  # one policy server: the one Gym calls
               [LAUNCH, "rollouts.gym.launch.mode=ng_run", "eval.ray_workers=1"],
               ["rollouts.gym.agent_urls={agent_alpha: 'http://127.0.0.1:9'}", "rollouts.gym.serve_policy=false",
                "eval.ray_workers=3"]):  # Gym calls another model server: the workers serve none
        assert load_config(None, [*GYM, *ok], EvalConfig).eval.on_ray


def line(p: int, s: int, error: bool = False) -> CompletionLine:
    return CompletionLine(prompt_idx=p, sample_idx=s, agent="math", reward=0.0 if error else 1.0, answer=None,
                          stop_reason="error" if error else "natural", truncated=False, num_turns=1,
                          error="server down" if error else None)


def test_a_resumed_ray_eval_queues_only_prompts_without_a_result_for_every_sample(tmp_path: Path) -> None:
    cfg = load_config(None, [*BASE, f"eval.save_path={tmp_path}", "eval.ray_workers=2"], EvalConfig)
    groups = group_configs(cfg)
    a, b = worker_store(tmp_path, None, 0), worker_store(tmp_path, None, 1)
    for root in (a, b):
        root.mkdir(parents=True)
    CompletionStore(a / "completions.jsonl").append([line(0, 0), line(0, 1), line(1, 0), line(1, 1, error=True)])
    ShardRecord(None, None, 5, {0: 2, 1: 2}, True).write(a)
    # b: prompt 2 complete, prompt 3's lines on disk but not in shard.json (died before it flushed)
    CompletionStore(b / "completions.jsonl").append([line(2, 0), line(2, 1), line(3, 0), line(3, 1)])
    ShardRecord(None, None, 5, {2: 2}, True).write(b)
    todo, skipped, retried = todo_items(tmp_path, groups, 5)
    assert todo == items(1, 3, 4) and skipped == 4 and retried == 1
