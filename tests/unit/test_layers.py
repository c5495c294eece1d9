"""The import contracts of pyproject.toml ([tool.importlinter]) hold: an upward import breaks the layers (and, as a cycle
between two packages, the no-cycle contract too); a cycle between two modules of one package, even through an import
inside a function, breaks the no-cycle contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (dev extra)")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=120
    )


def _copy_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "nemo_rl_ext", tree / "nemo_rl_ext", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def test_the_package_keeps_its_layers(tmp_path: Path) -> None:
    result = _lint(_copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "upward"),
    [
        ("data/records.py", "nemo_rl_ext.experience.rollout_manager"),
        ("models/generation/interfaces.py", "nemo_rl_ext.serving.policy_server"),
        ("environments/math_env.py", "nemo_rl_ext.evals.metrics"),
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path: Path, module: str, upward: str) -> None:
    tree = _copy_tree(tmp_path)
    target = tree / "nemo_rl_ext" / module
    target.write_text(target.read_text() + f"\n\ndef _upward():\n    import {upward}  # noqa: F401\n")
    result = _lint(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "0 kept, 2 broken" in result.stdout  # the layers, and the cycle it makes between two packages
    importer = "nemo_rl_ext." + module.removesuffix(".py").replace("/", ".")
    assert f"{importer} -> {upward}" in result.stdout, result.stdout



def test_a_cycle_inside_a_package_breaks_the_no_cycle_contract(tmp_path: Path) -> None:
    tree = _copy_tree(tmp_path)
    target = tree / "nemo_rl_ext" / "evals" / "store.py"  # rollout.py imports store.py: this closes a cycle
    target.write_text(target.read_text() + "\n\ndef _cycle():\n    import nemo_rl_ext.evals.rollout  # noqa: F401\n")
    result = _lint(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 kept, 1 broken" in result.stdout  # same layer: only the no-cycle contract sees it
    assert "No cycles are allowed in nemo_rl_ext.evals." in result.stdout, result.stdout
    assert "- .store -> .rollout (1 import)" in result.stdout, result.stdout
