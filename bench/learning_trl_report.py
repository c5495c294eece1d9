"""bench/learning_trl.py's outputs: the held-out pass@1 curves against training seconds (with the bootstrap
intervals of bench/learning_stats.py), the goal line, the markdown and the plot, and the list of what differs
between our recipe and TRL's run."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from learning_stats import PromptScores, mean_interval, paired_bootstrap

DIFFERENCES = (
    ("advantage", "leave-one-out baseline (the mean of the group's OTHER samples) divided by those others' std "
     "(ddof 1), skipped where it is 0: NeMo-RL's defaults", "the group mean (the sample included) divided by the "
     "group std + 1e-4 (`scale_rewards='group'`, TRL's default)", "each framework's default, what a user gets; "
     "for 0/1 rewards the signs and the order within a group are the same, the scale differs"),
    ("loss normalisation", "`loss.normalization: token`: the step's summed token losses / its trained tokens",
     "`loss_type='dapo'` (TRL's default): the same, over the global accumulated batch", "the same reduction"),
    ("batch", "`num_prompts_per_step` x `num_generations_per_prompt` samples, one optimizer step, one group per "
     "micro-batch", "`per_device_train_batch_size` = the group size, `gradient_accumulation_steps` = the prompts, "
     "so `steps_per_generation` = the prompts: one generation batch of prompts x group per optimizer step",
     "TRL's batch size counts completions, not prompts; this makes one step the same samples"),
    ("updates per batch", "one optimizer step per GRPO step", "`num_iterations=1` (default): the same",
     "the same"),
    ("importance sampling", "trainer / engine probability ratio, capped at 2 (the recipe): the engine is a copy "
     "of the weights", "none: generation runs on the trained model itself (`generate` with the adapters), so the "
     "ratio is 1", "TRL corrects only vLLM's generation"),
    ("lr schedule", "constant (no `optimizer.scheduler`)", "`lr_scheduler_type='constant'` (the Trainer's default "
     "is linear decay to 0)", "the same lr at every step on both sides"),
    ("gradient checkpointing", "`trainer.activation_checkpointing` (off)", "set to ours (TRL's default is on)",
     "checkpointing recomputes the forward in the backward: a speed setting, not a learning one"),
    ("dtype", "float32", "float32 (`bf16=False`; TRL's default is bf16)", "the same numbers format"),
    ("sampling", "temperature, no top-k / top-p, our engine (continuous batching)", "temperature, `top_k=0`, "
     "`top_p=1`, `model.generate` on padded batches", "the same distribution; other random draws"),
    ("data order", "shuffled with `grpo.seed`", "TRL's sampler shuffled with the same seed", "the same problems, "
     "another order: each step sees other prompts"),
    ("speed-only differences", "a group's prompt runs once (`share_prompt_prefix`), micro-batches whose "
     "advantages are all 0 are skipped (`skip_zero_advantage`; exact: they add 0)", "neither", "they change the "
     "wall-clock, not the update"),
)
"""(setting, ours, TRL, why): what differs between the two runs, and what was set to be the same."""


def trl_differences() -> list[dict[str, str]]:
    """The DIFFERENCES as JSON rows."""
    return [dict(zip(("setting", "ours", "trl", "why"), row, strict=True)) for row in DIFFERENCES]


def curve_points(scores: Mapping[int, PromptScores], seconds: Mapping[int, float], *, seed: int,
                 resamples: int) -> list[dict[str, Any]]:
    """Per evaluated step: training seconds, greedy pass@1 (lenient and strict) with its 95% bootstrap interval,
    the truncation rate and the number of problems the grader passed."""
    points = []
    for step in sorted(scores):
        s = scores[step]
        points.append({
            "step": step, "train_s": seconds[step],
            "lenient": mean_interval(s.lenient, seed=seed, resamples=resamples).to_json(),
            "strict": mean_interval(s.strict, seed=seed, resamples=resamples).to_json(),
            "passed": int(round(float(s.lenient.sum()))), "n": len(s.lenient),
            "truncation": float(s.truncated.mean()),
        })
    return points


def goal(curves: Mapping[str, list[dict]], scores: Mapping[str, Mapping[int, PromptScores]], *, seed: int,
         resamples: int) -> dict[str, Any]:
    """Whether ours reached TRL's final held-out greedy pass@1 (lenient) within half of TRL's training seconds,
    from the evaluated points (ours is counted at the first evaluated step at or above TRL's final score, so
    its time is an upper bound: it may have got there between two checkpoints); and the paired difference
    ours - TRL at the last step, on the same problems."""
    trl_final, ours_final = curves["trl"][-1], curves["ours"][-1]
    budget = trl_final["train_s"] / 2
    first = next((p for p in curves["ours"] if p["passed"] >= trl_final["passed"]), None)
    met = first is not None and first["train_s"] <= budget
    final = paired_bootstrap(scores["trl"][trl_final["step"]].lenient, scores["ours"][ours_final["step"]].lenient,
                             seed=seed, resamples=resamples).to_json()
    where = (f"ours first reached it at step {first['step']} ({first['train_s']:.1f} s, pass@1 "
             f"{first['lenient']['after']:.3f})" if first else
             f"ours never reached it in its {ours_final['step']} steps (final {ours_final['lenient']['after']:.3f})")
    line = (f"goal (ours reaches TRL's final held-out greedy pass@1 in at most half of TRL's training wall-clock): "
            f"{'MET' if met else 'NOT MET'}. TRL: {trl_final['lenient']['after']:.3f} after {trl_final['step']} "
            f"steps, {trl_final['train_s']:.1f} s (half: {budget:.1f} s); {where}.")
    base = curves["trl"][0]
    if trl_final["passed"] <= base["passed"]:
        line += (f" TRL's final pass@1 is not above the base model's ({base['lenient']['after']:.3f}): reaching it "
                 "shows nothing.")
    line += (f" At each side's last step (ours {ours_final['step']}, TRL {trl_final['step']}), ours - TRL: "
             f"{final['diff']:+.3f} [{final['low']:+.3f}, {final['high']:+.3f}] "
             f"(95% paired bootstrap); training seconds ours / TRL: "
             f"{ours_final['train_s'] / max(trl_final['train_s'], 1e-9):.2f}.")
    return {"met": met, "target": trl_final["lenient"]["after"], "budget_s": budget,
            "ours_reached_at": first and {"step": first["step"], "train_s": first["train_s"]},
            "final_diff": final, "line": line}


def _cell(d: Mapping[str, float]) -> str:
    return f"{d['after']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"


def curve_table(curves: Mapping[str, list[dict]]) -> str:
    """One row per (side, evaluated step): training seconds, pass@1 lenient and strict with intervals, truncation."""
    lines = ["| run | step | training s | greedy pass@1, lenient [95% CI] | strict [95% CI] | truncation |",
             "|---|---|---|---|---|---|"]
    for side, points in curves.items():
        for p in points:
            lines.append(f"| {side} | {p['step']} | {p['train_s']:.0f} | {_cell(p['lenient'])} | "
                         f"{_cell(p['strict'])} | {p['truncation']:.3f} |")
    return "\n".join(lines)


def results_markdown(results: Mapping[str, Any]) -> str:
    """results.md: what ran, the curves' table, the goal, the phases' wall-clock, what differs."""
    timings = ", ".join(f"{k} {v:.0f} s" for k, v in results["timings_s"].items())
    diffs = "\n".join(f"| {d['setting']} | {d['ours']} | {d['trl']} | {d['why']} |" for d in results["differences"])
    return (f"# Side by side with TRL: recipe `{results['recipe']}`, task `{results['task']}`\n\n"
            f"{results['date']}; {results['machine']}\n\n"
            f"Model `{results['model']}`, {_steps(results)} GRPO steps of {results['prompts_per_step']} prompts x "
            f"{results['generations']} samples (TRL {results['trl_version']}){_reused(results)}, a checkpoint every "
            f"{results['save_every']} steps, each evaluated by `run_eval.py` (greedy) on {results['eval_size']} of "
            f"{results['heldout_size']} held-out problems. Training seconds: the sum of the steps' wall-clock "
            f"(no saving, export, loading or eval). Intervals: 95% bootstrap over problems "
            f"({results['resamples']} resamples, seed {results['seed']}).\n\n{curve_table(results['curves'])}\n\n"
            f"{results['goal']['line']}\n\nWall-clock per phase: {timings}.\n\n"
            f"| setting | ours | TRL | why |\n|---|---|---|---|\n{diffs}\n")


def _steps(results: Mapping[str, Any]) -> str:
    ours = results.get("ours_steps", results["steps"])
    return f"{results['steps']}" + (" on each side" if ours == results["steps"] else f" for TRL and {ours} for ours")


def _reused(results: Mapping[str, Any]) -> str:
    return f"; TRL's training reused from `{results['trl_from']}`" if results.get("trl_from") else ""


def plot_curves(curves: Mapping[str, list[dict]], goal_result: Mapping[str, Any], path: Path) -> list[str]:
    """pass1_vs_time.png: held-out greedy pass@1 (lenient) against training seconds, both runs, the intervals as
    error bars, TRL's final score and half its time as dashed lines; [] without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("    matplotlib is not installed: no plot (results.md and results.json have the numbers)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for side, color in (("ours", "#1f77b4"), ("trl", "#d62728")):
        pts = curves[side]
        ys = [p["lenient"]["after"] for p in pts]
        err = [[y - p["lenient"]["low"] for y, p in zip(ys, pts, strict=True)],
               [p["lenient"]["high"] - y for y, p in zip(ys, pts, strict=True)]]
        ax.errorbar([p["train_s"] for p in pts], ys, yerr=err, marker="o", capsize=3, color=color,
                    label="ours" if side == "ours" else "TRL GRPOTrainer")
    ax.axhline(goal_result["target"], color="#d62728", linestyle=":", linewidth=1, label="TRL's final pass@1")
    ax.axvline(goal_result["budget_s"], color="#555555", linestyle="--", linewidth=1, label="half of TRL's time")
    ax.set_xlabel("training seconds (sum of step wall-clock)")
    ax.set_ylabel("held-out greedy pass@1 (95% CI)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path.name]
