"""The lease queue of an eval on Ray workers (without Ray), the eval.ray_workers rules, which prompts a resumed Ray
eval queues again, what the driver does with a dead worker's store, and a worker (its `run`, in this process) that
retries a prompt's error samples."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.merge import merge_run
from nemo_rl_ext.evals.plan import group_configs
from nemo_rl_ext.evals.prompt_queue import PromptQueue
from nemo_rl_ext.evals.ray_stores import DeadWorker, plan_queue, settle_dead_worker, worker_store
from nemo_rl_ext.evals.ray_worker import EvalWorker
from nemo_rl_ext.evals.shards import ShardRecord
from nemo_rl_ext.evals.store import CompletionStore
from nemo_rl_ext.experience.native_rollouts import rollout_seed
from nemo_rl_ext.testing import ScriptedGeneration

REPO = Path(__file__).resolve().parents[3]

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


def test_a_lease_a_dead_worker_asked_for_while_dying_takes_nothing() -> None:
    """The driver releases a dead worker before the lease request it sent while dying reaches the queue (two
    callers of one Ray actor: no order between them). That lease must take nothing: the item would stay leased
    to a worker that is never released again, and the run would wait for it for ever (seen in CI: 400 s)."""
    queue = PromptQueue([(0, 0), (0, 1), (0, 2)])
    assert queue.lease("worker-0.0") == [(0, 0)] and queue.lease("worker-1.0") == [(0, 1)]
    queue.complete("worker-1.0", [(0, 1)])
    assert queue.release("worker-1.0", done=[(0, 1)]) == []
    assert queue.lease("worker-1.0") is None  # the dying worker's late request: stop, take nothing
    assert queue.status().leased == {"worker-0.0": 1} and queue.status().pending == 1
    assert queue.lease("worker-1.1") == [(0, 2)]  # its next incarnation leases under a name of its own
    queue.complete("worker-0.0", [(0, 0)])
    queue.complete("worker-1.1", [(0, 2)])
    assert queue.status().finished and queue.lease("worker-0.0") is None


def test_an_expired_lease_is_reported_once_and_goes_back_only_when_its_worker_is_released() -> None:
    clock = Clock()
    queue = PromptQueue(items(0, 1, 2), lease_timeout_s=10, clock=clock)
    assert queue.lease("hung") == items(0)
    clock.now = 5
    assert queue.lease("ok") == items(1)
    clock.now = 11
    assert queue.expire() == {"hung": items(0)}  # "ok" leased at 5: 6 s old, kept
    assert queue.expire() == {}  # reported once: the driver is killing it
    assert queue.status().leased == {"hung": 1, "ok": 1}  # still hung's: it may still write it until it is dead
    assert queue.lease("ok", 3) == items(2)  # not item 0
    assert queue.release("hung") == items(0)  # dead now: back to the queue
    assert queue.lease("ok") == items(0)
    queue.complete("ok", items(0, 1, 2))
    assert queue.lease("ok") is None and queue.status().requeued == 1
    assert PromptQueue(items(0), lease_timeout_s=None).expire() == {}


def test_a_dead_workers_prompts_on_disk_are_done_and_the_rest_go_back_with_their_skips() -> None:
    queue = PromptQueue(items(*range(5)), skips={(0, 4): [1]})
    assert queue.lease("a", 3) == items(0, 1, 2)
    assert queue.skip_samples(items(0, 1, 2, 3, 4)) == {(0, 4): frozenset({1})}
    # a died: its store holds every line of 0 and 1 (not reported yet), and sample 0 of 2
    assert queue.release("a", done=items(0, 1), skips={(0, 2): {0}}) == items(2)
    status = queue.status()
    assert (status.done, status.pending, status.requeued) == (2, 3, 1)
    assert queue.lease("b", 5) == items(2, 3, 4)  # 0 and 1 are never leased again
    assert queue.skip_samples(items(2, 4)) == {(0, 2): frozenset({0}), (0, 4): frozenset({1})}


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


def listed(root: Path) -> list[int]:
    record = ShardRecord.read(root)
    assert record is not None
    return sorted(record.samples)


def test_a_resumed_ray_eval_queues_from_the_lines_on_disk_with_skips_and_lists_them(tmp_path: Path) -> None:
    cfg = load_config(None, [*BASE, f"eval.save_path={tmp_path}", "eval.ray_workers=2",
                             "rollouts.num_generations_per_prompt=2", "rollouts.max_rollout_turns=1"], EvalConfig)
    groups = group_configs(cfg)
    a, b = worker_store(tmp_path, None, 0), worker_store(tmp_path, None, 1)
    for root in (a, b):
        root.mkdir(parents=True)
    CompletionStore(a / "completions.jsonl").append([line(0, 0), line(0, 1), line(1, 0), line(1, 1, error=True)])
    ShardRecord(None, None, 6, {0: 2, 1: 2}, True).write(a)
    # b: prompt 2 complete; prompt 3's lines on disk but not in shard.json (it died before it flushed); of prompt
    # 5 only sample 0 (a kill cut the group short)
    CompletionStore(b / "completions.jsonl").append([line(2, 0), line(2, 1), line(3, 0), line(3, 1), line(5, 0)])
    ShardRecord(None, None, 6, {2: 2}, True).write(b)
    plan = plan_queue(tmp_path, groups, 6)
    assert plan.items == items(1, 4, 5)  # 3 is done: never rolled out into a second store
    assert plan.skips == {(0, 1): frozenset({0}), (0, 5): frozenset({0})}  # the retry appends only the others
    assert (plan.skipped, plan.retried) == (8, 1)
    assert listed(a) == [0, 1] and listed(b) == [2, 3]  # every prompt on disk is in its store's shard.json
    # a retry of prompt 1's error sample landed in b: prompt 1 is done, from two stores
    CompletionStore(b / "completions.jsonl").append([line(1, 1)])
    plan = plan_queue(tmp_path, groups, 6)
    assert plan.items == items(4, 5) and (plan.skipped, plan.retried) == (9, 0)
    assert listed(b) == [1, 2, 3]


def test_a_dead_workers_complete_prompts_are_listed_and_done_the_rest_requeued_with_skips(tmp_path: Path) -> None:
    cfg = load_config(None, [*BASE, f"eval.save_path={tmp_path}", "eval.ray_workers=2",
                             "rollouts.num_generations_per_prompt=2", "rollouts.max_rollout_turns=1"], EvalConfig)
    groups = group_configs(cfg)
    dead = worker_store(tmp_path, None, 1)
    dead.mkdir(parents=True)
    queue = PromptQueue(items(*range(6)), skips={(0, 1): {0}})  # sample 0 of prompt 1 is in another store
    assert queue.lease("worker-1", 4) == items(0, 1, 2, 3)
    queue.complete("worker-1", items(0))
    ShardRecord(None, None, 6, {0: 2}, True).write(dead)
    # it wrote prompt 2 and the retry of prompt 1 (sample 1 only) but died before reporting them, and only
    # sample 0 of prompt 3 reached the disk
    CompletionStore(dead / "completions.jsonl").append([line(0, 0), line(0, 1), line(2, 0), line(2, 1), line(1, 1),
                                                         line(3, 0)])
    settled = settle_dead_worker(tmp_path, groups, 1, 6, {(0, 1): frozenset({0})})
    assert settled.done == items(0, 1, 2) and settled.recovered == items(1, 2)
    assert settled.skips == {(0, 3): frozenset({0})}
    assert listed(dead) == [0, 1, 2]
    assert queue.release("worker-1", settled.done, settled.skips) == items(3)  # only what the store lacks
    assert queue.lease("worker-0", 6) == items(3, 4, 5) and queue.skip_samples(items(3)) == {(0, 3): frozenset({0})}
    never = settle_dead_worker(tmp_path, groups, 7, 6, {})  # a worker that never opened its store
    assert never == DeadWorker([], [], {}) and not worker_store(tmp_path, None, 7).exists()
    early = worker_store(tmp_path, None, 2)  # one that died after writing its config, before its shard.json
    early.mkdir()
    (early / "config.yaml").write_text("{}")
    assert settle_dead_worker(tmp_path, groups, 2, 6, {}) == DeadWorker([], [], {})
    assert ShardRecord.read(early) is None  # without its dataset fingerprint the merge must refuse it: left as is
    (early / "dataset_fingerprint.json").write_text("{}")
    assert settle_dead_worker(tmp_path, groups, 2, 6, {}) == DeadWorker([], [], {})
    assert listed(early) == []  # an empty store, not one the merge calls unstarted


def test_a_resumed_runs_dead_worker_neither_ends_the_queue_early_nor_drops_a_retry(tmp_path: Path) -> None:
    """A resumed run queues only prompts 2 (an error sample to retry) and 3. The worker that dies holds prompts 0
    and 1, complete in its store from the earlier run, and prompt 2's error line: none of them may count as done
    (0 and 1 were never queued; 2 still has no result), or the queue would end before 3 is done, or never end."""
    cfg = load_config(None, [*BASE, f"eval.save_path={tmp_path}", "eval.ray_workers=2",
                             "rollouts.num_generations_per_prompt=2", "rollouts.max_rollout_turns=1"], EvalConfig)
    groups = group_configs(cfg)
    dead = worker_store(tmp_path, None, 1)
    dead.mkdir(parents=True)
    CompletionStore(dead / "completions.jsonl").append(
        [line(0, 0), line(0, 1), line(1, 0), line(1, 1), line(2, 0), line(2, 1, error=True)])
    ShardRecord(None, None, 4, {0: 2, 1: 2, 2: 2}, True).write(dead)
    plan = plan_queue(tmp_path, groups, 4)
    assert plan.items == items(2, 3) and plan.skips == {(0, 2): frozenset({0})} and plan.retried == 1
    queue = PromptQueue(plan.items, skips=plan.skips)
    assert queue.lease("worker-0", 1) == items(2)  # the live worker retries prompt 2's error sample
    assert queue.lease("worker-1", 1) == items(3)
    settled = settle_dead_worker(tmp_path, groups, 1, 4, plan.skips)
    assert settled.done == items(0, 1)  # complete with results; prompt 2's error line does not make it done
    assert queue.release("worker-1", settled.done, settled.skips) == items(3)
    status = queue.status()
    assert (status.done, status.total, status.pending) == (0, 2, 1)  # 0 and 1 were never this queue's
    assert queue.lease("worker-0", 2) == items(3)
    queue.complete("worker-0", items(2, 3))
    assert queue.status().finished and queue.lease("worker-0") is None


class Local:
    """A PromptQueue called the way a Ray actor's handle is (`await queue.lease.remote(...)`), in this process."""

    def __init__(self, queue: PromptQueue) -> None:
        self.queue = queue

    def __getattr__(self, name: str) -> SimpleNamespace:
        method = getattr(self.queue, name)

        async def remote(*args: Any) -> Any:
            return method(*args)

        return SimpleNamespace(remote=remote)


