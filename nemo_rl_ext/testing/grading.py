"""A grading fault: the `math` environment, whose grading workers die by SIGKILL mid-grade on demand.

The kill happens inside the real worker process of the real grading pool, as the out-of-memory killer (or an
operator) would do it, while a flag file exists, so a test can turn the fault on for one run and off for the
resume.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from nemo_rl_ext.environments.math_env import MathEnvironment
from nemo_rl_ext.environments.math_grading import Grade, grade_answer

KILL_AFTER_S = 0.3
"""How long a doomed worker grades before it is killed (so the pool has seen it take the answer)."""


def grade_or_die(kill_flag: str, kill_truths: tuple[str, ...] | None, response: str, ground_truth: Any) -> Grade:
    """`grade_answer`, run in a grading worker; while the file `kill_flag` exists (and the ground truth is one
    of `kill_truths`, None: any), the worker kills itself with SIGKILL mid-grade instead."""
    if os.path.exists(kill_flag) and (kill_truths is None or str(ground_truth).strip() in kill_truths):
        time.sleep(KILL_AFTER_S)
        os.kill(os.getpid(), signal.SIGKILL)
    return grade_answer(response, ground_truth)


class KilledGradingMathEnvironment(MathEnvironment):
    """`math`, except that while the file `kill_flag` exists the grading worker of each answer whose ground
    truth is in `kill_truths` (None: every answer) is killed by SIGKILL mid-grade."""

    def __init__(self, kill_flag: str, kill_truths: Sequence[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        truths = None if kill_truths is None else tuple(str(t).strip() for t in kill_truths)
        self.grader.grade_function = functools.partial(grade_or_die, str(kill_flag), truths)
