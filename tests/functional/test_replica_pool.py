"""RoutedGeneration and RemoteEnvironment on a local Ray (2 CPUs, one session-wide instance).

The hf tests use the tiny model; routing, balance and failure tests use the simulated engine of
nemo_rl_ext.testing.sleep_engine (its first output id names the process that served the request).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import sys
import time

import pytest
import torch
from backend_checks import chat_prompts, forward_logprobs, not_greedy
from tolerances import ENGINE_LOGPROBS

from nemo_rl_ext.cluster import RemoteEnvironment, ReplicaResources, RoutedGeneration
from nemo_rl_ext.data.records import Message
from nemo_rl_ext.environments.interfaces import Observation
from nemo_rl_ext.models.generation import GenerationConfig
from nemo_rl_ext.models.generation.hf_backend import HfGeneration
from nemo_rl_ext.testing import Fault, ScriptedEnvironment, sleep_engine

pytestmark = pytest.mark.timeout(300)

HALF_CPU = ReplicaResources(num_cpus=0.5)
SIM_CPU = ReplicaResources(num_cpus=0.1)


@pytest.fixture(scope="module")
def ray_env(local_ray):
    local_ray.cloudpickle.register_pickle_by_value(sleep_engine)
    local_ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return local_ray


@pytest.fixture(scope="module")
def hf_pool(ray_env, tiny_model_dir, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    factory = functools.partial(HfGeneration.from_pretrained, str(tiny_model_dir), max_model_len=256)
    pool = RoutedGeneration(factory, tokenizer=tokenizer, max_model_len=256, num_replicas=2, resources=HALF_CPU)
    yield pool
    pool.shutdown()


def sim_pool(num_replicas=2, token_s=0.005, max_batch_size=8, **kwargs) -> RoutedGeneration:
    factory = functools.partial(sleep_engine.make_sleep_engine, token_s, max_batch_size)
    return RoutedGeneration(factory, tokenizer=None, max_model_len=4096, num_replicas=num_replicas,
                            resources=SIM_CPU, **kwargs)


def gather(gen, prompts, configs):
    async def go():
        return await asyncio.gather(*(gen.generate_async(p, c) for p, c in zip(prompts, configs, strict=True)))

    return asyncio.run(go())


# ---- outputs ----------------------------------------------------------------------------------


def test_two_replicas_give_the_in_process_backends_outputs(hf_pool, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    local = HfGeneration(model, tokenizer, max_model_len=256)
    prompts = chat_prompts(tokenizer, 6)
    configs = [GenerationConfig(max_new_tokens=12, temperature=t, seed=s, session=(i, 0))
               for i, (t, s) in enumerate([(0.0, None), (1.0, 1), (1.0, 2), (0.7, 3), (1.3, 4), (0.0, None)])]
    try:
        expected = gather(local, prompts, configs)
    finally:
        local.shutdown()
    before = hf_pool.metrics()
    got = gather(hf_pool, prompts, configs)
    after = hf_pool.metrics()
    for prompt, config, want, out in zip(prompts, configs, expected, got, strict=True):
        assert out.output_ids == want.output_ids
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(want.logprobs), **ENGINE_LOGPROBS)
        assert out.weight_version == 0
        ref = forward_logprobs(model, prompt, out.output_ids, config.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, **ENGINE_LOGPROBS)
    served = [after[f"cluster/replica/{i}/requests"] - before[f"cluster/replica/{i}/requests"] for i in (0, 1)]
    assert served == [3, 3], served  # six concurrent requests, least-in-flight: three each


def test_a_refit_reaches_both_replicas(hf_pool, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    prompts = chat_prompts(tokenizer, 8)
    greedy = [GenerationConfig(max_new_tokens=10, temperature=0.0)] * len(prompts)
    old = gather(hf_pool, prompts, greedy)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in trained.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    try:
        before = hf_pool.metrics()
        hf_pool.update_weights(trained.state_dict())
        assert hf_pool.weight_version == 1
        new = gather(hf_pool, prompts, greedy)
        after = hf_pool.metrics()
        served = [after[f"cluster/replica/{i}/requests"] - before[f"cluster/replica/{i}/requests"] for i in (0, 1)]
        assert served == [4, 4], served
        assert all(o.weight_version == 1 for o in new)
        assert sum(a.output_ids != b.output_ids for a, b in zip(old, new, strict=True)) >= len(prompts) // 2
        for prompt, out in zip(prompts, new, strict=True):
            assert not_greedy(trained, prompt, out.output_ids) == []  # the trainer's forward pass agrees
            ref = forward_logprobs(trained, prompt, out.output_ids, 0.0)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, **ENGINE_LOGPROBS)
    finally:
        hf_pool.update_weights(model.state_dict())  # leave the shared pool as the other tests expect
    assert hf_pool.weight_version == 2


def test_a_partial_refit_reaches_both_replicas_and_one_restarted_after_it(hf_pool, tiny_model_and_tokenizer, ray_env):
    """A LoRA refit sends only the merged target modules: both replicas serve them, and a replica killed after it
    restarts from its model folder with that partial update applied on top (the same greedy outputs)."""
    model, tokenizer = tiny_model_and_tokenizer
    prompts = chat_prompts(tokenizer, 8)
    greedy = [GenerationConfig(max_new_tokens=10, temperature=0.0)] * len(prompts)
    trained = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in trained.named_parameters():
            if name.endswith(("q_proj.weight", "v_proj.weight")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    changed = {k: v for k, v in trained.state_dict().items() if k.endswith(("q_proj.weight", "v_proj.weight"))}
    assert hf_pool.accepts_partial_update and 0 < len(changed) < len(model.state_dict()) // 4
    version = hf_pool.weight_version
    try:
        hf_pool.update_weights(changed, partial=True)
        assert hf_pool.weight_version == version + 1
        new = gather(hf_pool, prompts, greedy)
        for prompt, out in zip(prompts, new, strict=True):
            assert not_greedy(trained, prompt, out.output_ids) == []
            torch.testing.assert_close(torch.tensor(out.logprobs), forward_logprobs(trained, prompt, out.output_ids, 0.0),
                                       **ENGINE_LOGPROBS)
        restarts = hf_pool.metrics()["cluster/replica/0/restarts"]
        ray_env.kill(hf_pool._replicas[0].actor)
        again = gather(hf_pool, prompts, greedy)  # the first request to the dead replica restarts it
        after = gather(hf_pool, prompts, greedy)  # both replicas serve, the restarted one included
        assert hf_pool.metrics()["cluster/replica/0/restarts"] == restarts + 1
        for a, b, c in zip(new, again, after, strict=True):
            assert a.output_ids == b.output_ids == c.output_ids
    finally:
        hf_pool.update_weights(model.state_dict())  # leave the shared pool as the other tests expect


def test_a_refit_missing_weights_names_them_and_changes_nothing(hf_pool, tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    version = hf_pool.weight_version
    partial = dict(model.state_dict())
    partial.pop("model.norm.weight")
    with pytest.raises(ValueError, match="lacks"):
        hf_pool.update_weights(partial)
    assert hf_pool.weight_version == version


# ---- routing and balance ----------------------------------------------------------------------


def tag(out) -> int:
    return out.output_ids[0]


def test_a_multi_turn_session_stays_on_its_replica_and_reuses_its_prefix(ray_env):
    pool = sim_pool()
    try:
        async def session(key, turns=4):
            prompt, tags = [1, 2, 3], []
            for _ in range(turns):
                out = await pool.generate_async(prompt, GenerationConfig(max_new_tokens=3, session=key))
                tags.append(tag(out))
                prompt = [*prompt, *out.output_ids, 7, 8]  # the next turn extends this one
            return tags

        tags = asyncio.run(session((0, 0)))
        assert len(set(tags)) == 1
        m = pool.metrics()
        assert m["cluster/session_moves"] == 0
        served = pool.session_replica((0, 0))
        assert m[f"cluster/replica/{served}/prefix_reuse"] == pytest.approx(3 / 4)
    finally:
        pool.shutdown()


def test_sessions_move_when_load_piles_up_and_in_flight_stays_within_the_threshold(ray_env):
    threshold = 2
    pool = sim_pool(token_s=0.01, max_batch_size=2, move_threshold=threshold)
    try:
        async def workload():
            # first turns one after another: sessions alternate replicas (0, 1, 0, 1, ...)
            history = {}
            for s in range(8):
                out = await pool.generate_async([s + 1], GenerationConfig(max_new_tokens=2, session=(s, 0)))
                history[s] = [tag(out)]
            assert len({history[s][0] for s in range(0, 8, 2)}) == 1  # the even sessions share a replica

            async def later_turns(s):
                prompt = [s + 1]
                for turn in range(3):
                    n = 20 if s % 2 == 0 else 2  # the even sessions are long: sticky routing would pile up
                    out = await pool.generate_async(prompt, GenerationConfig(max_new_tokens=n, session=(s, 0)))
                    history[s].append(tag(out))
                    prompt = [*prompt, turn]

            async def one_shots():
                outs = await asyncio.gather(*(pool.generate_async([50 + i], GenerationConfig(max_new_tokens=5))
                                              for i in range(10)))
                return outs

            await asyncio.gather(*(later_turns(s) for s in range(8)), one_shots())
            return history

        history = asyncio.run(workload())
        m = pool.metrics()
        changes = sum(sum(a != b for a, b in zip(tags[:-1], tags[1:], strict=True)) for tags in history.values())
        assert m["cluster/session_moves"] >= 1
        assert changes == m["cluster/session_moves"]  # every change of replica is a counted move
        assert sum(len(set(t)) == 1 for t in history.values()) >= 1  # sessions not moved stayed put
        assert m["cluster/in_flight_spread/max"] <= threshold
        assert m["cluster/retries"] == 0
    finally:
        pool.shutdown()


# ---- failures ---------------------------------------------------------------------------------


def test_a_killed_replica_loses_no_request(ray_env):
    pool = sim_pool(token_s=0.005, max_batch_size=4)
    try:
        first_tags = {info["pid"] for info in pool.replica_info}
        victim = pool._replicas[0].actor

        async def run():
            prompts = [[1000 + i] for i in range(40)]
            tasks = [asyncio.ensure_future(pool.generate_async(p, GenerationConfig(max_new_tokens=20)))
                     for p in prompts]
            await asyncio.sleep(0.15)
            ray_env.kill(victim)
            return prompts, await asyncio.gather(*tasks)

        prompts, outs = asyncio.run(run())
        assert len(outs) == 40
        for prompt, out in zip(prompts, outs, strict=True):  # each answer belongs to its own prompt
            assert len(out.output_ids) == 20
            assert out.output_ids[1] == (prompt[0] + 1) % 1000
        m = pool.metrics()
        assert m["cluster/replica/0/retries"] >= 1
        assert m["cluster/replica/0/restarts"] == 1
        assert m["cluster/requests"] == 40 + m["cluster/retries"]
        # the restarted replica serves again, from a new process
        outs = gather(pool, [[i] for i in range(8)], [GenerationConfig(max_new_tokens=2)] * 8)
        tags = {tag(o) for o in outs}
        assert len(tags) == 2 and len(tags - first_tags) == 1
    finally:
        pool.shutdown()


def flaky_engine(marker: str):
    """The simulated engine, unless `marker` exists (then building it fails, as a broken replica does)."""
    if os.path.exists(marker):
        raise RuntimeError("this replica cannot start")
    return sleep_engine.SleepGeneration(token_s=0.002)


def test_a_replica_that_keeps_failing_is_taken_out(ray_env, tmp_path, caplog):
    marker = tmp_path / "broken"
    pool = RoutedGeneration(functools.partial(flaky_engine, str(marker)), tokenizer=None, max_model_len=4096,
                            num_replicas=2, resources=SIM_CPU, max_failures=2)
    try:
        marker.touch()
        ray_env.kill(pool._replicas[0].actor)
        for _ in range(3):  # the restarted replica fails to start; its requests go to the other one
            outs = gather(pool, [[i] for i in range(12)], [GenerationConfig(max_new_tokens=3)] * 12)
            assert len(outs) == 12 and all(len(o.output_ids) == 3 for o in outs)
        m = pool.metrics()
        assert m["cluster/replica/0/live"] == 0 and m["cluster/replicas_live"] == 1
        assert "generation replica 0 taken out after 2 failures in a row" in caplog.text
    finally:
        pool.shutdown()


# ---- remote environments ----------------------------------------------------------------------


class HangingEnvironment(ScriptedEnvironment):
    """Answers with its process id; a rollout whose metadata says "hang" blocks the actor for good (a hang no
    asyncio timeout inside the actor could interrupt). With `slow_start` set to a file that exists, the
    constructor takes 3 s (an actor that starts slowly: imports, a sandbox, a loaded machine)."""

    def __init__(self, slow_start: str | None = None) -> None:
        if slow_start is not None and os.path.exists(slow_start):
            time.sleep(3.0)
        super().__init__(reward=1.0, observation=Observation("user", "ok"), metadata=lambda s: {"pid": os.getpid()},
                         fault=lambda s: Fault.BLOCK if s.metadata.get("hang") else None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_hung_environment_step_is_killed_and_restarted_within_the_timeout(ray_env, tmp_path):
    """The replacement actor starts slowly (3 s, longer than the 2 s step deadline): its start is waited for
    under `ready_timeout_s`, and its first step still gets the whole step deadline."""
    slow = tmp_path / "slow-start"
    env = RemoteEnvironment(functools.partial(HangingEnvironment, str(slow)), step_timeout_s=2.0)
    log = [Message("user", "hi", (1, 2))]
    try:
        first = asyncio.run(env.step([log], [None]))
        pid = first.metadata[0]["pid"]
        assert first.rewards == [1.0]
        slow.write_text("")  # every actor started from now on takes 3 s to start
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="killed and restarted"):
            asyncio.run(env.step([log], [{"hang": True}]))
        assert time.monotonic() - start < 2.0 + 1.0
        assert env.timeouts == 1 and env.restarts == 1
        again = asyncio.run(env.step([log], [None]))  # the fresh actor serves
        assert again.rewards == [1.0] and again.metadata[0]["pid"] != pid
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the hung actor's process is still running"
    finally:
        env.shutdown()


def test_the_local_ray_listens_and_connects_on_loopback_only(hf_pool):
    """Every socket of the session's Ray processes (GCS, raylet, workers, the pool's actors) is bound to
    127.0.0.1 and talks to 127.0.0.1: nothing listens on another interface of the machine."""
    import psutil
    import ray

    assert {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]} == {"127.0.0.1"}
    ray_procs = [
        p for p in psutil.process_iter(["name", "cmdline"])
        if any(k in (p.info["name"] or "") for k in ("gcs_server", "raylet", "ray::"))
        or "ray/_private/workers" in " ".join(p.info["cmdline"] or ())
    ]
    assert len(ray_procs) >= 3  # GCS, raylet and the replicas at least
    seen = []
    for proc in ray_procs:
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            addrs = [c.laddr.ip] + ([c.raddr.ip] if c.raddr else [])
            seen += [(proc.info["name"], a) for a in addrs]
    assert seen, "no socket of a Ray process was found"
    off_loopback = [(name, a) for name, a in seen if a not in ("127.0.0.1", "::ffff:127.0.0.1")]
    assert not off_loopback, off_loopback
