"""A Gym server's `entrypoint` is the script the launcher runs (`direct` mode), as `ng_run` runs it: a script that
raises fails the start-up naming the server and the script's error, a custom script is what runs, and a script
that is not in the server's folder is refused before anything starts. Real NeMo Gym 0.7.0 (its resolver and
equivalence_rule server), one resources server per launch; server folders of our own come first through
NEMO_GYM_EXTRA_ROOTS, as in Gym."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from nemo_rl_ext.gym.config import GymLaunchConfig
from nemo_rl_ext.gym.launcher import GymLauncher, GymLaunchError

pytestmark = [pytest.mark.gym, pytest.mark.timeout(300)]
SERVER = "arithmetic_equivalence"


def one_server_config(folder: Path, entrypoint: str) -> Path:
    """A Gym config with one equivalence_rule resources server whose entrypoint is `entrypoint`."""
    path = folder / "gym.yaml"
    path.write_text(yaml.safe_dump({SERVER: {"resources_servers": {"equivalence_rule": {
        "entrypoint": entrypoint, "grading_rule": "exact", "domain": "math", "verified": False,
        "description": "arithmetic answers"}}}}))
    return path


def own_server_folder(gym_venv: Path, roots: Path, script: str, text: str) -> Path:
    """resources_servers/equivalence_rule under `roots`: Gym's own folder copied, plus `script`."""
    (site,) = (gym_venv / "lib").glob("python3*/site-packages")
    folder = roots / "resources_servers" / "equivalence_rule"
    shutil.copytree(site / "resources_servers" / "equivalence_rule", folder,
                    ignore=shutil.ignore_patterns("__pycache__", "data", "tests"))
    (folder / script).write_text(text)
    return folder


def launcher(gym_venv: Path, config: Path, work: Path) -> GymLauncher:
    cfg = GymLaunchConfig(gym_venv=gym_venv, config_paths=(config,), work_dir=work, startup_timeout_s=120)
    return GymLauncher(cfg, policy_base_url="http://127.0.0.1:9/v1", policy_model_name="unused")


def test_a_server_whose_entrypoint_raises_fails_the_start_naming_it(gym_venv, tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_EXTRA_ROOTS", str(tmp_path / "roots"))
    own_server_folder(gym_venv, tmp_path / "roots", "boom.py", "raise RuntimeError('boom: this script raises')\n")
    gym = launcher(gym_venv, one_server_config(tmp_path, "boom.py"), tmp_path / "work")
    with pytest.raises(GymLaunchError) as err:
        gym.start()  # before: Gym's app.py ran instead and the server came up healthy
    assert f"NeMo Gym server {SERVER!r} exited during start-up (exit code 1): RuntimeError: boom: this script " \
           f"raises; its log: {tmp_path / 'work' / SERVER}.log" in str(err.value), str(err.value)


def test_a_custom_entrypoint_is_the_script_that_runs(gym_venv, tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_GYM_EXTRA_ROOTS", str(tmp_path / "roots"))
    own_server_folder(gym_venv, tmp_path / "roots", "serve.py",
                      "print('custom entrypoint serve.py', flush=True)\n"
                      "import runpy\nrunpy.run_path('app.py', run_name='__main__')\n")
    gym = launcher(gym_venv, one_server_config(tmp_path, "serve.py"), tmp_path / "work")
    try:
        assert gym.start() == {}  # no agent: the one resources server, healthy
        assert set(gym.servers) == {SERVER}
    finally:
        gym.stop()
    assert "custom entrypoint serve.py" in (tmp_path / "work" / f"{SERVER}.log").read_text()


def test_an_entrypoint_not_in_the_server_folder_is_refused_before_anything_starts(gym_venv, tmp_path):
    """The issue's config: Gym's own equivalence_rule folder, `entrypoint: boom.py`, which it does not hold."""
    gym = launcher(gym_venv, one_server_config(tmp_path, "boom.py"), tmp_path / "work")
    with pytest.raises(GymLaunchError, match=rf"NeMo Gym server '{SERVER}': {SERVER}\.resources_servers\."
                       r"equivalence_rule\.entrypoint='boom\.py': no such file in the server's folder .*"
                       r"site-packages/resources_servers/equivalence_rule$"):
        gym.start()
    assert not (tmp_path / "work" / f"{SERVER}.log").exists()  # nothing was started
