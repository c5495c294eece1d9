"""bench/learning_distill.py's outputs: per student and evaluated step, the held-out greedy pass@1 against samples
and training seconds (with bench/learning_stats.py's intervals), the share of the teacher's score, when each
student first reached half and 80% of it, the markdown and the plot."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from learning_stats import PromptScores, mean_interval, paired_bootstrap

LEVELS = (0.5, 0.8)
"""Shares of the teacher's held-out pass@1 whose first crossing is reported."""

DESCRIPTIONS = {
    "distill": "on-policy distillation alone (reward_weight 0)",
    "grpo": "GRPO from scratch on the reward (no teacher)",
    "mixed": "distillation + GRPO (reward_weight {w})",
}
"""What each student is, for the table's legend."""


def curve_rows(scores: Mapping[int, PromptScores], seconds: Mapping[int, float], before: PromptScores,
               teacher: PromptScores, samples_per_step: int, *, seed: int, resamples: int) -> list[dict[str, Any]]:
    """Per evaluated step: samples drawn so far, training seconds, greedy pass@1 (lenient) with its interval, the
    paired gain over the untrained model, the share of the teacher's pass@1, truncation and problems passed."""
    teacher_mean = float(teacher.lenient.mean())
    rows = []
    for step in sorted(scores):
        s = scores[step]
        mean = float(s.lenient.mean())
        rows.append({
            "step": step, "samples": step * samples_per_step, "train_s": seconds[step],
            "lenient": mean_interval(s.lenient, seed=seed, resamples=resamples).to_json(),
            "gain": paired_bootstrap(before.lenient, s.lenient, seed=seed, resamples=resamples).to_json(),
            "of_teacher": mean / teacher_mean if teacher_mean > 0 else None,
            "passed": int(round(float(s.lenient.sum()))), "n": len(s.lenient),
            "truncation": float(s.truncated.mean()),
        })
    return rows


def reached(curves: Mapping[str, list[dict]]) -> dict[str, dict[str, dict | None]]:
    """Per student and level of LEVELS: the first evaluated step whose pass@1 is at least that share of the
    teacher's (its step, samples and training seconds; an upper bound, as it may have got there between two
    checkpoints), or None."""
    out: dict[str, dict[str, dict | None]] = {}
    for name, rows in curves.items():
        out[name] = {}
        for level in LEVELS:
            first = next((r for r in rows if r["step"] > 0 and r["of_teacher"] is not None
                          and r["of_teacher"] >= level), None)
            out[name][f"{level:.0%}"] = first and {k: first[k] for k in ("step", "samples", "train_s")}
    return out


def _cell(d: Mapping[str, float], key: str = "after") -> str:
    return f"{d[key]:+.3f}" if key == "diff" else f"{d[key]:.3f}"


def curve_table(results: Mapping[str, Any]) -> str:
    """One row per (student, evaluated step)."""
    lines = ["| student | step | samples | training s | greedy pass@1 [95% CI] | gain over untrained [95% CI] | "
             "of teacher's | truncation |", "|---|---|---|---|---|---|---|---|"]
    for name, rows in results["curves"].items():
        for r in rows:
            if r["step"] == 0:
                continue
            share = "-" if r["of_teacher"] is None else f"{r['of_teacher']:.1%}"
            lines.append(f"| {name} | {r['step']} | {r['samples']:,} | {r['train_s']:.0f} | "
                         f"{r['lenient']['after']:.3f} [{r['lenient']['low']:.3f}, {r['lenient']['high']:.3f}] | "
                         f"{r['gain']['diff']:+.3f} [{r['gain']['low']:+.3f}, {r['gain']['high']:+.3f}] | "
                         f"{share} | {r['truncation']:.3f} |")
    return "\n".join(lines)


def reached_lines(results: Mapping[str, Any]) -> str:
    """"distill: 50% of the teacher's pass@1 at step 10 (640 samples, 131 s); ..." per student."""
    lines = []
    for name, levels in results["reached"].items():
        parts = [f"{level} at step {r['step']} ({r['samples']:,} samples, {r['train_s']:.0f} s)" if r else
                 f"{level} not reached in {results['steps']} steps" for level, r in levels.items()]
        lines.append(f"- `{name}`: " + "; ".join(parts))
    return "\n".join(lines)


