"""What an eval call returns: `EvalResult`, from a run in this process, its jobs, or its Ray workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_rl_ext.evals.store import EvalPaths
from nemo_rl_ext.evals.summary import EvalSummary

__all__ = ["EvalResult"]


@dataclass(frozen=True)
class EvalResult:
    """What one `run_eval` call did and found."""

    paths: EvalPaths
    """The output files."""
    complete: bool
    """True when every (prompt, sample) has a result or an error line (then `summary` is set and written)."""
    summary: EvalSummary | None
    """The summary (also in summary.json), or None when the run stopped early."""
    groups_generated: int
    """Groups rolled out by this call (resumed groups already complete are not counted)."""
    completions_written: int
    """Lines this call appended (error lines included)."""
    skipped_completions: int
    """(prompt, sample) pairs whose result was found on disk and not generated again."""
    wall_time_s: float
    """Wall time of this call."""
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    """The manager's metrics over this call's groups (empty when nothing was generated)."""
    errors_written: int = 0
    """Error lines this call appended (infrastructure failures recorded, to be retried)."""
    retried: int = 0
    """(prompt, sample) pairs whose latest line was an error when this call started (rolled out again)."""
    waiting_for: tuple[str, ...] = ()
    """Jobs of a sharded or seeded run: the stores not finished yet (so nothing was merged); empty otherwise."""

    @property
    def errors_left(self) -> bool:
        """True when the run finished with more errors than `eval.max_error_rate` allows."""
        return self.summary is not None and self.summary.status == "errors_left"
