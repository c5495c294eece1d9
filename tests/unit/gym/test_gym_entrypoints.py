"""Which script the launcher starts for a Gym server (`entrypoint_problems`, the check before anything starts):
the server's `entrypoint` in its folder, as `ng_run` runs it; the real start is tests/functional/test_gym_entrypoint.py."""

from __future__ import annotations

from pathlib import Path

from nemo_rl_ext.gym.launcher import entrypoint_problems


def server(folder: Path, entrypoint: str | None) -> dict:
    return {"type": "resources_servers", "impl": "equivalence_rule", "dir": str(folder), "entrypoint": entrypoint,
            "host": "127.0.0.1", "port": 1}


def test_an_entrypoint_in_the_server_folder_passes(tmp_path):
    (tmp_path / "boom.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "serve.py").write_text("")
    assert entrypoint_problems({"a": server(tmp_path, "boom.py"), "b": server(tmp_path, "sub/serve.py")}) == []


def test_every_server_that_cannot_start_is_named_with_its_key_at_once(tmp_path):
    (tmp_path / "app.py").write_text("")
    problems = entrypoint_problems({
        "fine": server(tmp_path, "app.py"),
        "missing_file": server(tmp_path, "boom.py"),
        "absolute": server(tmp_path, str(tmp_path / "app.py")),
        "no_key": server(tmp_path, None),
    })
    assert problems == [
        f"NeMo Gym server 'missing_file': missing_file.resources_servers.equivalence_rule.entrypoint='boom.py': "
        f"no such file in the server's folder {tmp_path}",
        f"NeMo Gym server 'absolute': absolute.resources_servers.equivalence_rule.entrypoint="
        f"'{tmp_path / 'app.py'}' must be relative to the server's folder {tmp_path}, as Gym requires",
        "NeMo Gym server 'no_key': no_key.resources_servers.equivalence_rule.entrypoint is missing (the script "
        "Gym starts, e.g. app.py)",
    ]
