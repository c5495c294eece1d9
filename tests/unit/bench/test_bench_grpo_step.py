"""bench/grpo_step.py skips TRL, saying why, when TRL is not installed (the `bench` extra)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "grpo_step.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("grpo_step_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_is_skipped_with_its_reason_when_missing(monkeypatch, capsys):
    bench = load_bench()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert bench.trl_missing() == "trl is not installed (pip install -e '.[bench]')"
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--contenders", "trl", "trl-no-ckpt"])
    bench.main()
    out = capsys.readouterr().out
    assert "TRL skipped: trl is not installed (pip install -e '.[bench]')" in out
    assert "nothing left to run" in out


def test_trl_is_found_when_installed(monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert bench.trl_missing() is None
