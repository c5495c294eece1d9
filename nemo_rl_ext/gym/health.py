"""Noticing a dead Gym server while rows wait on it.

Gym's servers retry a refused connection to another Gym server forever (every 0.5 s), so when a
resources or model server dies, the agent's `/run` simply never answers. While rows are pending, the
`HealthMonitor` therefore probes every server they depend on (`GET /health`, short deadline, every
`interval_s`) and marks one down after `failures` consecutive failed probes, or at once when the
process we started for it has exited. The client fails the rows that depend on a down server with
an error naming it, and does not retry them against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

SERVER_TYPES = ("resources_servers", "responses_api_agents", "responses_api_models", "environment_servers")
KIND_NAMES = {
    "resources_servers": "resources server",
    "responses_api_agents": "agent server",
    "responses_api_models": "model server",
    "environment_servers": "environment server",
}


@dataclass(frozen=True)
class GymServer:
    """One Gym server instance that rows may depend on."""

    name: str
    """Its instance name in the Gym config (e.g. `agent_alpha`, `arithmetic_equivalence`)."""
    kind: str
    """Its server type (`responses_api_agents`, `resources_servers`, `responses_api_models`, ...)."""
    url: str
    """Its base URL."""
    depends_on: tuple[str, ...] = ()
    """Instance names of the Gym servers it calls (an agent: its resources and model servers)."""
    returncode: Callable[[], int | None] | None = field(default=None, compare=False)
    """Exit status of the process we started for it (None while it runs); None when we did not start it."""

    def describe(self) -> str:
        return f"Gym {KIND_NAMES.get(self.kind, self.kind)} {self.name!r} at {self.url}"


def _references(node: Any) -> Iterable[str]:
    """Instance names that a server config block points at (`{type: <server type>, name: <instance>}`)."""
    if isinstance(node, Mapping):
        if node.get("type") in SERVER_TYPES and isinstance(node.get("name"), str):
            yield node["name"]
        for value in node.values():
            yield from _references(value)
    elif isinstance(node, list | tuple):
        for value in node:
            yield from _references(value)


def servers_from_config(
    cfg: Mapping[str, Any],
    urls: Mapping[str, str] | None = None,
    returncodes: Mapping[str, Callable[[], int | None]] | None = None,
) -> dict[str, GymServer]:
    """Every server instance of a resolved Gym config (`{name: {type: {impl: {host, port, ...}}}}`).

    `urls` overrides a server's URL (else http://host:port from its block); `returncodes` gives the
    exit status of the processes we started, by instance name.
    """
    servers: dict[str, GymServer] = {}
    for name, block in cfg.items():
        if not isinstance(block, Mapping) or len(block) != 1:
            continue
        ((kind, inner),) = block.items()
        if kind not in SERVER_TYPES or not isinstance(inner, Mapping) or len(inner) != 1:
            continue
        ((_, server_cfg),) = inner.items()
        if not isinstance(server_cfg, Mapping):
            continue
        url = (urls or {}).get(name) or (
            f"http://{server_cfg.get('host')}:{server_cfg.get('port')}" if server_cfg.get("port") else None
        )
        if url is None:
            continue
        depends_on = tuple(dict.fromkeys(r for r in _references(server_cfg) if r != name))
        servers[str(name)] = GymServer(str(name), kind, url.rstrip("/"), depends_on,
                                       (returncodes or {}).get(name))
    return servers


@dataclass
class _Status:
    """What the probes found about one server (mutable, owned by the monitor)."""

    failures: int = 0
    """Consecutive failed probes."""
    last_error: str = ""
    """The last probe's failure."""
    down: str | None = None
    """Why it is down, or None while it is up."""


class HealthMonitor:
    """Probes the known Gym servers while rows are pending; says which of a row's servers is down."""

    def __init__(
        self,
        servers: Mapping[str, GymServer],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 5.0,
        failures: int = 3,
    ) -> None:
        self.servers = dict(servers)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        self._status = {name: _Status() for name in self.servers}
        self._pending = 0
        self._task: asyncio.Task | None = None
        self._changed: asyncio.Event | None = None
        self._http: httpx.AsyncClient | None = None

    def add(self, server: GymServer) -> None:
        """Know one more server (e.g. an agent given only by URL)."""
        if server.name not in self.servers:
            self.servers[server.name] = server
            self._status[server.name] = _Status()

    def closure(self, name: str) -> tuple[str, ...]:
        """`name` and every known server it depends on, directly or not."""
        seen: dict[str, None] = {}
        stack = [name]
        while stack:
            current = stack.pop()
            if current in seen or current not in self.servers:
                continue
            seen[current] = None
            stack.extend(self.servers[current].depends_on)
        return tuple(seen)

    def down_reason(self, names: Iterable[str]) -> str | None:
        """'<server> is down (<why>)' for the first of `names` that is down, else None."""
        for name in names:
            self._check_process(name)
            status = self._status.get(name)
            if status is not None and status.down is not None:
                return f"{self.servers[name].describe()} is down ({status.down})"
        return None

    async def wait_down(self, names: tuple[str, ...]) -> str:
        """Wait until one of `names` is down; returns `down_reason`."""
        while True:
            reason = self.down_reason(names)
            if reason is not None:
                return reason
            await self._event().wait()

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Probe while the block runs (the probes stop when no block is open)."""
        self._pending += 1
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())
        try:
            yield
        finally:
            self._pending -= 1
            if self._pending == 0 and self._task is not None:
                self._task.cancel()
                self._task = None

    async def probe_now(self, names: Iterable[str]) -> None:
        """Probe `names` once (a server that answers is up again)."""
        await asyncio.gather(*(self._probe(n) for n in names if n in self.servers))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # ---- internals ------------------------------------------------------------------------------

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _set(self, name: str, down: str | None) -> None:
        status = self._status[name]
        if status.down != down:
            status.down = down
            event, self._changed = self._event(), asyncio.Event()
            event.set()  # wake every waiter; they re-read the status

    def _check_process(self, name: str) -> bool:
        """Mark `name` down if its process exited; True when it did."""
        server = self.servers.get(name)
        code = server.returncode() if server is not None and server.returncode is not None else None
        if code is None:
            return False
        if self._status[name].down is None or "exited" not in self._status[name].down:
            self._set(name, f"its process exited with code {code}")
        return True

    async def _loop(self) -> None:
        while True:
            await self.probe_now(self.servers)
            await asyncio.sleep(self.interval_s)

    async def _probe(self, name: str) -> None:
        if self._check_process(name):
            return
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.timeout_s, limits=httpx.Limits(max_connections=16))
        status, server = self._status[name], self.servers[name]
        start = time.monotonic()
        try:
            await self._http.get(f"{server.url}/health")  # any HTTP answer: the server is alive
        except httpx.HTTPError as exc:
            status.failures += 1
            detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            status.last_error = f"{detail} after {time.monotonic() - start:.1f} s"
            if status.failures >= self.failures:
                self._set(name, f"{status.failures} health checks of {server.url}/health failed in a row, "
                                f"last: {status.last_error}")
        else:
            status.failures, status.last_error = 0, ""
            self._set(name, None)
