"""Starting NeMo Gym servers from a Gym venv, waiting until they are healthy, and stopping them.

Two modes (docs/nemo_gym.md has the measurements behind them):
- `direct` (default): each server's `entrypoint` (`app.py` in Gym's configs) is started, as `ng_run` starts it, with
  the resolved config in its environment; a server without one, or whose script is not in its folder, is refused
  before anything starts (`entrypoint_problems`). No Ray and no head server; every socket is on 127.0.0.1; up in
  ~7 s on 2 cores. A server's folder is found as `ng_run` finds it: NEMO_GYM_EXTRA_ROOTS, then the caller's
  working directory, then the project's own servers (`servers/`, SHIPPED_SERVERS), then the Gym install
  (`resolve_gym_config.py`).
- `ng_run`: Gym's own launcher (`ng_run`, alias of `gym env start`) with a head server; it also starts
  a Ray cluster, which listens on every interface, and takes ~40 s. Stopped with SIGTERM, then SIGKILL
  of its process group (Ray's agents ignore SIGTERM).
Either way the launcher returns agent name -> URL, and `stop()` leaves no process behind. `servers`
then lists every server with the servers it calls and its process, for the client's health checks.

If our process dies without calling `stop()` (SIGKILL, a crash, a second SIGTERM), a watchdog process
(`watchdog.py`, one per launch) notices that its stdin pipe closed and stops every process group the
launcher started: SIGTERM, then SIGKILL 3 s later. A `stop()` called while `start()` is still waiting
for the servers (a signal during start-up) makes `start()` raise at once instead of waiting them out.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from nemo_rl_ext.gym.config import GymLaunchConfig, gym_site_packages, resolve_gym_path
from nemo_rl_ext.gym.errors import GymLaunchError
from nemo_rl_ext.gym.health import GymServer, servers_from_config
from nemo_rl_ext.lifecycle import on_force_stop

logger = logging.getLogger(__name__)

RESOLVER = Path(__file__).with_name("resolve_gym_config.py")
SHIPPED_SERVERS = Path(__file__).with_name("servers")
"""The project's own Gym servers (`resources_servers/arithmetic_grader`), searched after the caller's working
directory and before the Gym install."""
WATCHDOG = Path(__file__).with_name("watchdog.py")
DIRECT_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models")
_LOG_TAIL_CHARS = 3000
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b")
"""A log line naming an exception, as a traceback's last line does (`module.SomeError: message`)."""
_ERROR_LINE_CHARS = 300


POLICY_MODEL_BLOCK = {
    "responses_api_models": {
        "vllm_model": {
            "entrypoint": "app.py",
            "base_url": "${policy_base_url}",
            "api_key": "${policy_api_key}",
            "model": "${policy_model_name}",
            "return_token_id_information": True,
            "uses_reasoning_parser": False,
        }
    }
}
"""The model server the launcher defines for configs that call one they do not define: Gym's vllm_model
server, asking our policy server for token ids (the launcher fills in ${policy_*})."""


def missing_config_paths(cfg: GymLaunchConfig) -> list[str]:
    """One message per config file of `cfg.config_paths` found neither from the CWD nor in the Gym install."""
    site = gym_site_packages(cfg.gym_venv)
    return [
        f"gym.launch.config_paths: file not found: {p} (looked in {Path.cwd()}"
        + (f" and in the Gym install {site})" if site is not None and not Path(p).is_absolute() else ")")
        for p in cfg.config_paths
        if not resolve_gym_path(p, cfg.gym_venv).is_file()
    ]