async def run_worker(k: int, cfg: EvalConfig, reply: Any, queue: PromptQueue, tok: Any) -> Path:
    """Worker k (no Ray: its `run` in this process) over `queue` into its store."""
    root = worker_store(Path(cfg.eval.save_path), None, k)
    worker = EvalWorker(f"worker-{k}", cfg, engine_factory=lambda: ScriptedGeneration(tok, reply), torch_threads=None)
    try:
        await worker.run([(cfg, str(root))], Local(queue), 1)
    finally:
        await worker.shutdown()
    return root


def keys_of(root: Path) -> list[tuple[int, int]]:
    return [(x["prompt_idx"], x["sample_idx"]) for x in map(json.loads, (root / "completions.jsonl").read_text().splitlines())]


@pytest.mark.usefixtures("no_report_plots")
async def test_a_retried_prompt_appends_only_the_samples_no_store_has_and_the_merge_takes_the_union(
    tiny_model_and_tokenizer, tmp_path: Path
) -> None:
    _, tok = tiny_model_and_tokenizer

    def cfg(save: Path) -> EvalConfig:
        return load_config(None, [f"eval.save_path={save}", f"eval.dataset_path={REPO / 'examples/data/arithmetic.jsonl'}",
                                  "eval.num_prompts=3", "rollouts.num_generations_per_prompt=2",
                                  "rollouts.max_rollout_turns=1", "policy.generation.seed=0",
                                  "eval.ray_workers=2", "policy.model_name=unused"], EvalConfig)

    def reply(request) -> str:
        return str(request.config.seed % 7)

    def flaky(request) -> str:  # sample 1 of prompt 1 fails
        if request.config.seed == rollout_seed(0, 1, 1, 0):
            raise RuntimeError("engine down")
        return reply(request)

    run = tmp_path / "run"
    first = await run_worker(0, cfg(run), flaky, PromptQueue(items(0, 1, 2)), tok)
    assert keys_of(first) == [(p, s) for p in range(3) for s in range(2)] and listed(first) == [0, 1, 2]
    plan = plan_queue(run, group_configs(cfg(run)), 3)
    assert plan.items == items(1) and plan.skips == {(0, 1): frozenset({0})} and plan.retried == 1
    retry = await run_worker(1, cfg(run), reply, PromptQueue(plan.items, skips=plan.skips), tok)
    assert keys_of(retry) == [(1, 1)] and listed(retry) == [1]  # not sample 0: the first store has its result
    merged = merge_run(run)
    assert merged.summary.num_errors == 0 and merged.summary.num_completions == 6
    clean = await run_worker(0, cfg(tmp_path / "clean"), reply, PromptQueue(items(0, 1, 2)), tok)
    merge_run(tmp_path / "clean")
    assert (run / "completions.jsonl").read_bytes() == (tmp_path / "clean" / "completions.jsonl").read_bytes()
    assert keys_of(clean) == keys_of(run)
    timings = [json.loads(x) for x in (run / "timings.jsonl").read_text().splitlines()]
    assert [(t["prompt_idx"], t["sample_idx"]) for t in timings] == keys_of(run)  # the retry's, not the error's
    assert merged.summary.profile.overall.latency_s.num_samples == 6
