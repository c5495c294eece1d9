"""Shared by the bench scripts: the engine benches' questions and thread setting, the machine line, medians, and a
plain-text table (ratio last). Standard library only, so a script can import it before torch."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

QUESTIONS = [
    "What is 7 + 5?",
    "Name three rivers and the countries they flow through, then say which one is the longest.",
    "Compute 123 * 4 step by step.",
    "Write one sentence about the weather in a city you like, and explain why you like that city so much.",
    "Is 91 a prime number?",
    "List the first ten square numbers and add them up, showing the running total after each one.",
    "What does a calculator tool do?",
    "Tell me a short story about a cat, a dog and a bird who meet by a river on a cold morning.",
]
"""User questions of different lengths that the engine benches prompt with (prompt i asks QUESTIONS[i % 8])."""


def engine_bench_parser(description: str, quick: str) -> argparse.ArgumentParser:
    """The arguments every engine bench takes: `--model`, `--quick` (its help: `quick`), `--threads`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="tiny", help='"tiny" (default), "smollm2" or a model folder')
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    return parser


def main_args(module_name: str, parse_args: Callable[[], argparse.Namespace]) -> argparse.Namespace | None:
    """`parse_args()` when the bench runs as a script (None when it is imported), with OMP_NUM_THREADS set to its
    `--threads` unless already set: call it before torch is imported, since OpenMP reads it at start-up."""
    if module_name != "__main__":
        return None
    args = parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    return args


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform.processor())."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line(extra: str = "") -> str:
    """One line naming the machine and the versions that matter for the numbers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [
        f"{cores} cores ({cpu_model()})",
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        f"Python {platform.python_version()}",
    ]
    try:
        import torch
        import transformers

        threads = torch.get_num_threads()
        parts.append(f"torch {torch.__version__} ({threads} threads)")
        parts.append(f"transformers {transformers.__version__}")
    except ImportError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    parts.append(f"load avg {load:.2f} at start")
    if extra:
        parts.append(extra)
    return "machine: " + ", ".join(parts)


def alternate_rounds(
    contenders: dict[str, Callable[[], int]], rounds: int, unit: str = "tokens/s"
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Warm each contender up once, then run them `rounds` times, rotating who goes first each round.

    A contender returns how much work it did (e.g. tokens); returns per-contender rates (work per wall
    second) and CPU seconds (this process) per round.
    """
    names = list(contenders)
    for fn in contenders.values():
        fn()
    rates: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            start, cpu_start = time.perf_counter(), time.process_time()
            work = contenders[name]()
            rates[name].append(work / (time.perf_counter() - start))
            cpu[name].append(time.process_time() - cpu_start)
        print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{rates[n][-1]:,.0f}" for n in names) + f" {unit}",
              flush=True)
    return rates, cpu


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence."""
    return statistics.median(values)


def spread(values: Sequence[float]) -> str:
    """min-max of a sequence, for showing noise next to a median."""
    return f"{min(values):.3g}-{max(values):.3g}"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
    """Print a fixed-width, pipe-separated table (Markdown-compatible)."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if title:
        print(f"\n{title}")
    line = "| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)) + " |"
    print(line)
    print("| " + " | ".join("-" * w for w in widths) + " |")
    for row in cells[1:]:
        print("| " + " | ".join(c.rjust(w) if _numeric(c) else c.ljust(w)
                                for c, w in zip(row, widths, strict=True)) + " |")
    sys.stdout.flush()


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _numeric(cell: str) -> bool:
    return cell.replace(",", "").replace(".", "", 1).replace("x", "").replace("-", "").strip().isdigit()
