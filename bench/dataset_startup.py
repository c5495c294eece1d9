"""Start-up of a GRPO run on a large parquet dataset: how long until the first step's prompts are ready, and how
much memory the dataset adds (issue 37's goal: a 1,000,000-row file ready within 30 s, < 1 GiB extra RSS).

    nice -n 19 python bench/dataset_startup.py [--rows 1000000] [--model tiny|smollm2] [--prompts 4]

It writes a parquet file of `--rows` arithmetic rows (question, answer, id, source), then measures in a fresh
process, once with an empty `datasets` cache (the first run: parquet -> Arrow cache) and once with it filled (a
restart), what GRPO's `_build_data` does before its first rollout: `grpo.data_rows.run_sources` (open the table,
check every row), `make_datums`, `grpo.data_rows.training_stream` (the seeded stream, the rows' fingerprint), the
agents' preflight and the first `--prompts` datums (tokenized). Extra RSS: resident memory after that minus before (the tokenizer, torch and the
package already imported), and the peak during it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, print_table  # noqa: E402  (the bench folder, as the other benches)


def write_parquet(path: Path, rows: int) -> None:
    """`rows` arithmetic problems, written by pyarrow in row groups of 100,000."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetWriter(path, pa.schema([("question", pa.string()), ("answer", pa.string()),
                                           ("id", pa.int64()), ("source", pa.string())])) as writer:
        for start in range(0, rows, 100_000):
            ids = range(start, min(start + 100_000, rows))
            writer.write_table(pa.table({
                "question": [f"What is {i % 997} + {i % 89}?" for i in ids],
                "answer": [str(i % 997 + i % 89) for i in ids],
                "id": list(ids),
                "source": ["bench"] * len(ids),
            }))


def child(path: str, model: str, prompts: int) -> dict[str, float]:
    """Measured in this process: seconds and RSS of the data start-up (module docstring)."""
    import resource

    import psutil

    from nemo_rl_ext.config import load_config
    from nemo_rl_ext.experience.build import make_datums
    from nemo_rl_ext.grpo.config import GRPOConfig
    from nemo_rl_ext.grpo.data_rows import run_sources, training_stream
    from nemo_rl_ext.models.loading import load_tokenizer
    from nemo_rl_ext.models.policy import resolve_model_path

    cfg = load_config(None, [f"data.train_path={path}", f"policy.model_name={model}"], GRPOConfig)
    tokenizer = load_tokenizer(resolve_model_path(cfg.policy))
    import datasets  # noqa: F401  (imported before the baseline, as a run imports it at start-up)

    process = psutil.Process()
    before = process.memory_info().rss
    start = time.perf_counter()
    sources = run_sources(cfg, train=True, validates=False)
    train_rows = sources[0].rows
    loaded = time.perf_counter()
    datums = make_datums(cfg.rollouts, tokenizer, train_rows)
    stream = training_stream(cfg, tokenizer, sources, datums)
    agents = datums.agent_pairs() if hasattr(datums, "agent_pairs") else [(d.idx, d.agent) for d in datums]
    first = stream.next(prompts)
    ready = time.perf_counter()
    after = process.memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert len(first) == prompts and len(agents) == len(train_rows) and first[0].message_log
    return {"rows": float(len(train_rows)), "load_check_s": loaded - start, "first_prompts_s": ready - start,
            "extra_rss_mib": (after - before) / 2**20, "peak_rss_growth_mib": max(0, peak - before) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--model", default="tiny", help='"tiny" (default) or "smollm2": whose tokenizer')
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the first step (default 4)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.prompts)))
        return
    with tempfile.TemporaryDirectory(prefix="dataset_startup_") as tmp:
        path = Path(tmp) / "rows.parquet"
        start = time.perf_counter()
        write_parquet(path, args.rows)
        print(f"wrote {args.rows:,} rows ({path.stat().st_size / 2**20:.1f} MiB parquet) in "
              f"{time.perf_counter() - start:.1f} s")
        env = {**os.environ, "HF_DATASETS_CACHE": str(Path(tmp) / "cache"), "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        results = []
        for run in ("cold cache", "warm cache"):
            out = subprocess.run([sys.executable, __file__, "--child", str(path), "--model", args.model,
                                  "--prompts", str(args.prompts)], env=env, capture_output=True, text=True,
                                 timeout=1800, check=False)
            if out.returncode != 0:
                sys.exit(f"{run}: the measuring process failed:\n{out.stderr[-3000:]}")
            results.append((run, json.loads(out.stdout.strip().splitlines()[-1])))
    print(machine_line())
    print_table(["run", "rows", "open+check s", "first prompts s", "extra RSS MiB", "peak growth MiB"],
                [(run, f"{r['rows']:,.0f}", f"{r['load_check_s']:.1f}", f"{r['first_prompts_s']:.1f}",
                  f"{r['extra_rss_mib']:.0f}", f"{r['peak_rss_growth_mib']:.0f}") for run, r in results],
                title=f"data start-up of a GRPO run on a {args.rows:,}-row parquet file (goal: < 30 s, < 1024 MiB)")


if __name__ == "__main__":
    main()
