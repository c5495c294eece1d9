"""bench/async_grpo.py runs end to end (`--smoke`: 3 fast simulated steps per contender, no real model)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "async_grpo.py"


@pytest.mark.timeout(120)
def test_the_async_grpo_bench_prints_a_row_per_contender(capsys):
    spec = importlib.util.spec_from_file_location("async_grpo_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| sync")
            or line.startswith("| async")]
    labels = [r[0].lstrip("| ") for r in rows]
    assert labels == ["sync", "async max_lag=1 finish", "async max_lag=1 abort", "async max_lag=2 finish",
                      "async max_lag=2 abort", "async max_lag=2 abort oversample=4"]
    for label, row in zip(labels, rows, strict=True):
        max_lag = int(label.split("max_lag=")[1][0]) if "max_lag" in label else 0
        cells = row[3].split()  # "0: 8 1: 16"
        hist = {int(k.rstrip(":")): int(v) for k, v in zip(cells[::2], cells[1::2], strict=True)}
        assert sum(hist.values()) == 3 * 8 and max(hist) <= max_lag, (label, hist)  # 3 steps of 8 groups
        assert float(row[1]) > 0
