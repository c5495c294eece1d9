"""The eval report: a metric table (printed and in Markdown), a PNG of pass@k against k per agent, the reward
profile per task (a Markdown table and `reward_profile.png`) and the per-prompt difficulty file.

The table has a row per key of every metric in `metric_defs()` (the list aggregation iterates too) that is
`in_report`, or of those `eval.metrics` lists (`EvalSummary.report_metrics`), and the
reward-profile table a row per metric the profile carries (its `in_profile` ones), so a registered metric shows
up in both without editing this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nemo_rl_ext.evals.metrics import MetricDef, metric_defs
from nemo_rl_ext.evals.profile import (
    DIFFICULTY_BINS,
    DIFFICULTY_FILE,
    PROFILE_PLOT,
    TaskProfile,
    write_difficulty,
)
from nemo_rl_ext.evals.store import EvalPaths
from nemo_rl_ext.evals.summary import MAX_LISTED_ERRORS, EvalSummary
from nemo_rl_ext.experience.prompt_length import PromptLengthWarning, prompts_too_long_message


def _columns(summary: EvalSummary) -> list[tuple[str, str]]:
    """(header, metric-key prefix): overall, then each agent when there is more than one."""
    agents = list(summary.agents)
    if len(agents) == 1:
        return [(agents[0], "")]
    return [("all", "")] + [(a, f"agent/{a}/") for a in agents]


def shown_metrics(summary: EvalSummary) -> list[MetricDef]:
    """The metrics of the table: `summary.report_metrics` (`eval.metrics`) in its order, else every `in_report`
    one (a name no longer registered is left out)."""
    if summary.report_metrics is None:
        return [m for m in metric_defs() if m.in_report]
    defs = {m.name: m for m in metric_defs()}
    return [defs[name] for name in summary.report_metrics if name in defs]


def _metric_keys(summary: EvalSummary) -> list[tuple[str, str]]:
    """(key, format spec) of each table row: every shown metric, each k of a per-k one."""
    return [(key, m.report_format) for m in shown_metrics(summary) for key in m.keys(summary.ks)]


def _cell(metrics: Mapping[str, float], key: str, spec: str) -> str:
    if key not in metrics:
        return "-"
    stderr = metrics.get(f"{key}/stderr")
    return format(metrics[key], spec) + (f" ± {format(stderr, spec)}" if stderr is not None else "")


def metric_rows(summary: EvalSummary) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the metric table: one row per metric, one column per agent (value ± stderr)."""
    metrics = summary.metrics
    columns = _columns(summary)
    header = ["metric"] + [name for name, _ in columns]
    rows = [
        [key] + [_cell(metrics, prefix + key, spec) for _, prefix in columns] for key, spec in _metric_keys(summary)
    ]
    rows.append(
        ["prompts / samples"]
        + [
            f"{metrics[prefix + 'num_prompts']:.0f} / {metrics[prefix + 'num_samples']:.0f}"
            for _, prefix in columns
        ]
    )
    rows.append(
        ["errors (not scored)"] + [f"{metrics.get(prefix + 'num_errors', 0.0):.0f}" for _, prefix in columns]
    )
    rows.append(["prompts too long (no room to generate)", str(summary.num_prompts_too_long)]
                + ["-"] * (len(columns) - 1))
    return header, rows


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _scalar(value: float | Mapping[int, float] | None) -> float | None:
    return None if isinstance(value, Mapping) else value


