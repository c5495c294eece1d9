"""Fixtures of the functional tests: the NeMo Gym venv (built once by scripts/setup_nemo_gym.sh), one local Ray
for the session, and the hf backend over the tiny model."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def gym_venv() -> Path:
    """The NeMo Gym 0.7.0 venv; the first build takes ~2.5 min, later calls return at once."""
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup_nemo_gym.sh")], capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, f"setup_nemo_gym.sh failed:\n{out.stderr[-3000:]}"
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray for the whole test session: 2 CPUs, no dashboard, usage stats off; shut down at the end."""
    import os

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray

    from nemo_rl_ext.cluster import ClusterConfig, init_ray

    started = init_ray(ClusterConfig(local_num_cpus=2))
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def one_torch_thread():
    """One torch thread on this process's main thread while a test runs (restored after): whatever the tests
    before it in the same pytest-xdist worker left, runs compared to the bit train with the same thread count,
    and with two threads on a loaded 2-core machine the trainer's float32 reductions are not always repeatable
    (step 1's train/loss one ulp apart in 1 of 8 runs; a subprocess's train/grad_norm one ulp apart in CI)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def generation(tiny_model_and_tokenizer):
    """The hf backend over the session's tiny model (max_model_len 512), one per test module."""
    from nemo_rl_ext.models.generation.hf_backend import HfGeneration

    model, tokenizer = tiny_model_and_tokenizer
    gen = HfGeneration(model, tokenizer, max_model_len=512)
    yield gen
    gen.shutdown()
