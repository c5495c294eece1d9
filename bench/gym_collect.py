"""Gym rollout collection: our client against NeMo Gym's own `ng_collect_rollouts`, same rows, same servers.

    python bench/gym_collect.py            # 5 rows x 80 repeats = 400 rollouts per contender, 3 rounds
    python bench/gym_collect.py --quick    # 5 rows x 8 repeats, 1 round

Set-up (all on 127.0.0.1 except Ray, see below), torn down at the end whatever happens:

- the Gym venv from `scripts/setup_nemo_gym.sh` (built once, ~2.5 min; then instant);
- an instant model server in its own process: our `PolicyServer` over a fake `GenerationInterface` that
  answers at once with real token ids of the tiny model's tokenizer: a `get_weather` tool call on the
  first turn, a short final answer after the tool result (the ids of the text, `<|im_end|>` last);
- NeMo Gym started with `ng_run` (`GymLauncher`, mode `ng_run`) on `tests/functional/gym_configs/two_agents.yaml`:
  agents `agent_alpha`, `agent_beta` (simple_agent), the `example_single_tool_call` resources server, the
  `vllm_model` model server pointed at the instant server, the two environment servers that
  `ng_collect_rollouts` routes through, and a head server. ng_run also starts a Ray cluster, which listens
  on every interface (docs/nemo_gym.md P1): fine for a manual benchmark, not for CI.

Each rollout is two model calls, one tool call, `/seed_session` and `/verify`. The contenders send the same
rows (`tests/data/gym/collector-input.jsonl`, rows alternately routed to agent_alpha and agent_beta) with the
same `num_repeats` and the same concurrency, through the same head server:

- `ng_collect_rollouts` as documented (docs/nemo_gym.md section 6), run as a command. Its whole wall time
  includes the CLI start-up, writing its files, `/aggregate_metrics` and its rollout health report; its own
  timer ("Finished N / N rollouts ... (X rollouts/min)", printed when the last rollout is back) gives the
  collection phase alone, so start-up and post-processing are reported separately.
- `GymClient.run` (ours): every repeat of every row, concurrently, limited by `max_concurrency`.
- `RolloutManager(use_nemo_gym=True)` (ours): the same, plus turning every result into token-exact records.

Rounds alternate the order; the table shows medians and, last, the ratio to ng_collect_rollouts'
collection phase (rollouts/s of the contender / rollouts/s of ng_collect_rollouts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_line, median, print_table, spread  # noqa: E402

from nemo_rl_ext.models.generation.interfaces import FinishReason, GenerationConfig  # noqa: E402
from nemo_rl_ext.testing import ScriptedGeneration  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GYM_CONFIG = REPO / "tests" / "functional" / "gym_configs" / "two_agents.yaml"
ROWS = REPO / "tests" / "data" / "gym" / "collector-input.jsonl"
AGENTS = ("agent_alpha", "agent_beta")
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "sf"}}\n</tool_call><|im_end|>'
FINAL = "It is cold in sf, so take a warm coat tonight.<|im_end|>"
FINISHED = re.compile(r"Finished (\d+) / (\d+) rollouts \(100%\) in [0-9:]+ \(([0-9.]+) rollouts/min\)")


# ---- the instant model server (runs in its own process) ------------------------------------------------


def instant_tool_policy(tokenizer) -> ScriptedGeneration:
    """Answers at once with the real ids of a scripted turn: a tool call first, then a final answer."""
    return ScriptedGeneration(tokenizer, [TOOL_CALL, FINAL], finish_reason=FinishReason.EOS, logprobs=-0.25,
                              record=False)


def tiny_tokenizer():
    from nemo_rl_ext.models.config import PolicyConfig
    from nemo_rl_ext.models.loading import load_tokenizer
    from nemo_rl_ext.models.policy import resolve_model_path

    return load_tokenizer(resolve_model_path(PolicyConfig(model_name="tiny")))


def serve_policy(port: int) -> None:
    """Entry point of the policy-server process: serve until SIGTERM."""
    from nemo_rl_ext.serving.policy_server import PolicyServer

    tokenizer = tiny_tokenizer()
    server = PolicyServer(instant_tool_policy(tokenizer), tokenizer, port=port, served_model_name="policy")
    server.start()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print(f"ready {server.base_url}", flush=True)
    while not stop:
        time.sleep(0.2)
    server.stop()


# ---- the contenders --------------------------------------------------------------------------------------


def gym_rows() -> list[dict]:
    """The collector-input rows, alternately for agent_alpha and agent_beta."""
    from nemo_rl_ext.data.datasets import load_jsonl

    return [{**row, "agent_ref": {"name": AGENTS[i % 2]}} for i, row in enumerate(load_jsonl(ROWS))]


def expanded(rows: list[dict], repeats: dict[str, int]) -> list[dict]:
    """Every repeat of every row, with Gym's task / rollout indices (what ng_collect_rollouts sends)."""
    return [
        {**row, "_ng_task_index": i, "_ng_rollout_index": r}
        for i, row in enumerate(rows)
        for r in range(repeats[row["agent_ref"]["name"]])
    ]


