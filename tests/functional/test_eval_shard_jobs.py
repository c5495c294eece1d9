"""Sharded and seeded evals on the tiny model, the shards as separate `run_eval.py` processes: the merged files
equal those of one shard and of an unsharded run; a shard killed with SIGKILL resumes its slice; the merge
refuses what is missing or unfinished, naming it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_env import one_thread_env

from nemo_rl_ext.config import load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.driver import run_eval
from nemo_rl_ext.evals.shards import ShardSpec

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, str(REPO / "examples" / "run_eval.py")]
NUM_PROMPTS = 24
SAMPLES = 2



def same_summary(a: Path, b: Path) -> bool:
    """Byte-identical summary.json files apart from the measured latencies (`profile.*.latency_s`), which are
    wall-clock times; everything else is computed from the completions."""
    from nemo_rl_ext.evals.profile import untimed_bytes

    left, right = untimed_bytes(a.read_bytes()), untimed_bytes(b.read_bytes())
    assert left == right, (a, b)
    return True


LATENCY_ROW = "| rollout latency s (p50 / p95) |"
"""The one row of report.md that shows measured numbers (its reward-profile table's latencies)."""


def untimed_report(folder: Path) -> str:
    """report.md with the numbers of its latency row removed."""
    text = (folder / "report.md").read_text()
    assert text.count(LATENCY_ROW) == 1, folder
    return "\n".join(LATENCY_ROW if x.startswith(LATENCY_ROW) else x for x in text.splitlines())


def same_report(a: Path, b: Path) -> bool:
    """The folders' report.md equal byte for byte but for the latency row's numbers, and their difficulty.jsonl
    equal byte for byte."""
    assert untimed_report(a) == untimed_report(b), (a, b)
    assert (a / "difficulty.jsonl").read_bytes() == (b / "difficulty.jsonl").read_bytes(), (a, b)
    return True


def timings_complete(folder: Path, num_samples: int) -> bool:
    """The folder's timings.jsonl has one entry (a measured latency) per line of its completions.jsonl, in the same
    order, and its summary's latencies count every sample (`num_samples`, none of them an error)."""
    keys = [(x["prompt_idx"], x["sample_idx"]) for x in map(json.loads, (folder / "completions.jsonl").read_bytes().splitlines())]
    timings = [json.loads(x) for x in (folder / "timings.jsonl").read_bytes().splitlines()]
    assert [(t["prompt_idx"], t["sample_idx"]) for t in timings] == keys, folder
    assert all(isinstance(t["latency_s"], float) and t["latency_s"] > 0 for t in timings), folder
    profile = json.loads((folder / "summary.json").read_bytes())["profile"]
    assert profile["overall"]["latency_s"]["num_samples"] == len(keys) == num_samples, folder
    assert sum(t["latency_s"]["num_samples"] for t in profile["tasks"].values()) == num_samples, folder
    return True


def overrides(tiny_model_dir: Path, save_path: Path, *extra: str) -> list[str]:
    return [
        f"policy.model_name={tiny_model_dir}",
        f"eval.save_path={save_path}",
        f"eval.num_prompts={NUM_PROMPTS}",
        f"rollouts.num_generations_per_prompt={SAMPLES}",
        "eval.ks=[1,2]",
        "policy.generation.max_new_tokens=8",
        *extra,
    ]


def start(tiny_model_dir: Path, save_path: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, "--config", "examples/configs/evals/eval.yaml", *overrides(tiny_model_dir, save_path, *extra),
         "--no-progress"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=one_thread_env(),
    )


def finish(*procs: subprocess.Popen, timeout: float = 240) -> list[tuple[int, str, str]]:
    out = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, stdout, stderr))
    return out


def merge_cli(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "merge", str(folder)], cwd=REPO, capture_output=True, text=True, timeout=120)


def sorted_line_bytes(path: Path) -> bytes:
    lines = path.read_bytes().splitlines(keepends=True)
    return b"".join(sorted(lines, key=lambda b: (json.loads(b)["prompt_idx"], json.loads(b)["sample_idx"])))


