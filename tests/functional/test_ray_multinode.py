"""A pool on a simulated two-node Ray cluster (both nodes on 127.0.0.1), run in a subprocess with a hard
timeout: replicas are spread over the nodes, a node lost mid-run loses no request, the pool recovers on the
remaining node, and no Ray process outlives the run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(360)


def ray_processes(temp_dir: str) -> list[psutil.Process]:
    """The processes of the cluster rooted at `temp_dir` (GCS, raylets, workers name it in their command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def test_a_pool_spread_over_two_nodes_survives_losing_one(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="rayh14_", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(HERE / "ray_two_nodes.py"), temp_dir], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        result = json.loads(line.removeprefix("RESULT "))
        assert result["addresses"] == ["127.0.0.1"]  # every node stayed on loopback
        assert result["alive_nodes_at_start"] == 3  # the head (no CPUs) and two workers
        assert result["placed_on_distinct_workers"]
        assert all(n > 0 for n in result["in_flight_at_loss"])
        assert result["answers"] == 40  # nothing lost
        assert result["retries"] >= 1 and result["restarts"] == 1
        # plus one if the replacement landed on the lost node before Ray declared it dead (ray_two_nodes.py)
        assert result["restarts_in_all"] == 1 + result["replaced_on_lost_node"]
        assert result["restarted_on_survivor"]
        assert result["replicas_live"] == 2
        assert min(result["served_after_recovery"]) >= 1 and result["tags_after_recovery"] == 2
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        deadline = time.monotonic() + 20
        while ray_processes(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = ray_processes(temp_dir)
        for p in left:  # only this run's processes (they name its temp dir)
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, [p.pid for p in left]
