"""Run BY THE NEMO GYM VENV's python (not imported by nemo_rl_ext): resolve Gym config files.

    <gym-venv>/bin/python resolve_gym_config.py --policy-base-url URL --policy-model-name NAME CONFIG.yaml ...

Prints one JSON object: {"yaml": <the resolved global config as YAML>, "servers": {instance name:
{"type", "impl", "dir", "entrypoint", "host", "port"}}}. Gym's own parser fills in hosts (127.0.0.1) and free
ports. `dir` is found as `ng_run` finds it (`nemo_gym.cli.env._resolve_server_dir`): the first of the
NEMO_GYM_EXTRA_ROOTS, then the `--search-root`s (the launcher's caller's working directory, which is `ng_run`'s
cwd, then the project's own servers), then the Gym install, holding `<type>/<impl>/` with a requirements.txt or pyproject.toml; `entrypoint` is
the server's `entrypoint` key as written (None when absent), the script `ng_run` runs in that folder.
"""

import argparse
import json
import os
from pathlib import Path

from nemo_gym import NEMO_GYM_EXTRA_ROOTS_ENV_VAR_NAME, _resolve_under_cwd_or_install
from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
from omegaconf import OmegaConf

SERVER_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models", "environment_servers")


def server_dir(server_type: str, impl: str) -> Path:
    """The server's folder, as `nemo_gym.cli.env._resolve_server_dir` finds it (not imported: 3 s more)."""
    return _resolve_under_cwd_or_install(
        Path(server_type, impl), validator=lambda d: (d / "requirements.txt").exists() or (d / "pyproject.toml").exists()
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config_paths", nargs="+")
    parser.add_argument("--policy-base-url", required=True)
    parser.add_argument("--policy-api-key", default="dummy")
    parser.add_argument("--policy-model-name", required=True)
    parser.add_argument("--search-root", action="append", default=[], help="searched for server folders after "
                        "NEMO_GYM_EXTRA_ROOTS, before the Gym install")
    args = parser.parse_args()
    extra = [r for r in os.environ.get(NEMO_GYM_EXTRA_ROOTS_ENV_VAR_NAME, "").split(os.pathsep) if r]
    os.environ[NEMO_GYM_EXTRA_ROOTS_ENV_VAR_NAME] = os.pathsep.join([*extra, *args.search_root])
    initial = OmegaConf.create(
        {
            "config_paths": [str(Path(p).resolve()) for p in args.config_paths],
            "policy_base_url": args.policy_base_url,
            "policy_api_key": args.policy_api_key,
            "policy_model_name": args.policy_model_name,
        }
    )
    cfg = GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=initial, skip_load_from_cli=True, skip_load_from_dotenv=True
        )
    )
    servers = {}
    for name, block in cfg.items():
        if not OmegaConf.is_dict(block) or len(block) != 1:
            continue
        ((server_type, inner),) = block.items()
        if server_type not in SERVER_TYPES or not OmegaConf.is_dict(inner) or len(inner) != 1:
            continue
        ((impl, server_cfg),) = inner.items()
        servers[str(name)] = {
            "type": server_type,
            "impl": str(impl),
            "dir": str(server_dir(server_type, str(impl))),
            "entrypoint": None if server_cfg.get("entrypoint") is None else str(server_cfg.get("entrypoint")),
            "host": server_cfg.get("host"),
            "port": server_cfg.get("port"),
        }
    print(json.dumps({"yaml": OmegaConf.to_yaml(cfg), "servers": servers}))


if __name__ == "__main__":
    main()
