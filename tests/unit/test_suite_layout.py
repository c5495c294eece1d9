"""The test suite can be collected as one run: pytest imports test files by basename (rootdir-relative, no
packages), so two files with the same name in tests/unit and tests/functional break `make test`'s collection
even though each folder passes alone."""

from __future__ import annotations

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
