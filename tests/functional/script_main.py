"""An example script's own `main(argv)` run in this process, its outcome shaped as a subprocess's.

A CLI subprocess spends seconds importing torch, transformers and peft before the same `main` runs. Where a test's
property is what a user error prints (one `error:` line, exit code 2, no traceback), not the process, the script's
`main` proves it in-process; each script still goes through a real process in at least one test
(`test_cli_errors.cli`, `test_export.export_cli`), which also shows what a fresh interpreter prints at import.
"""

from __future__ import annotations

import gc
import logging
import runpy
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_MAINS: dict[str, Callable[[list[str]], int]] = {}
_PYTHON_DEFAULT_FILTERS = [
    ("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""), ("ignore", ImportWarning, ""), ("ignore", ResourceWarning, ""),
]
"""`warnings.filters` of a plain `python script.py` (no -W, no PYTHONWARNINGS), in their order."""


def script_main(capsys: pytest.CaptureFixture[str], script: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """`examples/SCRIPT ARGS` through the script's `main`: its return code and what it printed, log records and
    warnings included as a fresh process prints them (`_as_a_fresh_process`). An exception that escapes `main`
    (a traceback in a process) fails the test that called this."""
    if script not in _MAINS:
        _MAINS[script] = runpy.run_path(str(REPO / "examples" / script))["main"]
    capsys.readouterr()  # what the test printed before: not the script's
    with _as_a_fresh_process():
        code = _MAINS[script]([str(a) for a in args])
    out = capsys.readouterr()
    return subprocess.CompletedProcess([script, *map(str, args)], code, out.out, out.err)


@contextmanager
def _as_a_fresh_process() -> Iterator[None]:
    """The root logger without pytest's handlers (records go to logging's last-resort handler, which prints WARNING
    and above on stderr, unless the script's `logging.basicConfig` installs its own) and Python's default warning
    filters, shown on stderr; pytest's handlers, level and warning capture come back afterwards, and the objects a
    script's `freeze_startup_heap` froze go back to the garbage collector (a process would have ended)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    root.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in _PYTHON_DEFAULT_FILTERS:
                warnings.filterwarnings(action, category=category, module=module, append=True)
            warnings.showwarning = _print_warning  # pytest would record them instead
            yield
    finally:
        gc.unfreeze()
        for added in root.handlers[:]:
            root.removeHandler(added)
        root.handlers[:] = handlers
        root.setLevel(level)


def _print_warning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    """What Python's own `warnings.showwarning` prints, on this moment's (captured) stderr."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
