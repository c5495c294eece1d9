"""Two real hosts on one machine: Linux network namespaces joined by a veth pair with their own private addresses,
a Ray head in one and a Ray worker node in the other (`ray start`, as on two machines), and drivers run inside a
namespace (`ip netns exec`). Everything here is made by the caller (root) and removed by `TwoHosts.close`.

Only the addresses of the namespaces made here are used: a private /24 picked from this process's id, the head
on .1 and the worker on .2. Ray is stopped by process id (the processes inside the namespaces made here, each
node with its own `--temp-dir`), never with `ray stop`, which would stop every Ray on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RAY_PORT = 6379
NODE_START_TIMEOUT_S = 90.0


def why_not_possible() -> str | None:
    """Why this machine cannot make network namespaces here (None: it can)."""
    if os.geteuid() != 0:
        return "making network namespaces needs root (ip netns add); this test runs as a normal user"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed: no network namespaces"
    probe = f"nrxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def namespace_processes(ns: str) -> list[psutil.Process]:
    """Every process inside network namespace `ns` (`ip netns pids`): what a host made here runs, and nothing else
    (a Ray worker renames itself, so its command line no longer names its node's temp dir)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    found = []
    for pid in out.stdout.split():
        try:
            found.append(psutil.Process(int(pid)))
        except psutil.NoSuchProcess:
            continue
    return found


def kill_processes(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


@dataclass
class Host:
    """One namespace: its name, its address and the Ray node started in it."""

    ns: str
    """The network namespace's name."""
    ip: str
    """Its address on the veth link (the Ray node's address)."""
    temp_dirs: list[str] = field(default_factory=list)
    """The `--temp-dir` of every Ray node started here (the current one last)."""


class TwoHosts:
    """Namespaces `head` and `worker` on a private /24, a Ray head on the first, a worker node on the second."""

    def __init__(self) -> None:
        pid = os.getpid()
        net = f"10.{200 + pid % 50}.{pid // 50 % 250}"
        self.head = Host(f"nrx{pid}h", f"{net}.1")
        self.worker = Host(f"nrx{pid}w", f"{net}.2")
        self.address = f"{self.head.ip}:{RAY_PORT}"
        self._made: list[str] = []
        self._veths: tuple[str, ...] = ()
        self._env = self._node_env()

    @staticmethod
    def _node_env() -> dict[str, str]:
        """What the Ray nodes and drivers run with: token auth off (the nodes are on a private link the test made),
        no usage stats, one torch thread, the repository importable; no local-Ray-only settings of this process."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS") and not k.startswith("PYTEST")}
        path = os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")])
        return {**env, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": path,
                "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)

    def make(self) -> TwoHosts:
        """The namespaces, the veth pair between them, then the Ray head and the worker node."""
        head, worker = self.head, self.worker
        veth_h, veth_w = self._veths = f"{head.ns}v", f"{worker.ns}v"
        for host in (head, worker):
            self._ip("netns", "add", host.ns)
            self._made.append(host.ns)
        self._ip("link", "add", veth_h, "type", "veth", "peer", "name", veth_w)
        self._ip("link", "set", veth_h, "netns", head.ns)
        self._ip("link", "set", veth_w, "netns", worker.ns)
        for host, veth in ((head, veth_h), (worker, veth_w)):
            self._ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", veth)
            self._ip("-n", host.ns, "link", "set", veth, "up")
            self._ip("-n", host.ns, "link", "set", "lo", "up")
        self.start_node(head)
        self.start_node(worker)
        return self

    def start_node(self, host: Host) -> None:
        """`ray start` in `host`'s namespace (the head, or a worker joining the head), one CPU, its own temp dir."""
        temp_dir = tempfile.mkdtemp(prefix=f"{host.ns}_", dir="/tmp")  # short: Ray's socket paths live under it
        host.temp_dirs.append(temp_dir)
        common = ["--node-ip-address", host.ip, "--num-cpus", "1", "--temp-dir", temp_dir,
                  "--object-store-memory", str(100 * 2**20), "--disable-usage-stats"]
        if host is self.head:
            args = ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false", *common]
        else:
            args = ["--address", self.address, *common]
        out = self.run_in(host, [str(Path(sys.executable).parent / "ray"), "start", *args], timeout=NODE_START_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"ray start in {host.ns} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        self.wait_for_nodes(2 if host is self.worker else 1)

    def wait_for_nodes(self, alive: int) -> None:
        """Wait until the head's GCS counts `alive` live nodes."""
        script = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                  "print(sum(n['Alive'] for n in ray.nodes()))")
        deadline = time.monotonic() + NODE_START_TIMEOUT_S
        while True:
            out = self.run_in(self.head, [sys.executable, "-c", script, self.address], timeout=60)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1] == str(alive):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster never had {alive} live nodes: {out.stdout[-2000:]}{out.stderr[-2000:]}")
            time.sleep(1.0)

    def command(self, host: Host, argv: list[str]) -> list[str]:
        """`argv` run in `host`'s namespace with the nodes' environment."""
        # env -i: exactly these variables, not this process's too (init_ray sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in
        # os.environ for the local Ray of the other tests in this pytest process; a worker node would refuse to join)
        return ["ip", "netns", "exec", host.ns, "env", "-i", *[f"{k}={v}" for k, v in self._env.items()], *argv]

    def run_in(self, host: Host, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout)

    def popen_in(self, host: Host, argv: list[str], log: Path) -> subprocess.Popen:
        """Start `argv` in `host`'s namespace, its output into `log` (a file: a pipe nobody reads could fill)."""
        with log.open("w") as out:
            return subprocess.Popen(self.command(host, argv), stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def raylet(self, host: Host) -> psutil.Process:
        """The raylet of `host`'s current Ray node."""
        (raylet,) = [p for p in namespace_processes(host.ns) if p.name() == "raylet"]
        return raylet

    def lose_worker(self) -> None:
        """The worker host is lost: its raylet, then every other process on it, killed (SIGKILL)."""
        procs = namespace_processes(self.worker.ns)
        self.raylet(self.worker).send_signal(signal.SIGKILL)
        kill_processes(procs)

    def close(self) -> list[int]:
        """Kill every process on the hosts (the Ray nodes, their workers, drivers), delete the namespaces (and with
        them the veth pair, or the pair itself if it never got there) and the nodes' temp dirs; returns the pids
        still alive after that (none, normally)."""
        left: list[int] = []
        for ns in self._made:
            kill_processes(namespace_processes(ns))
            left += [p.pid for p in namespace_processes(ns)]
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
        for veth in self._veths:  # still here only if `make` failed before moving it into its namespace
            subprocess.run(["ip", "link", "delete", veth], capture_output=True, timeout=30)
        for host in (self.head, self.worker):
            for temp_dir in host.temp_dirs:
                shutil.rmtree(temp_dir, ignore_errors=True)
        return left
