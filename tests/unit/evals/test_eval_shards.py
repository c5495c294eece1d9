"""Sharded and seeded evals without a model: the slice rule, the eval.shard / eval.seeds keys, and the merge of
hand-written job stores (union, sorting, refusals, seeds pooled, stores filled by a dynamic assignment)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson
import pytest

from nemo_rl_ext.config import ConfigError, dump_config, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.evals.lines import CompletionLine
from nemo_rl_ext.evals.merge import merge_lock, merge_run, unfinished_jobs
from nemo_rl_ext.evals.shards import ShardRecord, ShardSpec, store_root
from nemo_rl_ext.evals.store import CompletionStore, check_dataset, dumps
from nemo_rl_ext.evals.summary import summarize

BASE = ["eval.dataset_path=data.jsonl", "eval.save_path=out"]

# ---- the slice rule and the keys -------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("num_prompts", [0, 1, 7, 24, 101])
def test_slices_are_disjoint_cover_everything_and_are_balanced(count: int, num_prompts: int) -> None:
    slices = [[p for p in range(num_prompts) if ShardSpec(i, count).owns(p)] for i in range(count)]
    assert sorted(p for s in slices for p in s) == list(range(num_prompts))
    sizes = [len(s) for s in slices]
    assert max(sizes) - min(sizes) <= 1


def test_a_slice_keeps_its_prompts_when_the_selection_grows() -> None:
    spec = ShardSpec(1, 3)
    small = [p for p in range(10) if spec.owns(p)]
    large = [p for p in range(25) if spec.owns(p)]
    assert small == [1, 4, 7] and large[: len(small)] == small


def test_shard_spec_parsing() -> None:
    assert ShardSpec.parse("0/1") == ShardSpec(0, 1)
    assert ShardSpec.parse(" 2 / 3 ") == ShardSpec(2, 3) and ShardSpec(2, 3).text == "2/3"
    assert ShardSpec(2, 3).name == "2-of-3" and ShardSpec.from_name("2-of-3") == ShardSpec(2, 3)
    assert ShardSpec.from_name("3-of-3") is None and ShardSpec.from_name("worker-7") is None
    for bad, why in [("3/3", "0..2 (shards are 0-based"), ("1/0", "N must be >= 1"), ("a/b", "I/N"), ("1", "I/N"), ("-1/3", "I/N"),
                     (3, "I/N")]:
        with pytest.raises(ValueError, match=why.replace(".", r"\.").replace("(", r"\(")):
            ShardSpec.parse(bad)


def test_bad_shard_and_seed_keys_name_the_key_and_value_all_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*BASE, "eval.shard=3/3", "eval.seeds=[1,1]", "eval.ks=[1,9]",
                           "rollouts.num_generations_per_prompt=4", "rollouts.max_rollout_turns=1"], EvalConfig)
    msg = str(info.value)
    assert "3 problem(s)" in msg
    assert "eval.shard: Value error, I must be in 0..2 (shards are 0-based: I of N), not 3 (got '3/3')" in msg
    assert "eval.seeds: Value error, every seed must be listed once; repeated: [1]" in msg
    assert "eval.ks: k=[9] larger than the largest sample count (4 from num_generations_per_prompt x 2 seeds)" \
        in msg
    with pytest.raises(ConfigError, match=r"eval.seed_index: selects a seed of eval.seeds, which is not set"):
        load_config(None, [*BASE, "eval.seed_index=0"], EvalConfig)
    with pytest.raises(ConfigError, match=r"eval.seed_index: must be < 2 \(the number of eval.seeds\)"):
        load_config(None, [*BASE, "eval.seeds=[4,5]", "eval.seed_index=2"], EvalConfig)
    with pytest.raises(ConfigError, match=r"eval.shard: Value error, must look like I/N .*\(got 'half'\)"):
        load_config(None, [*BASE, "eval.shard=half"], EvalConfig)


def test_seeds_allow_ks_up_to_the_pooled_count_and_a_seed_reports_its_own() -> None:
    cfg = load_config(None, [*BASE, "eval.seeds=[0,1]", "eval.ks=[1,4,8]",
                             "rollouts.num_generations_per_prompt=4", "rollouts.max_rollout_turns=1"], EvalConfig)
    assert cfg.ks == (1, 4)  # one seed's summary: its 4 samples
    assert load_config(None, [*BASE, "eval.shard=1/3"], EvalConfig).eval.shard_spec == ShardSpec(1, 3)


def test_job_configs_select_seeds_and_set_the_generation_seed(tmp_path: Path) -> None:
    from nemo_rl_ext.evals.plan import job_configs, job_root

    cfg = load_config(None, [f"eval.save_path={tmp_path}", "eval.dataset_path=d", "eval.seeds=[5,9]",
                             "eval.shard=2/4"], EvalConfig)
    jobs = job_configs(cfg)
    assert [j.policy.generation.seed for j in jobs] == [5, 9] and [j.eval.seed_index for j in jobs] == [0, 1]
    assert [job_root(j) for j in jobs] == [tmp_path / "seeds/5/shards/2-of-4", tmp_path / "seeds/9/shards/2-of-4"]
    one = job_configs(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"seed_index": 1})}))
    assert len(one) == 1 and one[0].policy.generation.seed == 9
    plain = job_configs(load_config(None, [f"eval.save_path={tmp_path}", "eval.dataset_path=d",
                                           "eval.shard=0/2"], EvalConfig))
    assert plain[0].policy.generation.seed is None and job_root(plain[0]) == tmp_path / "shards/0-of-2"


# ---- hand-written stores ----------------------------------------------------------------------------------

N_PROMPTS = 7
N_SAMPLES = 3


def reward_of(seed: int | None, p: int, s: int) -> float:
    """A deterministic, varied 'result' per (seed, prompt, sample)."""
    return float((p * 7 + s * 3 + (seed or 0) * 5) % 4 == 0)


def line(seed: int | None, p: int, s: int, **change) -> CompletionLine:
    values = dict(prompt_idx=p, sample_idx=s, agent="math", reward=reward_of(seed, p, s),
                  answer=str((p + s + (seed or 0)) % 3), stop_reason="natural", truncated=False, num_turns=1)
    return CompletionLine(**{**values, **change})


def run_cfg(root: Path, *extra: str) -> EvalConfig:
    return load_config(None, [f"eval.save_path={root}", "eval.dataset_path=data.jsonl",
                              f"rollouts.num_generations_per_prompt={N_SAMPLES}", "rollouts.max_rollout_turns=1",
                              "policy.model_name=tiny", *extra], EvalConfig)


def write_store(
    root: Path, cfg: EvalConfig, seed: int | None, name: str, prompts: Sequence[int], *, finished: bool = True,
    lines: Sequence[CompletionLine] | None = None,
) -> Path:
    """A job store as the driver leaves it: config.yaml, dataset_fingerprint.json, completions.jsonl, shard.json."""
    folder = (root if seed is None else root / "seeds" / str(seed)) / "shards" / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(dump_config(cfg))
    check_dataset(folder / "dataset_fingerprint.json", "data.jsonl", [f"{i:016x}" for i in range(N_PROMPTS)], False)
    rows = [line(seed, p, s) for p in prompts for s in range(N_SAMPLES)] if lines is None else lines
    CompletionStore(folder / "completions.jsonl").append(rows)
    ShardRecord(cfg.eval.shard, seed, N_PROMPTS, {p: N_SAMPLES for p in prompts}, finished).write(folder)
    return folder


def static_run(root: Path, count: int, seeds: Sequence[int] | None = None, *extra: str) -> Path:
    seed_args = [f"eval.seeds=[{','.join(map(str, seeds))}]"] if seeds else []
    for j, seed in enumerate(seeds or [None]):
        for i in range(count):
            spec = ShardSpec(i, count)
            sel = [f"eval.seed_index={j}", f"policy.generation.seed={seed}"] if seeds else []
            cfg = run_cfg(root, f"eval.shard={spec.text}", *seed_args, *sel, *extra)
            write_store(root, cfg, seed, spec.name, [p for p in range(N_PROMPTS) if spec.owns(p)])
    return root


def merge_error(root: Path) -> str:
    with pytest.raises(ConfigError) as info:
        merge_run(root)
    return str(info.value)


def test_merge_writes_sorted_lines_and_a_summary_of_them_alone(tmp_path: Path) -> None:
    one = merge_run(static_run(tmp_path / "one", 1))
    three = merge_run(static_run(tmp_path / "three", 3))
    merged = (tmp_path / "three" / "completions.jsonl").read_bytes()
    assert merged == (tmp_path / "one" / "completions.jsonl").read_bytes()
    keys = [(x["prompt_idx"], x["sample_idx"]) for x in map(json.loads, merged.splitlines())]
    assert keys == [(p, s) for p in range(N_PROMPTS) for s in range(N_SAMPLES)]
    assert merged == b"".join(dumps(line(None, p, s).to_json()) + b"\n" for p, s in keys)
    assert (tmp_path / "three" / "summary.json").read_bytes() == (tmp_path / "one" / "summary.json").read_bytes()
    assert one.summary == three.summary and three.stores == ("shards/0-of-3", "shards/1-of-3", "shards/2-of-3")
    # the summary is `summarize` of the merged lines: pass@1 by hand
    by_prompt = [[reward_of(None, p, s) for s in range(N_SAMPLES)] for p in range(N_PROMPTS)]
    assert three.summary.metrics["pass@1"] == pytest.approx(statistics.mean(statistics.mean(r) for r in by_prompt))
    assert three.summary.num_completions == N_PROMPTS * N_SAMPLES
    for name in ("report.md", "pass_at_k.png", "config.yaml", "dataset_fingerprint.json", "merge.json"):
        assert (tmp_path / "three" / name).exists()
    assert "shard: null" in (tmp_path / "three" / "config.yaml").read_text()


def test_merge_refuses_missing_and_incomplete_shards_in_one_error(tmp_path: Path) -> None:
    root = static_run(tmp_path / "run", 3)
    shutil.rmtree(root / "shards" / "2-of-3")
    record = ShardRecord.read(root / "shards" / "1-of-3")
    assert record is not None
    ShardRecord(record.shard, None, record.num_prompts, record.samples, finished=False).write(root / "shards/1-of-3")
    msg = merge_error(root)
    assert msg.startswith(f"2 problems with the stores in {root}:")
    assert "missing shard: shards/2-of-3 (not started; run it with eval.shard=2/3)" in msg
    assert "incomplete shard: shards/1-of-3 (2 of 2 prompts have every sample; re-run it with eval.shard=1/3)" in msg
    assert not (root / "completions.jsonl").exists() and not (root / "summary.json").exists()
    assert unfinished_jobs(root, run_cfg(root, "eval.shard=0/3")) == ["shards/1-of-3", "shards/2-of-3"]


def test_merge_refuses_differing_config_and_dataset_naming_the_shards(tmp_path: Path) -> None:
    root = static_run(tmp_path / "run", 3)
    cfg2 = root / "shards" / "2-of-3" / "config.yaml"
    cfg2.write_text(cfg2.read_text().replace("temperature: 1.0", "temperature: 0.5"))
    fp = root / "shards" / "1-of-3" / "dataset_fingerprint.json"
    record = orjson.loads(fp.read_bytes())
    record["row_sha256"][4] = "f" * 16
    fp.write_bytes(orjson.dumps(record))
    msg = merge_error(root)
    assert "config of shards/2-of-3 differs from shards/0-of-3: policy.generation.temperature: 1.0 -> 0.5" in msg
    assert "dataset fingerprint of shards/1-of-3 differs from shards/0-of-3: 1 row(s) differ (rows [4])" in msg


def test_merge_refuses_stores_without_their_config_or_dataset_fingerprint_naming_both(tmp_path: Path) -> None:
    root = static_run(tmp_path / "run", 3)
    (root / "shards" / "0-of-3" / "dataset_fingerprint.json").unlink()  # the first store: the old reference
    (root / "shards" / "1-of-3" / "config.yaml").unlink()
    fp = root / "shards" / "2-of-3" / "dataset_fingerprint.json"  # still compared with a store that has one
    record = orjson.loads(fp.read_bytes())
    record["row_sha256"][5] = "e" * 16
    fp.write_bytes(orjson.dumps(record))
    msg = merge_error(root)
    assert msg.startswith(f"3 problems with the stores in {root}:")
    assert "shards/0-of-3: no dataset_fingerprint.json (so its dataset rows can't be compared" in msg
    assert "shards/1-of-3: no config.yaml (so its config can't be compared with the other stores'" in msg
    assert "dataset fingerprint of shards/2-of-3 differs from shards/1-of-3: 1 row(s) differ (rows [5])" in msg
    assert not (root / "completions.jsonl").exists()


@pytest.mark.usefixtures("no_report_plots")
def test_merge_refuses_a_duplicate_that_is_not_byte_identical_naming_both_files(tmp_path: Path) -> None:
    root = static_run(tmp_path / "run", 3)
    same = root / "shards" / "1-of-3"
    CompletionStore(same / "completions.jsonl").append([line(None, 0, 0)])  # identical: fine
    merge_run(root)
    CompletionStore(same / "completions.jsonl").append([line(None, 3, 1, reward=0.5)])
    msg = merge_error(root)
    assert (
        f"prompt 3 sample 1: {root / 'shards/0-of-3/completions.jsonl'} and {same / 'completions.jsonl'} hold "
        "different lines (a duplicate must be byte-identical)" in msg
    )


@pytest.mark.usefixtures("no_report_plots")
def test_an_error_line_gives_way_to_a_result_from_another_store(tmp_path: Path) -> None:
    root = tmp_path / "run"
    cfg = run_cfg(root)
    error = line(None, 2, 1, stop_reason="error", reward=0.0, answer=None, error="ConnectionError: down")
    rows_a = [line(None, p, s) for p in (0, 1, 2) for s in range(N_SAMPLES) if (p, s) != (2, 1)] + [error]
    write_store(root, cfg, None, "worker-a", [0, 1, 2], lines=rows_a)
    write_store(root, cfg, None, "worker-b", [2, 3, 4, 5, 6])  # a dynamic assignment took prompt 2 again
    result = merge_run(root)
    assert result.summary.num_errors == 0
    reference = merge_run(static_run(tmp_path / "static", 2))
    assert (root / "completions.jsonl").read_bytes() == (tmp_path / "static" / "completions.jsonl").read_bytes()
    assert result.summary == reference.summary


@pytest.mark.usefixtures("no_report_plots")
def test_a_retry_that_holds_only_the_failed_sample_merges_with_the_first_store(tmp_path: Path) -> None:
    root = tmp_path / "run"
    cfg = run_cfg(root)
    error = line(None, 2, 1, stop_reason="error", reward=0.0, answer=None, error="ConnectionError: down")
    rows_a = [line(None, p, s) for p in (0, 1, 2) for s in range(N_SAMPLES) if (p, s) != (2, 1)] + [error]
    write_store(root, cfg, None, "worker-a", [0, 1, 2], lines=rows_a)
    # a Ray worker retried prompt 2 with skip {0, 2}: it appended sample 1 alone
    rows_b = [line(None, 2, 1)] + [line(None, p, s) for p in (3, 4, 5, 6) for s in range(N_SAMPLES)]
    write_store(root, cfg, None, "worker-b", [2, 3, 4, 5, 6], lines=rows_b)
    for name, entries in (("worker-a", [(p, s, 1.0 + p) for p in (0, 1, 2) for s in range(N_SAMPLES)]),
                          ("worker-b", [(p, s, 10.0 + p) for p, s in [(2, 1)] + [(p, s) for p in (3, 4, 5, 6)
                                                                                   for s in range(N_SAMPLES)]])):
        (root / "shards" / name / "timings.jsonl").write_bytes(b"".join(
            dumps({"prompt_idx": p, "sample_idx": s, "latency_s": v}) + b"\n" for p, s, v in entries))
    result = merge_run(root)
    reference = merge_run(static_run(tmp_path / "static", 2))
    assert (root / "completions.jsonl").read_bytes() == (tmp_path / "static" / "completions.jsonl").read_bytes()
    assert result.summary.metrics == reference.summary.metrics and result.summary.num_errors == 0
    # each merged line's latency is the one its store measured for it: (2, 1) from the retry, not the error
    timings = [json.loads(x) for x in (root / "timings.jsonl").read_text().splitlines()]
    assert [(t["prompt_idx"], t["sample_idx"]) for t in timings] == [
        (p, s) for p in range(N_PROMPTS) for s in range(N_SAMPLES)]
    got = {(t["prompt_idx"], t["sample_idx"]): t["latency_s"] for t in timings}
    assert got[(2, 0)] == 3.0 and got[(2, 1)] == 12.0 and got[(3, 0)] == 13.0
    assert result.summary.profile.overall.latency_s.num_samples == N_PROMPTS * N_SAMPLES


def test_dynamic_stores_must_cover_the_selection(tmp_path: Path) -> None:
    root = tmp_path / "run"
    cfg = run_cfg(root)
    write_store(root, cfg, None, "worker-a", [0, 1, 2])
    write_store(root, cfg, None, "worker-b", [4, 5])
    msg = merge_error(root)
    assert "prompt(s) [3, 6] (2) are in no store's shard.json" in msg


def test_merge_refuses_an_unsharded_runs_folder_and_an_empty_one(tmp_path: Path) -> None:
    assert "no shard stores" in merge_error(tmp_path)
    root = static_run(tmp_path / "run", 2)
    (root / "summary.json").write_text("{}")  # what an unsharded run in the same save_path left
    assert "holds the outputs of an unsharded run" in merge_error(root)


def pass_at_k(n: int, c: int, k: int) -> float:
    return 1 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.usefixtures("no_report_plots")
def test_seeds_merge_per_seed_and_pool_over_seeds(tmp_path: Path) -> None:
    seeds = [11, 4]
    one = merge_run(static_run(tmp_path / "one", 1, seeds, "eval.ks=[1,2,6]"))
    three = merge_run(static_run(tmp_path / "three", 3, seeds, "eval.ks=[1,2,6]"))
    for s in seeds:
        a = (tmp_path / "one" / "seeds" / str(s))
        b = (tmp_path / "three" / "seeds" / str(s))
        assert (a / "completions.jsonl").read_bytes() == (b / "completions.jsonl").read_bytes()
        assert (a / "summary.json").read_bytes() == (b / "summary.json").read_bytes()
        assert one.seed_summaries[s].ks == (1, 2)  # a seed has 3 samples: k=6 is pooled only
    assert (tmp_path / "one" / "summary.json").read_bytes() == (tmp_path / "three" / "summary.json").read_bytes()
    assert not (tmp_path / "three" / "completions.jsonl").exists()
    metrics = three.summary.metrics
    # computed here, independently: per seed pass@1, then pass@k over each prompt's 6 pooled samples
    per_seed = {s: statistics.mean(statistics.mean(reward_of(s, p, i) for i in range(N_SAMPLES))
                                   for p in range(N_PROMPTS)) for s in seeds}
    assert metrics["seeds/11/pass@1"] == pytest.approx(per_seed[11]) and metrics["seeds/4/pass@1"] == pytest.approx(
        per_seed[4])
    assert metrics["seeds/pass@1/mean"] == pytest.approx(statistics.mean(per_seed.values()))
    assert metrics["seeds/pass@1/std"] == pytest.approx(statistics.pstdev(per_seed.values()))
    assert metrics["seeds/num_seeds"] == 2 and three.summary.ks == (1, 2, 6)
    correct = {p: sum(reward_of(s, p, i) for s in seeds for i in range(N_SAMPLES)) for p in range(N_PROMPTS)}
    for k in (2, 6):
        want = statistics.mean(pass_at_k(2 * N_SAMPLES, int(c), k) for c in correct.values())
        assert metrics[f"pass@{k}"] == pytest.approx(want)
    assert metrics["num_samples"] == N_PROMPTS * N_SAMPLES * 2
    # maj@6: every prompt's 6 pooled answers voted at once, by hand
    maj = []
    for p in range(N_PROMPTS):
        votes: dict[str, list[float]] = {}
        for s in seeds:
            for i in range(N_SAMPLES):
                votes.setdefault(line(s, p, i).answer or "", []).append(reward_of(s, p, i))
        top = max(len(v) for v in votes.values())
        modes = [a for a, v in votes.items() if len(v) == top]
        maj.append(statistics.mean(statistics.mean(votes[a]) for a in modes))
    assert metrics["maj@6"] == pytest.approx(statistics.mean(maj))
    assert "## Seeds" in (tmp_path / "three" / "report.md").read_text()


def test_seed_folder_must_hold_its_seeds_job_and_every_seed_is_required(tmp_path: Path) -> None:
    root = static_run(tmp_path / "run", 2, [1, 2])
    shutil.rmtree(root / "seeds" / "2")
    msg = merge_error(root)
    assert "missing shard: seeds/2/shards/0-of-2 (not started; run it with eval.shard=0/2 eval.seed_index=1)" in msg
    assert "missing shard: seeds/2/shards/1-of-2" in msg


def test_merge_lock_excludes_a_second_merge(tmp_path: Path) -> None:
    with merge_lock(tmp_path), pytest.raises(TimeoutError, match=r"\.merge\.lock: another merge held it"):
        with merge_lock(tmp_path, timeout_s=0.3):
            pass
    with merge_lock(tmp_path, timeout_s=0.3):  # released
        pass


def test_store_reader_keeps_bytes_and_leaves_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    CompletionStore(path).append([line(None, 0, 0), line(None, 0, 1)])
    with open(path, "ab") as f:
        f.write(b'{"prompt_idx": 1')
    size = path.stat().st_size
    reader = CompletionStore(path, repair=False, keep_bytes=True)
    assert path.stat().st_size == size and reader.torn_bytes == len(b'{"prompt_idx": 1')
    assert reader.line_bytes[(0, 1)] == dumps(line(None, 0, 1).to_json()) and reader.keys() == [(0, 0), (0, 1)]


def test_summary_of_an_in_memory_store_equals_the_files(tmp_path: Path) -> None:
    rows = [line(None, p, s) for p in range(3) for s in range(N_SAMPLES)]
    path = tmp_path / "c.jsonl"
    CompletionStore(path).append(rows)
    cfg = run_cfg(tmp_path)
    from nemo_rl_ext.data.records import DatumSpec

    datums = [DatumSpec(idx=p, message_log=(), task_name="math") for p in range(3)]
    expected: Mapping[int, int] = {p: N_SAMPLES for p in range(3)}
    assert summarize(cfg, datums, expected, CompletionStore.of_lines(rows)) == summarize(
        cfg, datums, expected, CompletionStore(path)
    )
    assert store_root(tmp_path, 3, ShardSpec(0, 2)) == tmp_path / "seeds/3/shards/0-of-2"