def error_note(summary: EvalSummary, max_listed: int = 5) -> list[str]:
    """What the errors left mean for the run, then the first few of them ([] when there are none)."""
    n = summary.num_errors
    if not n:
        return []
    verdict = (
        f"more than eval.max_error_rate={summary.max_error_rate:g} allows: the run failed"
        if summary.status == "errors_left"
        else f"within eval.max_error_rate={summary.max_error_rate:g}"
    )
    listed = [
        f"prompt {e.prompt_idx} sample {e.sample_idx} ({e.agent}): {e.error}"
        for e in summary.error_samples[:max_listed]
    ]
    if n > len(listed):
        listed.append(f"... and {n - len(listed)} more (completions.jsonl has every one)")
    infra = n - summary.num_data_errors
    headline = (
        f"{infra} error sample(s) left ({infra / summary.num_completions:.1%} of {summary.num_completions}; "
        f"{verdict}). Errors are infrastructure failures, not answers: they are not scored, and re-running with "
        "the same eval.save_path retries them."
    ) if infra else ""
    headline = " ".join(x for x in (headline, data_error_note(summary)) if x)
    return [headline, *listed]


def data_error_note(summary: EvalSummary) -> str:
    """What the data errors mean ("" when there are none): the rows, and that a resume does not retry them."""
    if not summary.num_data_errors:
        return ""
    rows = ", ".join(map(str, summary.data_error_rows))
    more = " (the first ones)" if len(summary.data_error_rows) >= MAX_LISTED_ERRORS else ""
    return (
        f"{summary.num_data_errors} sample(s) are data errors: NeMo Gym refused dataset row(s) {rows}{more} of "
        f"{summary.dataset_path} as malformed (an HTTP 4xx; completions.jsonl has its answer). They are not "
        "scored and not retried while the rows are unchanged (they would be refused again): fix the rows in the "
        "dataset and re-run the same command; only those rows are rolled out again."
    )


def warn_prompt_length(summary: EvalSummary) -> None:
    """Log the run's one warning about prompts too long to generate from (nothing when there are none)."""
    PromptLengthWarning()(summary.num_prompts_too_long, summary.num_prompts, summary.longest_prompt_too_long)


def prompt_length_note(summary: EvalSummary) -> str:
    """What the prompts too long mean ("" when there are none): how many, the longest, the settings to raise."""
    n = summary.num_prompts_too_long
    if not n:
        return ""
    longest = summary.longest_prompt_too_long
    return prompts_too_long_message(n, summary.num_prompts, longest)


def format_metric_table(summary: EvalSummary) -> str:
    """The metric table as aligned plain text, with a line on stop reasons (and one on the reward components
    where the environment reports them)."""
    header, rows = metric_rows(summary)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    stops = ", ".join(f"{k}: {v}" for k, v in summary.stop_reasons.items())
    lines.append(
        f"stop reasons: {stops}; mean turns {_number(summary.mean_turns, '.2f')}; "
        f"truncation rate {_number(summary.truncation_rate, '.3f')}"
    )
    if summary.reward_components:
        lines.append("reward components (mean): " + ", ".join(
            f"{name} {stats['mean']:.4f}" for name, stats in summary.reward_components.items()))
    if DISTILL_KL in summary.metrics:
        lines.append(distill_note(summary))
    note = error_note(summary)
    lines += note[:1] + [f"  {x}" for x in note[1:]]
    if summary.num_prompts_too_long:
        lines.append(prompt_length_note(summary))
    return "\n".join(lines)


def _pass_at_k_series(summary: EvalSummary) -> list[tuple[str, list[int], list[float], list[float]]]:
    metrics = summary.metrics
    series = []
    for name, prefix in _columns(summary):
        ks = [k for k in summary.ks if f"{prefix}pass@{k}" in metrics]
        if ks:
            series.append(
                (
                    name,
                    ks,
                    [metrics[f"{prefix}pass@{k}"] for k in ks],
                    [metrics[f"{prefix}pass@{k}/stderr"] for k in ks],
                )
            )
    return series