@pytest.fixture(scope="module")
def one_shard(tiny_model_dir, generation, tmp_path_factory) -> Path:
    """The run as one shard (in this process, on the module's engine); its merge is the reference. In this
    process rather than as one more `run_eval.py` process: the three-shard test shows that processes give the
    bytes of an in-process run (its unsharded run), and the CLI's merge message is checked there."""
    root = tmp_path_factory.mktemp("one") / "run"
    cfg = load_config(REPO / "examples/configs/evals/eval.yaml", overrides(tiny_model_dir, root, "eval.shard=0/1"),
                      EvalConfig)
    result = run_eval(cfg, generation=generation, progress=False)
    assert result.summary is not None and result.paths.root == root
    return root


@pytest.mark.timeout(400)
def test_three_shard_processes_merge_to_the_bytes_of_one_shard_and_of_an_unsharded_run(
    tiny_model_dir, generation, one_shard, tmp_path
) -> None:
    root = tmp_path / "three"
    results = finish(*(start(tiny_model_dir, root, f"eval.shard={i}/3") for i in range(3)))
    assert [rc for rc, _, _ in results] == [0, 0, 0], [e[-2000:] for _, _, e in results]
    merged_by = [out for _, out, _ in results if f"outputs in {root}/" in out]
    waited = [out for _, out, _ in results if "this job is done; the merge runs when the last job finishes" in out]
    assert len(merged_by) >= 1 and len(merged_by) + len(waited) == 3  # the last to finish merged

    merged = (root / "completions.jsonl").read_bytes()
    assert merged == (one_shard / "completions.jsonl").read_bytes()
    assert merged.count(b"\n") == NUM_PROMPTS * SAMPLES
    assert same_summary(root / "summary.json", one_shard / "summary.json")
    assert same_report(root, one_shard)
    assert timings_complete(root, NUM_PROMPTS * SAMPLES) and timings_complete(one_shard, NUM_PROMPTS * SAMPLES)
    for i in range(3):  # each shard rolled out its slice, and only that
        store = root / "shards" / f"{i}-of-3"
        owned = [p for p in range(NUM_PROMPTS) if ShardSpec(i, 3).owns(p)]
        record = json.loads((store / "shard.json").read_text())
        assert record["prompts"] == owned and record["finished"] is True and record["shard"] == f"{i}/3"
        lines = [json.loads(x) for x in (store / "completions.jsonl").read_text().splitlines()]
        assert sorted({x["prompt_idx"] for x in lines}) == owned and len(lines) == len(owned) * SAMPLES

    cfg = load_config(REPO / "examples/configs/evals/eval.yaml", overrides(tiny_model_dir, tmp_path / "plain"),
                      EvalConfig)
    plain = run_eval(cfg, generation=generation, progress=False)  # unsharded, in completion order
    assert sorted_line_bytes(plain.paths.completions) == merged
    assert same_summary(plain.paths.summary, root / "summary.json")
    assert same_report(plain.paths.root, root)
    assert timings_complete(plain.paths.root, NUM_PROMPTS * SAMPLES)  # in completion order, as its lines


