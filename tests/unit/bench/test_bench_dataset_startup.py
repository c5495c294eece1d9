"""bench/dataset_startup.py on a small file: it writes the rows it says, reads them through GRPO's data set-up,
and reports every row and the first step's prompts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench" / "dataset_startup.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("dataset_startup_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bench_measures_grpo_data_setup_on_its_file(bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = tmp_path / "rows.parquet"
    bench.write_parquet(path, 2_500)
    table = pq.read_table(path)
    assert table.num_rows == 2_500 and table.column("answer")[1000].as_py() == str(1000 % 997 + 1000 % 89)
    result = bench.child(str(path), "tiny", 4)
    assert result["rows"] == 2_500
    assert 0 < result["load_check_s"] <= result["first_prompts_s"]