def run_ng_collect(gym_venv: Path, head_port: int, work: Path, tag: str, repeats: dict[str, int],
                   concurrency: int, n_expected: int, env: dict[str, str]) -> dict:
    """ng_collect_rollouts as documented; returns whole wall time and its own collection-phase time."""
    from nemo_rl_ext.data.datasets import load_jsonl

    cwd = work / f"collect-{tag}"
    cwd.mkdir(parents=True)
    (cwd / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gym_rows()))
    out = cwd / "out.jsonl"
    repeats_arg = "{" + ",".join(f"{k}:{v}" for k, v in repeats.items()) + "}"
    cmd = [str(gym_venv / "bin" / "ng_collect_rollouts"), f"+head_server.port={head_port}",
           "+input_jsonl_fpath=in.jsonl", f"+output_jsonl_fpath={out}", f"+num_repeats={repeats_arg}",
           f"+num_samples_in_parallel={concurrency}"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=600)
    finally:
        stop_process_group(proc)  # its health-check workers too, if it was interrupted
    wall = time.perf_counter() - start
    (cwd / "collect.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"ng_collect_rollouts failed (rc {proc.returncode}); log {cwd / 'collect.log'}:\n"
                           f"{log[-3000:]}")
    match = FINISHED.findall(log)
    if not match:
        raise RuntimeError(f"no 'Finished N / N rollouts (100%)' line in {cwd / 'collect.log'}")
    done, total, per_min = match[-1]
    results = load_jsonl(out)
    assert int(done) == int(total) == n_expected == len(results), (done, total, n_expected, len(results))
    assert all("reward" in r for r in results)
    return {"wall": wall, "collection": int(done) / float(per_min) * 60, "rollouts": len(results),
            "reward": sum(r["reward"] for r in results) / len(results)}


async def run_gym_client(head_url: str, rows: list[dict], concurrency: int) -> dict:
    from nemo_rl_ext.gym.client import GymClient

    client = GymClient(head_server_url=head_url, max_concurrency=concurrency, row_timeout_s=120, max_attempts=1)
    try:
        await client.agent_urls()  # discovery, before the clock (ng_collect_rollouts' timer starts later too)
        start = time.perf_counter()
        results = await asyncio.gather(*(client.run(r, label=f"row {i}") for i, r in enumerate(rows)))
        seconds = time.perf_counter() - start
    finally:
        await client.aclose()
    return {"collection": seconds, "rollouts": len(results),
            "reward": sum(r["reward"] for r in results) / len(results)}


async def run_manager(head_url: str, rows: list[dict], repeats: dict[str, int], concurrency: int,
                      tokenizer) -> dict:
    from nemo_rl_ext.data.datasets import gym_datums
    from nemo_rl_ext.data.records import StopReason
    from nemo_rl_ext.experience.rollout_manager import RolloutManager

    manager = RolloutManager(
        tokenizer, task_to_env=None, num_generations_per_prompt=repeats, max_seq_len=4096,
        policy_generation=instant_tool_policy(tokenizer), generation_config=GenerationConfig(max_new_tokens=256),
        use_nemo_gym=True,
        gym_config={"head_server_url": head_url, "serve_policy": False, "max_concurrency": concurrency,
                    "row_timeout_s": 120, "max_attempts": 1},
    )
    datums = gym_datums(rows)
    try:
        await (await manager.impl.client()).agent_urls()  # discovery, before the clock
        start = time.perf_counter()
        records, metrics = await manager.run_rollouts(datums, progress=False)
        seconds = time.perf_counter() - start
    finally:
        await manager.shutdown()
    completions = [c for r in records for c in r.completions]
    errors = [c.error for c in completions if c.stop_reason is StopReason.ERROR]
    assert not errors, errors[:3]
    return {"collection": seconds, "rollouts": len(completions), "reward": metrics["rollout/reward/mean"]}


# ---- the driver ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_gym_venv() -> Path:
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup_nemo_gym.sh")], capture_output=True, text=True,
                         timeout=1200)
    if out.returncode != 0:
        raise RuntimeError(f"scripts/setup_nemo_gym.sh failed:\n{out.stderr[-3000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def start_policy_process(port: int, log: Path) -> subprocess.Popen:
    fh = log.open("w")
    proc = subprocess.Popen([sys.executable, __file__, "--serve-policy", str(port)], stdout=subprocess.PIPE,
                            stderr=fh, text=True, start_new_session=True)
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"the policy server did not start; see {log}")
    return proc