def results_markdown(results: Mapping[str, Any]) -> str:
    """results.md: what ran, the teacher, the table, the crossings, the control, the phases' wall-clock."""
    t, before = results["teacher"], results["curves"]["distill"][0]
    legend = "; ".join(f"`{k}`: {v.format(w=results['mixed_reward_weight'])}" for k, v in DESCRIPTIONS.items())
    timings = ", ".join(f"{k} {v:.0f} s" for k, v in results["timings_s"].items())
    control = results.get("control")
    control_line = (f"lr-0 control ({results['control_steps']} steps of `distill` with lr 0): pass@1 "
                    f"{control['lenient']['after']:.3f}, gain {control['gain']['diff']:+.3f} "
                    f"[{control['gain']['low']:+.3f}, {control['gain']['high']:+.3f}]." if control else "No control run.")
    return (f"# On-policy distillation against GRPO: task `{results['task']}`\n\n"
            f"{results['date']}; {results['machine']}\n\n"
            f"Student `{results['model']}` (untrained), recipe `{results['recipe']}` (kl_type {results['kl_type']}, "
            f"lr {results['lr']}), {results['steps']} steps of {results['prompts_per_step']} prompts x "
            f"{results['generations']} samples for every student, a checkpoint every {results['save_every']} steps "
            f"evaluated by `run_eval.py` (greedy) on {results['eval_size']} of {results['heldout_size']} held-out "
            f"problems. {legend}. Training seconds: the sum of the steps' wall-clock (generation, teacher "
            f"scoring over HTTP, update). Intervals: 95% bootstrap over problems ({results['resamples']} resamples, "
            f"seed {results['seed']}).\n\n"
            f"Teacher: {t['folder']}, from {results['teacher']['how']}, served by our policy server; held-out greedy "
            f"pass@1 {t['lenient']['after']:.3f} [{t['lenient']['low']:.3f}, {t['lenient']['high']:.3f}]. "
            f"Untrained student: {before['lenient']['after']:.3f}. {_requests(results)}\n\n{curve_table(results)}\n\n"
            f"First evaluated step at a share of the teacher's pass@1:\n\n{reached_lines(results)}\n\n"
            f"{control_line}\n\nWall-clock per phase: {timings}.\n")


def _requests(results: Mapping[str, Any]) -> str:
    """"The teacher server answered 1,234 scoring requests (status 200)." from its /metrics counters."""
    counts = results.get("teacher_requests") or {}
    if not counts:
        return "The teacher server reported no scoring request."
    statuses = ", ".join(f"{n:,} with status {code}" for code, n in sorted(counts.items()))
    return f"The teacher server answered {sum(counts.values()):,} scoring requests ({statuses})."


def plot_budget(results: Mapping[str, Any], path: Path) -> list[str]:
    """pass1_vs_budget.png: held-out greedy pass@1 of each student against samples (left) and training seconds
    (right), intervals as error bars, the teacher's and the untrained student's scores as lines; [] without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("    matplotlib is not installed: no plot (results.md and results.json have the numbers)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    colors = {"distill": "#2ca02c", "grpo": "#1f77b4", "mixed": "#9467bd"}
    for ax, x, label in ((axes[0], "samples", "samples drawn"), (axes[1], "train_s", "training seconds")):
        for name, rows in results["curves"].items():
            ys = [r["lenient"]["after"] for r in rows]
            err = [[y - r["lenient"]["low"] for y, r in zip(ys, rows, strict=True)],
                   [r["lenient"]["high"] - y for y, r in zip(ys, rows, strict=True)]]
            ax.errorbar([r[x] for r in rows], ys, yerr=err, marker="o", capsize=3, color=colors.get(name),
                        label=name)
        ax.axhline(results["teacher"]["lenient"]["after"], color="#d62728", linestyle="--", linewidth=1,
                   label="teacher")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out greedy pass@1 (95% CI)")
    axes[0].set_ylim(-0.02, 1.02)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]