def plot_pass_at_k(summary: EvalSummary, path: Any) -> None:
    """Write a PNG of pass@k against k (log2 axis), one line with stderr bars per agent (and overall)."""
    import matplotlib  # lazy: matplotlib loads only when a report is drawn, not for every import of evals

    matplotlib.use("Agg")  # before pyplot loads: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    try:
        series = _pass_at_k_series(summary)
        for name, ks, values, errors in series:
            ax.errorbar(ks, values, yerr=errors, marker="o", capsize=3, label=name)
        ks_all: Sequence[int] = summary.ks
        if len(ks_all) > 1 and max(ks_all) / min(ks_all) >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(list(ks_all), [str(k) for k in ks_all])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("k")
        ax.set_ylabel(f"pass@k (reward >= {summary.reward_threshold:g})")
        ax.set_title(f"{summary.model}: {summary.num_prompts} prompts, {summary.rollout_mode}")
        ax.grid(alpha=0.3)
        if series:  # no pass@k at all (every sample errored): an empty plot, and no legend to draw
            ax.legend()
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def gym_metric_lines(summary: EvalSummary) -> list[str]:
    """Markdown lines for Gym's own per-agent aggregate (`summary.gym_metrics`, nemo_gym mode): its
    key metrics (every scalar one), or the error that kept Gym from answering; [] without one."""
    gym = summary.gym_metrics
    if not gym:
        return []
    lines = ["", "## NeMo Gym's aggregate metrics (`/aggregate_metrics`)", ""]
    for agent, entry in gym.items():
        if entry.error:
            lines.append(f"- `{agent}`: not available ({entry.error})")
            continue
        scalars = {k: v for k, v in (entry.key_metrics or {}).items() if isinstance(v, int | float | str)}
        shown = ", ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in scalars.items())
        lines.append(f"- `{agent}`: {shown or 'no key metrics'}")
    return lines


def component_lines(summary: EvalSummary) -> list[str]:
    """The report's "Reward components" section: one row per named component ([] where none was reported)."""
    if not summary.reward_components:
        return []
    rows = [
        [f"`{name}`", f"{s['mean']:.4f}", f"{s['min']:.4g}", f"{s['max']:.4g}", str(int(s["num_samples"]))]
        for name, s in summary.reward_components.items()
    ]
    return ["", "## Reward components", "", "Over the non-error samples that report each one.", "",
            *_markdown_table(["component", "mean", "min", "max", "samples"], rows)]


def _profile_columns(summary: EvalSummary) -> list[tuple[str, TaskProfile]]:
    """(header, profile): overall, then each task when there is more than one (as the metric table)."""
    profile = summary.profile
    assert profile is not None
    if len(profile.tasks) == 1:
        return list(profile.tasks.items())
    return [("all", profile.overall), *profile.tasks.items()]


def profile_rows(summary: EvalSummary) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the reward-profile table: one column per task (and overall), [] rows without one."""
    if summary.profile is None:
        return [], []
    columns = _profile_columns(summary)
    ks = summary.ks

    def row(name: str, cell: Any) -> list[str]:
        return [name] + [cell(t) for _, t in columns]

    formats = {m.name: m.report_format for m in metric_defs()}
    metric_rows: list[list[str]] = []
    for name, value in columns[0][1].metrics.items():  # every task has the same metrics, in metric_defs() order
        spec = formats.get(name, ".3f")
        if isinstance(value, Mapping):
            metric_rows += [row(f"{name}@{k}", lambda t, name=name, k=k, spec=spec: _number(t.per_k(name).get(k), spec))
                            for k in ks]
        else:
            metric_rows.append(row(name.replace("_", " "), lambda t, name=name, spec=spec: _number(
                _scalar(t.metrics.get(name)), spec)))
    rows = [
        row("prompts / samples", lambda t: f"{t.num_prompts} / {t.num_samples}"),
        *metric_rows,
        row("error rate", lambda t: f"{t.error_rate:.3f}"),
        row("truncation rate", lambda t: _number(t.truncation_rate, ".3f")),
        row("turns (mean)", lambda t: _number(t.mean_turns, ".2f")),
        row("generated tokens (mean / p95)",
            lambda t: f"{_number(t.generated_tokens.mean, '.1f')} / {_number(t.generated_tokens.p95, '.1f')}"),
        row("rollout latency s (p50 / p95)",
            lambda t: f"{_number(t.latency_s.p50, '.3f')} / {_number(t.latency_s.p95, '.3f')}"),
        row("samples with latency", lambda t: f"{t.latency_s.num_samples}"),
    ]
    return ["per task", *(name for name, _ in columns)], rows


def difficulty_rows(summary: EvalSummary) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the difficulty histogram: prompts per solved-fraction bin, one column per task."""
    if summary.profile is None:
        return [], []
    columns = _profile_columns(summary)
    rows = [[f"solved {b}"] + [str(t.difficulty[b]) for _, t in columns] for b in DIFFICULTY_BINS]
    rows.append(["every sample an error"] + [str(t.num_prompts_unscored) for _, t in columns])
    return ["prompts", *(name for name, _ in columns)], rows


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def profile_lines(summary: EvalSummary, plot_name: str = PROFILE_PLOT) -> list[str]:
    """The report's "Reward profile" section ([] for a summary without a profile)."""
    if summary.profile is None:
        return []
    return [
        "",
        "## Reward profile",
        "",
        f"Per task, over the non-error samples (errors are counted in the error rate only); latency is each "
        f"sample's rollout wall time; a prompt's solved fraction is its samples with reward >= "
        f"{summary.reward_threshold:g} (per prompt in `{DIFFICULTY_FILE}`).",
        "",
        *_markdown_table(*profile_rows(summary)),
        "",
        *_markdown_table(*difficulty_rows(summary)),
        "",
        f"![reward profile per task]({plot_name})",
    ]


