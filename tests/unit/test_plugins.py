"""Plugin loading (`nemo_rl_ext.plugins`): `--import` modules and the `nemo_rl_ext.plugins` entry points, and a
plugin that fails to load as one error naming it (exit 2, no traceback) on the CLIs. The CLIs using what plugins
register: tests/functional/test_plugin_clis.py."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from nemo_rl_ext.plugins import ENTRY_POINT_GROUP, PluginError, load_plugins
from nemo_rl_ext.serving import policy_server

REPO = Path(__file__).resolve().parents[2]
BROKEN = "error: --import t27_unit_broken: the module failed to import: ModuleNotFoundError: No module named " \
         "'no_such_dependency_t27' (at {path}:1)"


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A folder on sys.path holding plugin modules and a dist-info whose entry points importlib.metadata finds."""
    (tmp_path / "t27_unit_broken.py").write_text("import no_such_dependency_t27\n")
    (tmp_path / "t27_unit_setup.py").write_text("CALLS = []\n\ndef setup():\n    CALLS.append('setup')\n")
    (tmp_path / "t27_unit_raises.py").write_text("def setup():\n    raise RuntimeError('no GPU here')\n")
    dist = tmp_path / "t27_unit-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: t27-unit\nVersion: 0.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("t27_unit_broken", "t27_unit_setup", "t27_unit_raises"):
        sys.modules.pop(name, None)


def entry_points(site: Path, text: str) -> None:
    (site / "t27_unit-0.1.dist-info" / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{text}")


def test_entry_points_load_first_then_imports(site) -> None:
    entry_points(site, "setup = t27_unit_setup:setup\n")
    assert load_plugins(["json"]) == ["setup = t27_unit_setup:setup", "json"]
    assert sys.modules["t27_unit_setup"].CALLS == ["setup"]
    assert load_plugins([], entry_points=False) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("broken = t27_unit_broken\n", r"plugin entry point 'broken' \(t27_unit_broken, group nemo_rl_ext.plugins, "
         r"package t27-unit\) failed to load: ModuleNotFoundError: No module named 'no_such_dependency_t27'"),
        ("raises = t27_unit_raises:setup\n", r"plugin entry point 'raises' .*: setup\(\) raised RuntimeError: no GPU "
         r"here \(at .*t27_unit_raises.py:2\)"),
    ],
)
def test_an_entry_point_that_fails_is_one_error_naming_it_and_its_package(site, text, message) -> None:
    entry_points(site, text)
    with pytest.raises(PluginError, match=message):
        load_plugins()


def test_a_bad_module_name_is_refused(site) -> None:
    with pytest.raises(PluginError, match=r"--import 'my-plugin': not a module name"):
        load_plugins(["my-plugin"], entry_points=False)


def test_the_clis_print_one_error_naming_the_module_and_exit_2(site, capsys) -> None:
    expected = BROKEN.format(path=site / "t27_unit_broken.py")
    spec = importlib.util.spec_from_file_location("run_eval_cli", REPO / "examples" / "run_eval.py")
    run_eval = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_eval)
    assert run_eval.main(["--config", "examples/configs/evals/eval.yaml", "--import", "t27_unit_broken"]) == 2
    assert capsys.readouterr().err.strip() == expected
    with pytest.raises(SystemExit) as stop:
        policy_server.main(["--model", "tiny", "--import", "t27_unit_broken"])
    assert stop.value.code == 2 and capsys.readouterr().err.strip() == expected
    spec = importlib.util.spec_from_file_location("run_grpo_cli", REPO / "examples" / "run_grpo.py")
    run_grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_grpo)
    assert run_grpo.main(["--config", "examples/configs/grpo_smollm2.yaml", "--import", "t27_unit_broken"]) == 2
    assert re.fullmatch(re.escape(expected), capsys.readouterr().err.strip())
