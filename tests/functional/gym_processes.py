"""Finding the NeMo Gym servers a process started (by their environment), and checking they are gone."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class GymProcess:
    """One Gym server process found under a parent."""

    name: str
    """Its instance name (NEMO_GYM_CONFIG_PATH in its environment)."""
    pid: int
    """Its pid."""
    ports: tuple[int, ...]
    """The TCP ports it listens on."""


def gym_servers_under(pid: int) -> dict[str, GymProcess]:
    """The Gym servers among the descendants of `pid`, by instance name."""
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            name = child.environ().get("NEMO_GYM_CONFIG_PATH")
            if name:
                ports = tuple(sorted({c.laddr.port for c in child.net_connections("tcp")
                                      if c.status == psutil.CONN_LISTEN}))
                found[name] = GymProcess(name, child.pid, ports)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def descendants(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def gone(pid: int) -> bool:
    """The process has exited (a zombie that nobody reaped counts as exited)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def wait_until_gone(pids, ports, within_s: float) -> float:
    """Seconds until every pid has exited and every port is closed (or `within_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if all(gone(p) for p in pids) and all(port_closed(p) for p in ports):
            break
        time.sleep(0.1)
    return time.monotonic() - start
