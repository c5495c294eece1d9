"""The environment of the example scripts the functional tests start as subprocesses."""

from __future__ import annotations

import os


def one_thread_env() -> dict[str, str]:
    """This process's environment, unbuffered output, and one OpenMP (torch) thread: a child on a loaded 2-core
    machine then computes as an in-process run under the `one_torch_thread` fixture does (two threads ran
    10-16x slower there, measured, and their float32 reductions are not always repeatable)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