@pytest.mark.timeout(400)
def test_killed_shard_resumes_its_slice_and_the_merge_waits_for_it(tiny_model_dir, one_shard, tmp_path) -> None:
    root = tmp_path / "killed"
    shard1 = root / "shards" / "1-of-3"
    proc = start(tiny_model_dir, root, "eval.shard=1/3", "eval.max_concurrent_prompts=1")
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if (shard1 / "completions.jsonl").exists() and (shard1 / "completions.jsonl").read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the shard finished before it could be killed"
    proc.communicate()
    on_disk = (shard1 / "completions.jsonl").read_bytes().count(b"\n")
    assert 2 <= on_disk < NUM_PROMPTS // 3 * SAMPLES
    assert json.loads((shard1 / "shard.json").read_text())["finished"] is False

    refused = merge_cli(root)  # shards 0 and 2 never ran, shard 1 is half done
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.startswith(f"error: 3 problems with the stores in {root}:")
    assert "missing shard: shards/0-of-3 (not started; run it with eval.shard=0/3)" in refused.stderr
    assert "missing shard: shards/2-of-3" in refused.stderr
    assert "incomplete shard: shards/1-of-3 (" in refused.stderr and "re-run it with eval.shard=1/3)" in refused.stderr

    others = finish(*(start(tiny_model_dir, root, f"eval.shard={i}/3") for i in (0, 2)))
    for rc, stdout, stderr in others:
        assert rc == 0, stderr[-3000:]
        assert "shards/1-of-3" in stdout.split("Not finished yet: ")[1]  # and perhaps the other, still running
    assert not (root / "completions.jsonl").exists() and not (root / "summary.json").exists()

    [(rc, stdout, stderr)] = finish(start(tiny_model_dir, root, "eval.shard=1/3"))  # restarted: resumes, merges
    assert rc == 0, stderr[-3000:]
    assert f"{on_disk} already on disk" in stdout and f"outputs in {root}/" in stdout
    assert (root / "completions.jsonl").read_bytes() == (one_shard / "completions.jsonl").read_bytes()
    assert same_summary(root / "summary.json", one_shard / "summary.json")

    again = merge_cli(root)  # the merge command gives the same files
    assert again.returncode == 0, again.stderr[-3000:]
    assert (root / "completions.jsonl").read_bytes() == (one_shard / "completions.jsonl").read_bytes()
    assert "merged 3 store(s)" in again.stdout and "pass@2" in again.stdout


@pytest.mark.timeout(500)
def test_two_seeds_as_jobs_merge_the_same_from_one_or_three_shards(tiny_model_dir, tmp_path) -> None:
    seeds = "eval.seeds=[3,7]"
    one, three = tmp_path / "one", tmp_path / "three"
    # one shard: a process per seed (a job array over seeds); three shards: a process per shard, each running
    # both seeds in turn
    results = finish(
        *(start(tiny_model_dir, one, seeds, f"eval.seed_index={j}") for j in (0, 1)),
        *(start(tiny_model_dir, three, seeds, f"eval.shard={i}/3") for i in range(3)),
        timeout=420,
    )
    assert [rc for rc, _, _ in results] == [0] * 5, [e[-2000:] for _, _, e in results]
    for seed in (3, 7):
        a, b = one / "seeds" / str(seed), three / "seeds" / str(seed)
        assert (a / "completions.jsonl").read_bytes() == (b / "completions.jsonl").read_bytes()
        assert same_summary(a / "summary.json", b / "summary.json")
        assert same_report(a, b) and timings_complete(b, NUM_PROMPTS * SAMPLES)
        config = (b / "shards" / "0-of-3" / "config.yaml").read_text()
        assert f"seed: {seed}\n" in config  # the job's policy.generation.seed
    assert (one / "seeds/3/completions.jsonl").read_bytes() != (one / "seeds/7/completions.jsonl").read_bytes()
    assert same_summary(one / "summary.json", three / "summary.json")
    assert same_report(one, three)  # the pooled report and difficulty file
    pooled = json.loads((three / "summary.json").read_text())
    assert pooled["num_completions"] == NUM_PROMPTS * SAMPLES * 2 and pooled["ks"] == [1, 2]
    assert pooled["metrics"]["num_samples"] == NUM_PROMPTS * SAMPLES * 2
    per_seed = [json.loads((three / "seeds" / s / "summary.json").read_text())["metrics"]["pass@1"] for s in "37"]
    assert pooled["metrics"]["seeds/pass@1/mean"] == pytest.approx(sum(per_seed) / 2)