def stop_process_group(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 repeats per row, 1 round")
    parser.add_argument("--repeats", type=int, default=None, help="num_repeats for both agents (default 80)")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (both sides)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 1)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (server and ng_collect logs)")
    parser.add_argument("--serve-policy", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_policy is not None:
        serve_policy(args.serve_policy)
        return
    n_rep = args.repeats or (8 if args.quick else 80)
    rounds = args.rounds or (1 if args.quick else 3)
    repeats = {agent: n_rep for agent in AGENTS}
    rows = gym_rows()
    sends = expanded(rows, repeats)
    print(machine_line())

    from nemo_rl_ext.gym.config import GymLaunchConfig
    from nemo_rl_ext.gym.launcher import GymLauncher

    t0 = time.perf_counter()
    gym_venv = setup_gym_venv()
    version = subprocess.run([str(gym_venv / "bin" / "python"), "-c",
                              "import importlib.metadata as m, sys; print(m.version('nemo-gym'), sys.version.split()[0])"],
                             capture_output=True, text=True, timeout=60).stdout.split()
    print(f"NeMo Gym {version[0]} on Python {version[1]} ({gym_venv}); set-up check {time.perf_counter() - t0:.1f} s")
    print(f"workload: {len(rows)} rows x {n_rep} repeats = {len(sends)} rollouts per contender "
          f"(2 model calls + 1 tool call each), concurrency {args.concurrency}, {rounds} round(s)")
    work = Path(tempfile.mkdtemp(prefix="bench-gym-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on SIGTERM too
    tokenizer = tiny_tokenizer()
    policy = launcher = None
    ok = False
    head_port = free_port()
    results: dict[str, list[dict]] = {"ng": [], "client": [], "manager": []}
    try:
        policy_port = free_port()
        policy = start_policy_process(policy_port, work / "policy.log")
        launcher = GymLauncher(
            GymLaunchConfig(mode="ng_run", gym_venv=gym_venv, config_paths=(GYM_CONFIG,), head_server_port=head_port,
                            startup_timeout_s=300, work_dir=work / "gym"),
            policy_base_url=f"http://127.0.0.1:{policy_port}/v1", policy_model_name="policy",
        )
        t0 = time.perf_counter()
        launcher.start()
        print(f"ng_run up in {time.perf_counter() - t0:.1f} s (head server 127.0.0.1:{head_port})", flush=True)
        head_url = f"http://127.0.0.1:{head_port}"
        env = os.environ.copy()
        env["RAY_TMPDIR"] = str(launcher.ray_tmpdir)  # the cluster ng_run started, never another one
        asyncio.run(run_gym_client(head_url, expanded(rows, {a: 2 for a in AGENTS}), args.concurrency))  # warm-up
        for r in range(rounds):
            order = ["ng", "client", "manager"]
            order = order[r % 3:] + order[: r % 3]
            for name in order:
                if name == "ng":
                    res = run_ng_collect(gym_venv, head_port, work, str(r), repeats, args.concurrency, len(sends), env)
                elif name == "client":
                    res = asyncio.run(run_gym_client(head_url, sends, args.concurrency))
                else:
                    res = asyncio.run(run_manager(head_url, rows, repeats, args.concurrency, tokenizer))
                assert res["rollouts"] == len(sends), (name, res)
                assert res["reward"] == 1.0, (name, res)  # every rollout made its get_weather call
                results[name].append(res)
                extra = f", whole command {res['wall']:.1f} s" if "wall" in res else ""
                print(f"  round {r + 1}/{rounds} {name:>7}: {res['rollouts'] / res['collection']:6.1f} rollouts/s "
                      f"({res['collection']:.2f} s{extra})", flush=True)
        ok = True
    finally:
        t0 = time.perf_counter()
        if launcher is not None:
            launcher.stop()
        stop_process_group(policy)
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        print(f"servers stopped in {time.perf_counter() - t0:.1f} s" + ("" if ok and not args.keep else f"; logs in {work}"))

    n = len(sends)
    ng_rate = [n / res["collection"] for res in results["ng"]]
    table = []
    whole = [n / res["wall"] for res in results["ng"]]
    table.append(["ng_collect_rollouts, whole command (CLI start-up, files, aggregation, health report)",
                  f"{median([res['wall'] for res in results['ng']]):.2f}", f"{median(whole):.1f}",
                  _ratio(whole, ng_rate)])
    rows_spec = [("ng", "ng_collect_rollouts, collection phase (its own timer)"),
                 ("client", "GymClient.run (ours)"),
                 ("manager", "RolloutManager(use_nemo_gym=True) (ours, with records)")]
    for key, label in rows_spec:
        rate = [n / res["collection"] for res in results[key]]
        table.append([label, f"{median([res['collection'] for res in results[key]]):.2f}", f"{median(rate):.1f}",
                      _ratio(rate, ng_rate)])
    print_table(["contender", "seconds", "rollouts/s", "ratio to ng_collect_rollouts collection (min-max)"], table,
                title=f"Gym rollout collection, {n} rollouts, concurrency {args.concurrency} "
                      f"(medians of {rounds} round(s); target ours >= 1.0)")
    startup = [res["wall"] - res["collection"] for res in results["ng"]]
    client_rate = [n / res["collection"] for res in results["client"]]
    print(f"ng_collect_rollouts outside its collection phase (start-up + post-processing): {median(startup):.1f} s; "
          f"GymClient vs the whole ng_collect_rollouts command: {_ratio(client_rate, whole)}")


def _ratio(values: list[float], reference: list[float]) -> str:
    ratios = [a / b for a, b in zip(values, reference, strict=True)]
    return f"{median(ratios):.2f} ({spread(ratios)})"


if __name__ == "__main__":
    main()
