"""bench/learning.py's outputs: the comparison of the held-out evals (paired bootstrap per metric and operator),
the markdown table, and the two plots (training reward per step; held-out before / after / control with their
intervals)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from learning_stats import PromptScores, by_group, paired_bootstrap

MODES = ("greedy", "sampled")
"""The two held-out evals: greedy pass@1, and pass@1 over the sampled answers at T = 1."""

READINGS = ("strict", "lenient")
"""Strict: the whole answer is the number; lenient: the grader's reading."""


def compare(before: Mapping[str, PromptScores], after: Mapping[str, PromptScores], ops: Sequence[str], *,
            seed: int, resamples: int) -> dict[str, Any]:
    """{mode: {reading: {"overall" | op: PairedDiff JSON}}} plus truncation before / after per mode."""
    out: dict[str, Any] = {}
    for mode in before:
        out[mode] = {}
        for reading in READINGS:
            b, a = getattr(before[mode], reading), getattr(after[mode], reading)
            rows = {"overall": paired_bootstrap(b, a, seed=seed, resamples=resamples).to_json()}
            b_ops, a_ops = by_group(b, ops), by_group(a, ops)
            for op in sorted(b_ops):
                rows[op] = paired_bootstrap(b_ops[op], a_ops[op], seed=seed, resamples=resamples).to_json()
                rows[op]["n"] = len(b_ops[op])
            out[mode][reading] = rows
        out[mode]["truncation"] = {"before": float(before[mode].truncated.mean()),
                                   "after": float(after[mode].truncated.mean())}
    return out


def _cell(d: Mapping[str, float]) -> str:
    return f"{d['diff']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def markdown_table(run: Mapping[str, Any], control: Mapping[str, Any] | None) -> str:
    """One row per (eval, reading, operator): before, after, the gain with its interval, and the control's (no
    control columns when the bench ran none)."""
    head = "| held-out metric | n | before | after | gain [95% CI] |"
    lines = [head + (" control after | control gain [95% CI] |" if control else ""),
             "|---|---|---|---|---|" + ("---|---|" if control else "")]
    for mode in run:
        for reading in READINGS:
            for key, d in run[mode][reading].items():
                label = f"{mode} pass@1, {reading}" + ("" if key == "overall" else f", `{key}`")
                row = f"| {label} | {d.get('n', 'all')} | {d['before']:.3f} | {d['after']:.3f} | {_cell(d)} |"
                if control:
                    c = control[mode][reading][key]
                    row += f" {c['after']:.3f} | {_cell(c)} |"
                lines.append(row)
        t = run[mode]["truncation"]
        row = f"| {mode} truncation rate | all | {t['before']:.3f} | {t['after']:.3f} | |"
        lines.append(row + (f" {control[mode]['truncation']['after']:.3f} | |" if control else ""))
    return "\n".join(lines)


def read_rewards(metrics_file: Path) -> list[tuple[int, float]]:
    """(step, mean training reward) from a GRPO run's metrics.jsonl."""
    out = []
    for raw in metrics_file.read_text().splitlines():
        if raw.strip():
            m = json.loads(raw)
            if m.get("step", 0) > 0 and "rollout/reward/mean" in m:
                out.append((m["step"], m["rollout/reward/mean"]))
    return out


def plot_rewards(curves: Mapping[str, Sequence[tuple[int, float]]], path: Path) -> None:
    """The training reward per step of each run (the trained one and the lr-0 control)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, curve in curves.items():
        if curve:
            ax.plot([s for s, _ in curve], [r for _, r in curve], marker="o", markersize=3, label=label)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean training reward")
    ax.set_ylim(-0.02, 1.02)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_heldout(run: Mapping[str, Any], control: Mapping[str, Any] | None, path: Path) -> None:
    """Held-out pass@1 (each eval and reading) before, after and after the control (if one ran), the gains' 95%
    intervals as error bars on the after bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{m}\n{r}" for m in run for r in READINGS]
    rows = [(run[m][r]["overall"], control[m][r]["overall"] if control else None) for m in run for r in READINGS]
    fig, ax = plt.subplots(figsize=(1.9 * len(labels) + 1, 3.8))
    width = 0.27
    for i, (d, c) in enumerate(rows):
        ax.bar(i - width, d["before"], width, color="#999999", label="before" if i == 0 else None)
        ax.bar(i, d["after"], width, color="#1f77b4", label="after GRPO" if i == 0 else None,
               yerr=[[d["diff"] - d["low"]], [d["high"] - d["diff"]]], capsize=3)
        if c is None:
            continue
        ax.bar(i + width, c["after"], width, color="#ff7f0e", label="after lr-0 control" if i == 0 else None,
               yerr=[[c["diff"] - c["low"]], [c["high"] - c["diff"]]], capsize=3)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("held-out pass@1 (error bars: 95% CI of the gain)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