def plot_reward_profile(summary: EvalSummary, path: Any) -> None:
    """Write a PNG of the profile: per task, rates (mean reward, pass@k at the smallest and largest k, error,
    truncation), generated tokens and rollout latency (p50 and p95), and the difficulty histogram (prompts
    per solved fraction)."""
    import matplotlib  # lazy: matplotlib loads only when a report is drawn, not for every import of evals

    matplotlib.use("Agg")  # before pyplot loads: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    columns = _profile_columns(summary)
    names = [name for name, _ in columns]
    x = np.arange(len(columns))
    k = max(summary.ks) if summary.ks else None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), dpi=100)
    try:
        (rates, tokens), (latency, difficulty) = axes

        def bars(ax: Any, series: list[tuple[str, list[float | None]]], ylabel: str) -> None:
            width = 0.8 / len(series)
            for i, (label, values) in enumerate(series):
                ax.bar(x + (i - (len(series) - 1) / 2) * width, [np.nan if v is None else v for v in values],
                       width, label=label)
            ax.set_xticks(x, names)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize="small")

        rate_series: list[tuple[str, list[float | None]]] = [("mean reward", [t.mean_reward for _, t in columns])]
        for kk in sorted({min(summary.ks), k} if k is not None else ()):
            rate_series.append((f"pass@{kk}", [t.pass_at_k.get(kk) for _, t in columns]))
        rate_series += [("error rate", [t.error_rate for _, t in columns]),
                        ("truncation rate", [t.truncation_rate for _, t in columns])]
        bars(rates, rate_series, "fraction")
        rates.set_ylim(0, 1.05)
        bars(tokens, [("mean", [t.generated_tokens.mean for _, t in columns]),
                      ("p95", [t.generated_tokens.p95 for _, t in columns])], "generated tokens per sample")
        bars(latency, [("p50", [t.latency_s.p50 for _, t in columns]),
                       ("p95", [t.latency_s.p95 for _, t in columns])], "rollout latency (s)")
        bins = np.arange(len(DIFFICULTY_BINS))
        width = 0.8 / len(columns)
        for i, (name, t) in enumerate(columns):
            difficulty.bar(bins + (i - (len(columns) - 1) / 2) * width, [t.difficulty[b] for b in DIFFICULTY_BINS],
                           width, label=name)
        difficulty.set_xticks(bins, DIFFICULTY_BINS, fontsize="small")
        difficulty.set_xlabel(f"fraction of a prompt's samples solved (reward >= {summary.reward_threshold:g})")
        difficulty.set_ylabel("prompts")
        difficulty.yaxis.set_major_locator(MaxNLocator(integer=True))
        difficulty.grid(alpha=0.3, axis="y")
        difficulty.legend(fontsize="small")
        fig.suptitle(f"{summary.model}: reward profile, {summary.num_prompts} prompts, {summary.rollout_mode}")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def definition_lines(summary: EvalSummary) -> list[str]:
    """One line per metric of the table that has a description: its key and what it measures."""
    return [f"- `{m.name}@k`: {m.description}" if m.per_k else f"- `{m.name}`: {m.description}"
            for m in shown_metrics(summary) if m.description]


