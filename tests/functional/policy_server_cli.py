"""The policy server's command line as a test runs it: started in its own process, its URL read from the
"listening on" line it logs, and stopped with SIGTERM at the end (an orderly exit: 0 or 128 + SIGTERM)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


def start_policy_server(
    cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str], start_s: float
) -> tuple[subprocess.Popen, str, list[str]]:
    """Start `cmd` (a policy server command line): its process, its `http://host:port/v1` URL once it listens
    (within `start_s`, else it is killed and the assertion shows its log) and its stderr lines so far and to come."""
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=dict(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    log: list[str] = []
    listening = threading.Event()

    def drain() -> None:
        for line in proc.stderr:
            log.append(line)
            if "listening on http://" in line:
                listening.set()

    threading.Thread(target=drain, daemon=True).start()
    if not listening.wait(start_s):
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError("the policy server did not start:\n" + "".join(log[-40:]))
    return proc, re.search(r"listening on (http://\S+/v1)", "".join(log)).group(1), log


@contextlib.contextmanager
def policy_server_cli(
    cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str], start_s: float, stop_s: float
) -> Iterator[str]:
    """Run `cmd` (a policy server command line) and yield its `http://host:port/v1` URL once it listens; the
    server must start within `start_s` and, after the block, exit cleanly within `stop_s` of SIGTERM."""
    proc, url, log = start_policy_server(cmd, cwd=cwd, env=env, start_s=start_s)
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            raise
    assert code in (0, 128 + signal.SIGTERM), "".join(log[-40:])