@pytest.mark.timeout(300)
def test_multi_turn_shards_in_process_equal_an_unsharded_run(tiny_model_dir, generation, tmp_path) -> None:
    def cfg(save_path: Path, *extra: str) -> EvalConfig:
        return load_config(
            REPO / "examples/configs/evals/tool_eval.yaml",
            [f"policy.model_name={tiny_model_dir}", f"eval.save_path={save_path}", "eval.num_prompts=5",
             "policy.generation.max_new_tokens=8", "policy.max_model_len=1024", *extra],
            EvalConfig,
        )

    first = run_eval(cfg(tmp_path / "sharded", "eval.shard=0/2"), generation=generation, progress=False)
    assert first.complete and first.summary is None and first.waiting_for == ("shards/1-of-2",)
    last = run_eval(cfg(tmp_path / "sharded", "eval.shard=1/2"), generation=generation, progress=False)
    assert last.summary is not None and last.summary.rollout_mode == "multi_turn"
    plain = run_eval(cfg(tmp_path / "plain"), generation=generation, progress=False)
    assert sorted_line_bytes(plain.paths.completions) == (tmp_path / "sharded" / "completions.jsonl").read_bytes()
    assert same_summary(plain.paths.summary, tmp_path / "sharded" / "summary.json")
    assert same_report(plain.paths.root, tmp_path / "sharded")
    samples = (tmp_path / "sharded" / "completions.jsonl").read_bytes().count(b"\n")
    assert timings_complete(tmp_path / "sharded", samples) and timings_complete(plain.paths.root, samples)


@pytest.mark.gym
@pytest.mark.timeout(900)
def test_nemo_gym_shards_each_launch_gym_and_merge_to_the_known_metrics(
    gym_venv, tiny_model_and_tokenizer, tmp_path
) -> None:
    from test_eval_gym import ArithmeticPolicy  # the scripted policy whose metrics are worked by hand there

    _, tokenizer = tiny_model_and_tokenizer
    data = REPO / "examples" / "data" / "gym_arithmetic.jsonl"
    root = tmp_path / "gym"

    def cfg(shard: str) -> EvalConfig:
        return load_config(
            REPO / "examples" / "configs" / "evals" / "nemo_gym_eval.yaml",
            [f"eval.save_path={root}", f"eval.dataset_path={data}", "eval.num_prompts=6",
             "rollouts.num_generations_per_prompt={agent_alpha: 4, _default: 2}", "eval.ks=[1,2,3,4]",
             f"eval.shard={shard}", f"rollouts.gym.launch.gym_venv={gym_venv}",
             f"rollouts.gym.launch.config_paths=[{REPO / 'examples' / 'configs' / 'gym' / 'arithmetic_agents.yaml'}]"],
            EvalConfig,
        )

    first = run_eval(cfg("0/2"), generation=ArithmeticPolicy(tokenizer), progress=False)
    assert first.complete and first.summary is None and first.waiting_for == ("shards/1-of-2",)
    last = run_eval(cfg("1/2"), generation=ArithmeticPolicy(tokenizer), progress=False)
    assert last.summary is not None and last.summary.rollout_mode == "nemo_gym"
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    for i, prompts in ((0, [0, 2, 4]), (1, [1, 3, 5])):  # each store sent its own rows, materialized there
        sent = [json.loads(x) for x in (root / "shards" / f"{i}-of-2" / "gym_rows.jsonl").read_text().splitlines()]
        want = [(p, rows[p]["agent_ref"]["name"]) for p in prompts for _ in range(4 if p % 2 == 0 else 2)]
        assert [(r["_ng_task_index"], r["agent_ref"]["name"]) for r in sent] == want
    metrics = last.summary.metrics  # the values worked by hand in test_eval_gym.py, from the merged lines
    expected = {"agent/agent_alpha/pass@2": 4 / 9, "agent/agent_alpha/maj@3": 2 / 9, "agent/agent_beta/pass@2": 2 / 3,
                "pass@1": 3 / 8, "maj@2": 3 / 8, "pass@4": 2 / 3, "maj@4": 1 / 6, "mean_reward": 3 / 8}
    assert {key: metrics.get(key) for key in expected} == pytest.approx(expected, abs=1e-12)
    assert last.summary.gym_metrics is None and (root / "completions.jsonl").read_bytes().count(b"\n") == 18