DISTILL_KL = "distill/reverse_kl"
"""The summary's student-teacher KL key (on-policy distillation's teacher scored the samples)."""


def distill_note(summary: EvalSummary) -> str:
    """One line: the student-teacher KL per token, overall and per agent, and the tokens it is over."""
    m = summary.metrics
    agents = [f"{a} {m[f'{DISTILL_KL}/{a}']:.4f}" for a in summary.agents if f"{DISTILL_KL}/{a}" in m]
    return (f"student-teacher KL ({DISTILL_KL}, per token): {m[DISTILL_KL]:.4f} over "
            f"{int(m.get('distill/scored_tokens', 0))} scored tokens" + (f"; {', '.join(agents)}" if agents else ""))


def distill_lines(summary: EvalSummary) -> list[str]:
    """The report's "Student-teacher KL" section ([] where no teacher scored the samples)."""
    if DISTILL_KL not in summary.metrics:
        return []
    return ["", "## Student-teacher KL", "",
            "The mean over the teacher-scored assistant tokens of the non-error samples of generation logprob - "
            "teacher logprob (an estimate of KL(student || teacher) on the sampled tokens).", "",
            distill_note(summary)]


def markdown_report(summary: EvalSummary, plot_name: str) -> str:
    """A short Markdown summary: what was run, the metric table and what each metric is, the plot, the reward
    profile."""
    table = _markdown_table(*metric_rows(summary))
    stops = ", ".join(f"{k}: {v}" for k, v in summary.stop_reasons.items())
    note = error_note(summary, max_listed=20)
    return "\n".join(
        [
            f"# Eval: {summary.model} on {summary.dataset_path}",
            "",
            f"- mode: `{summary.rollout_mode}`; {summary.num_prompts} prompts, "
            f"{summary.num_completions} completions; agents: {', '.join(summary.agents)}",
            f"- correct: reward >= {summary.reward_threshold:g}; values are means over prompts ± standard error",
            f"- stop reasons: {stops}; errors: {summary.num_errors}; "
            f"mean turns: {_number(summary.mean_turns, '.2f')}; "
            f"truncation rate: {_number(summary.truncation_rate, '.3f')}",
            f"- status: `{summary.status}`",
            *(["", f"**{note[0]}**", "", *(f"- {x}" for x in note[1:])] if note else []),
            *(["", f"**{prompt_length_note(summary)}**"] if summary.num_prompts_too_long else []),
            "",
            *table,
            "",
            *definition_lines(summary),
            "",
            f"![pass@k against k]({plot_name})",
            *component_lines(summary),
            *distill_lines(summary),
            *profile_lines(summary),
            *gym_metric_lines(summary),
            "",
        ]
    )


def write_report(summary: EvalSummary, paths: EvalPaths) -> None:
    """Write the PNG plots, the Markdown summary and (when the summary has its per-prompt rows)
    difficulty.jsonl into the output folder."""
    plot_pass_at_k(summary, paths.plot)
    if summary.profile is not None:
        plot_reward_profile(summary, paths.root / PROFILE_PLOT)
        if summary.profile.prompts is not None:
            write_difficulty(paths.root / DIFFICULTY_FILE, summary.profile.prompts)
    paths.report.write_text(markdown_report(summary, paths.plot.name))
