"""Plugins: modules that register environments, backends, metrics or rollout modes, loaded by the CLIs at start.

Two ways in, both before a config is validated (so the names a plugin registers are known to it):

- `--import MODULE` (repeatable) on `examples/run_eval.py`, `examples/run_grpo.py` and the policy server's CLI;
- an installed package's entry points in the group `nemo_rl_ext.plugins` (loaded first), e.g. in its
  pyproject.toml:

      [project.entry-points."nemo_rl_ext.plugins"]
      my_plugin = "my_project.register"          # a module: importing it registers
      # or "my_project.register:setup"           # a function: called with no arguments after the import

A plugin that fails to load is one `PluginError` (a `ConfigError`: the CLIs print it and exit 2) naming it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import traceback
from collections.abc import Sequence

from nemo_rl_ext.config import ConfigError

ENTRY_POINT_GROUP = "nemo_rl_ext.plugins"
"""The entry-point group whose entries `load_plugins` loads."""


class PluginError(ConfigError):
    """A plugin module (an `--import` or an entry point) could not be loaded; the message names it and why."""


def load_plugins(modules: Sequence[str] = (), *, entry_points: bool = True) -> list[str]:
    """Load the `nemo_rl_ext.plugins` entry points (with `entry_points`), then import each of `modules`, in order;
    returns what was loaded (entry points as `name = value`). Importing a module twice is a no-op."""
    loaded: list[str] = []
    if entry_points:
        for entry in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            _load_entry_point(entry)
            loaded.append(f"{entry.name} = {entry.value}")
    for module in modules:
        if not module or not all(part.isidentifier() for part in module.split(".")):
            raise PluginError(f"--import {module!r}: not a module name (e.g. my_project.plugins)")
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise PluginError(f"--import {module}: the module failed to import: {_cause(exc)}") from exc
        loaded.append(module)
    return loaded


def _load_entry_point(entry: importlib.metadata.EntryPoint) -> None:
    where = f"plugin entry point {entry.name!r} ({entry.value}, group {ENTRY_POINT_GROUP}"
    dist = getattr(entry, "dist", None)
    where += f", package {dist.name})" if dist is not None else ")"
    try:
        target = entry.load()
    except Exception as exc:
        raise PluginError(f"{where} failed to load: {_cause(exc)}") from exc
    if entry.attr is not None:
        if not callable(target):
            raise PluginError(f"{where}: {entry.attr} is not callable")
        try:
            target()
        except Exception as exc:
            raise PluginError(f"{where}: {entry.attr}() raised {_cause(exc)}") from exc


def _cause(exc: BaseException) -> str:
    """The exception and where in the plugin it was raised (its last frame), in one line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]  # not importlib's
    place = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{place}"


def add_import_argument(parser, before: str = "the config is read") -> None:
    """Add `--import MODULE` (repeatable, into `args.imports`) to an argparse parser; `before` says when the
    CLI imports it (its help text)."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help=f"import MODULE before {before} (repeatable): a plugin that registers environments, "
        f"backends, metrics or rollout modes; installed plugins (entry-point group {ENTRY_POINT_GROUP}) load too",
    )