def undefined_model_servers(config_paths: list[Path]) -> list[str]:
    """Names of the `responses_api_models` servers the configs refer to (`model_server: {type, name}`)
    that none of them defines at the top level."""
    defined: set[str] = set()
    referenced: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            ref = node.get("model_server")
            if isinstance(ref, dict) and ref.get("type") == "responses_api_models" and isinstance(ref.get("name"), str):
                referenced.append(ref["name"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in config_paths:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue  # Gym's own parser reports it
        if isinstance(data, dict):
            defined.update(str(k) for k in data)
            walk(data)
    return sorted(set(referenced) - defined)


def entrypoint_problems(servers: dict[str, dict]) -> list[str]:
    """One message per server (resolved: `type`, `impl`, `dir`, `entrypoint`) whose `entrypoint` `ng_run` could not
    run: none given, an absolute path (`ng_run` refuses it), or no such file in the server's folder."""
    problems = []
    for name, server in servers.items():
        key = f"{name}.{server['type']}.{server['impl']}.entrypoint"
        entrypoint = server.get("entrypoint")
        if not entrypoint:
            problems.append(f"NeMo Gym server {name!r}: {key} is missing (the script Gym starts, e.g. app.py)")
        elif Path(entrypoint).is_absolute():
            problems.append(f"NeMo Gym server {name!r}: {key}={entrypoint!r} must be relative to the server's "
                            f"folder {server['dir']}, as Gym requires")
        elif not (Path(server["dir"]) / entrypoint).is_file():
            problems.append(f"NeMo Gym server {name!r}: {key}={entrypoint!r}: no such file in the server's folder "
                            f"{server['dir']}")
    return problems


class GymLauncher:
    """Starts Gym (config paths + our policy URL) and stops everything it started."""

    def __init__(self, cfg: GymLaunchConfig, *, policy_base_url: str, policy_model_name: str,
                 policy_api_key: str = "dummy") -> None:
        self.cfg = cfg
        self.policy_base_url = policy_base_url
        self.policy_model_name = policy_model_name
        self.policy_api_key = policy_api_key
        self.python = Path(cfg.gym_venv) / "bin" / "python"
        # relative to the caller's working directory (not Gym's scratch directory), else to the Gym install
        self.config_paths = [resolve_gym_path(p, cfg.gym_venv) for p in cfg.config_paths]
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, Path] = {}
        self.work_dir: Path | None = None
        self._ray_tmp: Path | None = None
        self._servers: dict[str, GymServer] = {}
        self._lock = threading.Lock()  # start() (a worker thread) and stop() (another one) share _procs
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()  # one stop() at a time
        self._watchdog: subprocess.Popen | None = None
        self._unregister = lambda: None

    @property
    def servers(self) -> dict[str, GymServer]:
        """Every server started (name -> URL, what it calls, its process), known once `start` returned."""
        return dict(self._servers)

    @property
    def pids(self) -> dict[str, int]:
        """The pid (= process group id) of each process started directly."""
        with self._lock:
            return {name: proc.pid for name, proc in self._procs.items()}

    @property
    def ray_tmpdir(self) -> Path | None:
        """ng_run mode: the private RAY_TMPDIR of its Ray cluster (removed by `stop`)."""
        return self._ray_tmp

    def __enter__(self) -> dict[str, str]:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> dict[str, str]:
        """Start the servers and return agent name -> base URL once every server is healthy (once per launcher)."""
        if not self.python.exists():
            raise GymLaunchError(
                f"no NeMo Gym venv at {self.cfg.gym_venv} ({self.python} is missing); "
                "build one with scripts/setup_nemo_gym.sh"
            )
        missing = missing_config_paths(self.cfg)
        if missing:
            raise GymLaunchError("; ".join(missing))
        # absolute: the resolver and ng_run run in it and read the paths it holds
        self.work_dir = Path(self.cfg.work_dir or tempfile.mkdtemp(prefix="nemo-gym-")).absolute()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._define_model_servers()
        resolved = self._resolve()
        try:
            self._start_watchdog()
            if self.cfg.mode == "direct":
                return self._start_direct(resolved)
            return self._start_ng_run(resolved)
        except BaseException:
            self.stop()
            raise

    # ---- resolving the config (in the Gym venv) ----------------------------------------------

    def _define_model_servers(self) -> None:
        """Define every model server the configs call but none defines (`policy_model` in Gym's shipped
        resources-server configs) as a vllm_model server with token ids, pointed at our policy server, in
        a config file of our own listed first; a block the user defines is left as it is."""
        missing = undefined_model_servers(self.config_paths)
        if missing:
            path = self.work_dir / "nemo_rl_ext_policy_model.yaml"
            block = {"responses_api_models": {"vllm_model": {
                **POLICY_MODEL_BLOCK["responses_api_models"]["vllm_model"], **self.cfg.policy_model}}}
            path.write_text(yaml.safe_dump({name: block for name in missing}, sort_keys=False))
            self.config_paths = [path, *self.config_paths]
            logger.info("NeMo Gym: model server(s) %s defined as our policy server (%s)", missing, path)

    def _resolve(self) -> dict:
        cmd = [str(self.python), str(RESOLVER), "--policy-base-url", self.policy_base_url,
               "--policy-model-name", self.policy_model_name, "--policy-api-key", self.policy_api_key,
               "--search-root", os.getcwd(), "--search-root", str(SHIPPED_SERVERS),
               *[str(p) for p in self.config_paths]]
        deadline = time.monotonic() + 120
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=self.work_dir) as proc:
            while True:
                try:
                    stdout, stderr = proc.communicate(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    if self._stopping.is_set() or time.monotonic() > deadline:
                        proc.kill()
                        proc.communicate()
                        raise GymLaunchError(
                            "Gym start-up interrupted: the launcher was stopped" if self._stopping.is_set()
                            else "resolving the Gym config took over 120 s"
                        ) from None
        if proc.returncode != 0:
            log = self.work_dir / "resolve_gym_config.log"
            log.write_text(stderr)
            raise GymLaunchError(
                f"resolving the Gym config {[str(p) for p in self.config_paths]} failed: {_last_error(stderr)}; "
                f"its log: {log}", stderr[-_LOG_TAIL_CHARS:],
            )
        return json.loads(stdout.strip().splitlines()[-1])

    # ---- direct mode ------------------------------------------------------------------------------

    def _start_direct(self, resolved: dict) -> dict[str, str]:
        servers = {n: s for n, s in resolved["servers"].items() if s["type"] in DIRECT_TYPES}
        problems = entrypoint_problems(servers)
        if problems:
            raise GymLaunchError("; ".join(problems))
        for name, server in servers.items():
            env = os.environ | {
                "NEMO_GYM_CONFIG_DICT": resolved["yaml"],
                "NEMO_GYM_CONFIG_PATH": name,
                "PYTHONPATH": server["dir"],
            }
            self._spawn(name, [str(self.python), server["entrypoint"]], cwd=server["dir"], env=env)
        urls = {n: f"http://{s['host']}:{s['port']}" for n, s in servers.items()}
        self._wait_healthy(urls)
        self._servers = servers_from_config(
            yaml.safe_load(resolved["yaml"]), urls, {n: p.poll for n, p in self._procs.items()}
        )
        self._servers = {n: s for n, s in self._servers.items() if n in servers}
        logger.info("NeMo Gym servers up (direct): %s; their logs in %s", urls, self.work_dir)
        return {n: u for n, u in urls.items() if servers[n]["type"] == "responses_api_agents"}

    # ---- ng_run mode ------------------------------------------------------------------------------

    def _start_ng_run(self, resolved: dict) -> dict[str, str]:
        venvs = self.work_dir / "venvs"
        for server in resolved["servers"].values():
            link = venvs / server["type"] / server["impl"] / ".venv"
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(Path(self.cfg.gym_venv).resolve())
        (self.work_dir / "env.yaml").write_text(
            f"policy_base_url: {self.policy_base_url}\npolicy_api_key: {self.policy_api_key}\n"
            f"policy_model_name: {self.policy_model_name}\n"
        )
        paths = ",".join(str(p) for p in self.config_paths)
        cmd = [str(Path(self.cfg.gym_venv) / "bin" / "ng_run"), f"+config_paths=[{paths}]",
               "+skip_venv_if_present=true", f"+uv_venv_dir={venvs}",
               f"+head_server.port={self.cfg.head_server_port}",
               f"+server_spinup_timeout_seconds={int(self.cfg.startup_timeout_s)}",
               f"+model_endpoint_readiness_timeout_seconds={int(self.cfg.startup_timeout_s)}"]
        # a private Ray temp dir: never join (or hang on) another Ray cluster of this user
        self._ray_tmp = Path(tempfile.mkdtemp(prefix="ngray-", dir="/tmp"))
        # the server folders ng_run finds (run in work_dir): those the resolver found from the caller's cwd
        roots = os.pathsep.join(
            r for r in (os.environ.get("NEMO_GYM_EXTRA_ROOTS", ""), os.getcwd(), str(SHIPPED_SERVERS)) if r
        )
        self._spawn("ng_run", cmd, cwd=str(self.work_dir),
                    env=os.environ | {"RAY_TMPDIR": str(self._ray_tmp), "NEMO_GYM_EXTRA_ROOTS": roots})
        head = f"http://127.0.0.1:{self.cfg.head_server_port}"
        self._wait_healthy({"head_server": head}, path="/readyz")
        instances = httpx.get(f"{head}/server_instances", timeout=30).json()
        agents = {i["config_path"]: i["url"] for i in instances if i["server_type"] == "responses_api_agents"}
        try:  # a JSON string holding the merged config as YAML
            cfg = yaml.safe_load(httpx.get(f"{head}/global_config_dict_yaml", timeout=30).json())
        except (httpx.HTTPError, ValueError, yaml.YAMLError) as exc:
            logger.warning("no Gym config from %s (%r): only the agents will be health-checked", head, exc)
            cfg = {}
        ng_run = self._procs["ng_run"].poll  # every server dies with ng_run
        urls = {i["config_path"]: i["url"] for i in instances}
        self._servers = servers_from_config(cfg, urls, dict.fromkeys(urls, ng_run))
        logger.info("NeMo Gym up (ng_run, head %s): agents %s; logs in %s", head, agents, self.work_dir)
        return agents

    # ---- processes ----------------------------------------------------------------------------------

    def _start_watchdog(self) -> None:
        """One guard process that stops our process groups if this process dies without `stop()`."""
        self._watchdog = subprocess.Popen(
            [sys.executable, str(WATCHDOG)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, text=True,
        )
        self._unregister = on_force_stop(self.kill)

    def _tell_watchdog(self, line: str) -> None:
        if self._watchdog is not None and self._watchdog.stdin is not None:
            try:
                self._watchdog.stdin.write(line + "\n")
                self._watchdog.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass

    def _spawn(self, name: str, cmd: list[str], cwd: str, env: dict[str, str]) -> None:
        log = self.work_dir / f"{name}.log"
        self._logs[name] = log
        with self._lock:
            if self._stopping.is_set():
                raise GymLaunchError("Gym start-up interrupted: the launcher is stopping")
            with log.open("w") as fh:
                self._procs[name] = proc = subprocess.Popen(
                    cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self._tell_watchdog(str(proc.pid))

    def _wait_healthy(self, urls: dict[str, str], path: str = "/health") -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        pending = dict(urls)
        with httpx.Client(timeout=2.0) as http:
            while pending:
                if self._stopping.is_set():
                    raise GymLaunchError("Gym start-up interrupted: the launcher was stopped")
                for name, url in list(pending.items()):
                    try:
                        if http.get(url + path).status_code == 200:
                            pending.pop(name)
                    except httpx.HTTPError:
                        pass
                if self._stopping.is_set():
                    raise GymLaunchError("Gym start-up interrupted: the launcher was stopped")
                with self._lock:
                    procs = dict(self._procs)
                dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
                if dead:
                    raise GymLaunchError(
                        "; ".join(
                            f"NeMo Gym server {name!r} exited during start-up (exit code {code}): "
                            f"{_last_error(self._log_text(name))}; its log: {self._logs.get(name)}"
                            for name, code in dead.items()
                        ),
                        self._log_tails(dead),
                    )
                if pending and time.monotonic() > deadline:
                    raise GymLaunchError(
                        f"NeMo Gym server(s) {sorted(pending)} not healthy after {self.cfg.startup_timeout_s:.0f} s "
                        f"(gym.launch.startup_timeout_s); their logs: {self.work_dir}/<server>.log",
                        self._log_tails(self._procs),
                    )
                if pending:
                    self._stopping.wait(0.25)

    def _log_text(self, name: str) -> str:
        log = self._logs.get(name)
        return log.read_text(errors="replace") if log and log.exists() else ""

    def _log_tails(self, names) -> str:
        return "\n".join(
            f"--- {name} ({self._logs.get(name)}) ---\n{self._log_text(name)[-_LOG_TAIL_CHARS:]}" for name in names
        )

    def kill(self) -> None:
        """SIGKILL every process group we started, without waiting (a forced stop)."""
        with self._lock:
            self._stopping.set()
            procs = list(self._procs.values())
        for proc in procs:
            _signal_group(proc.pid, signal.SIGKILL)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process group we started, then SIGKILL what is left after `grace_s`."""
        with self._stop_lock:
            with self._lock:  # from here on, start() spawns nothing more and stops waiting
                self._stopping.set()
                procs = list(self._procs.values())
            for proc in procs:
                if proc.poll() is None:
                    _signal_group(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                # the group may outlive its leader (Ray agents ignore SIGTERM): kill what remains
                _signal_group(proc.pid, signal.SIGKILL)
                _kill_session(proc.pid)
                if proc.poll() is None:
                    proc.wait(5)
            with self._lock:
                self._procs.clear()
            self._servers = {}
            if self._watchdog is not None:  # everything is stopped: the guard may go
                self._tell_watchdog("done")
                try:
                    self._watchdog.wait(10)
                except subprocess.TimeoutExpired:
                    self._watchdog.kill()
                self._watchdog = None
            self._unregister()
            if self._ray_tmp is not None:  # the private Ray temp dir of ng_run mode (sockets, session logs)
                shutil.rmtree(self._ray_tmp, ignore_errors=True)
                self._ray_tmp = None


def _last_error(log: str) -> str:
    """The last line of a log that names an exception (`SomeError: ...`), else its last line; "" when empty."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line.strip() for line in log.splitlines() if _ERROR_LINE.match(line)]  # unindented, as tracebacks end
    return (errors or lines or ["(empty log)"])[-1][:_ERROR_LINE_CHARS]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_session(sid: int) -> None:
    """SIGKILL every process whose session is `sid` (Ray workers leave their process group)."""
    try:
        out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    for line in out.splitlines():
        pid, _, session = line.strip().partition(" ")
        if session.strip() == str(sid) and pid.isdigit():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
