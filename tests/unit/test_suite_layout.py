"""The test suite can be collected as one run: pytest imports test files by basename (rootdir-relative, no
packages), so two files with the same name in tests/unit and tests/functional break `make test`'s collection
even though each folder passes alone."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique() -> None:
    found: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            found[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in found.items() if len(paths) > 1 and name != "conftest.py"}
    assert not clashes, f"test modules share a basename (rename one): {clashes}"


def test_the_slow_files_run_first_names_only_existing_files() -> None:
    """tests/conftest.py's SLOW_FILES_FIRST (the order `make test` schedules files in) names files that exist,
    each once: a renamed file would silently drop back to the end of the run."""
    spec = importlib.util.spec_from_file_location("tests_root_conftest", TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    slow = module.SLOW_FILES_FIRST
    names = {path.name for path in TESTS.rglob("test_*.py")}
    assert len(set(slow)) == len(slow), slow
    assert not set(slow) - names, f"not a test file: {sorted(set(slow) - names)}"
