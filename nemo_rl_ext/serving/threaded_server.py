"""Running an ASGI app with uvicorn in a background thread, on 127.0.0.1 by default, until told to stop."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import uvicorn

logger = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) for uvicorn to serve; port 0 picks a free port.

    Connections made before uvicorn starts accepting wait in the backlog instead of being refused.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def url_host(host: str) -> str:
    """The host to put in a URL for a server bound to `host`."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class ThreadedServer:
    """`with ThreadedServer(app) as srv: httpx.get(srv.url + "/health")` — serves until the block ends."""

    def __init__(
        self,
        app,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "server",
        health_path: str = "/health",
        startup_timeout_s: float = 30.0,
        graceful_shutdown_s: float = 5.0,
        log_level: str = "warning",
    ) -> None:
        self.app = app
        self.graceful_shutdown_s = graceful_shutdown_s
        self.host = host
        self.name = name
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self._requested_port = port
        self._log_level = log_level
        self._socket: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        """The port it listens on (known once started)."""

    @property
    def url(self) -> str:
        """Root URL of the server."""
        if self.port is None:
            raise RuntimeError(f"the {self.name} is not started")
        return f"http://{url_host(self.host)}:{self.port}"

    def start(self) -> ThreadedServer:
        """Bind, serve in a daemon thread, return once the health path answers 200 (or raise at the deadline)."""
        if self._thread is not None:
            raise RuntimeError(f"the {self.name} is already started")
        self._socket = bind_socket(self.host, self._requested_port)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=self._log_level, lifespan="off",
                                timeout_graceful_shutdown=self.graceful_shutdown_s)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name=self.name, daemon=True
        )
        self._thread.start()
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        logger.info("%s listening on %s", self.name, self.url)
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"the {self.name} thread exited during startup; {last_error}")
            try:
                if httpx.get(self.url + self.health_path, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError as exc:
                last_error = exc
            time.sleep(0.02)
        raise TimeoutError(
            f"the {self.name} on {self.url} did not answer {self.health_path} within {self.startup_timeout_s} s "
            f"(last error: {last_error})"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit, wait for the thread (forcing exit after `timeout_s`), free the port."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("%s did not stop within %.1f s; forcing exit", self.name, timeout_s)
                self._server.force_exit = True
                self._thread.join(timeout_s)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = None

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
