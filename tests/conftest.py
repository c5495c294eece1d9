"""Shared pytest fixtures. Heavy imports stay inside fixtures so collection stays fast."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

# The test files that take longest (seconds in CI's `--durations`, all their tests together), slowest first. `make
# test` runs `-n 2 --dist loadfile --no-loadscope-reorder`: each worker takes whole files in collection order, so
# these run first and the many short unit files come last, where they fill whichever worker frees up first. In
# pytest-xdist's own order (most tests first) the long functional files of 1-5 tests ran last, and the suite's end
# waited for one of them on one worker while the other sat idle. The first two need no NeMo Gym venv, which
# `make test` may still be building in the background while they run.
SLOW_FILES_FIRST = (
    "test_eval_ray_shards.py",
    "test_trainer_workers.py",
    "test_learning_distill_bench.py",
    "test_two_hosts.py",
    "test_stop_signals.py",
    "test_eval_shard_jobs.py",
    "test_eval.py",
    "test_export.py",
    "test_eval_ray_gym.py",
    "test_ray_multinode.py",
    "test_faults.py",
    "test_grpo.py",
    "test_gym_faults.py",
    "test_grading_faults.py",
    "test_cluster_wiring.py",
    "test_cluster_environments.py",
    "test_learning_bench.py",
    "test_gpu_check.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """Give SIGINT Python's default handler (KeyboardInterrupt) when this process inherited it ignored.

    A suite started as a background job (`make test &`, `( ... & )` in a script) inherits SIGINT ignored (POSIX), and
    Python keeps an inherited SIG_IGN; so does each xdist worker. The runs under test then rightly keep Ctrl-C
    ignored too (`lifecycle.graceful_stop`), and the tests that press Ctrl-C (`os.kill(os.getpid(), SIGINT)`) would
    test a run nobody can interrupt: `test_a_stopped_run_never_replays_the_group_in_flight` trained all its steps
    and failed "DID NOT RAISE KeyboardInterrupt". With the default handler they test what a run in a terminal does.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files of `SLOW_FILES_FIRST` first (in its order), then the other functional tests, then the unit tests;
    a stable sort, so each file's tests keep their order."""
    rank = {name: k for k, name in enumerate(SLOW_FILES_FIRST)}

    def key(item: pytest.Item) -> tuple[int, int]:
        path = Path(item.fspath)
        if path.name in rank:
            return 0, rank[path.name]
        return (1 if "functional" in path.parts else 2), 0

    items.sort(key=key)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init Qwen2 model + ChatML tokenizer folder (seed 0), built once per session."""
    from nemo_rl_ext.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) loaded fp32 on CPU from `tiny_model_dir`; shared, so never train or mutate it."""
    from nemo_rl_ext.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_dir)


@pytest.fixture
def agents():
    """Fake NeMo Gym agent servers (`agent_alpha`, `agent_beta`) on 127.0.0.1: `nemo_rl_ext.testing.FakeAgents`."""
    from nemo_rl_ext.testing import FakeAgents

    with FakeAgents() as fake:
        yield fake


@pytest.fixture
def stand_in_vllm():
    """(StandInEngine, VllmGeneration wired to it): the vLLM backend's code paths without vLLM
    (`nemo_rl_ext.testing.vllm_engine`)."""
    from nemo_rl_ext.testing.vllm_engine import StandInEngine, vllm_on_stand_in

    engine = StandInEngine()
    with vllm_on_stand_in(engine) as gen:
        yield engine, gen


@pytest.fixture
def no_report_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The eval report's PNG plots (matplotlib, ~0.2-0.5 s each, seconds on a busy machine) are not drawn: for
    tests whose subject is the lines, summaries and merges, not the plots. The PNGs themselves are checked where
    they are the subject (tests/unit/evals/test_eval_profile.py, test_eval_shards.py's first merge test)."""
    from nemo_rl_ext.evals import report

    monkeypatch.setattr(report, "plot_pass_at_k", lambda summary, path: None)
    monkeypatch.setattr(report, "plot_reward_profile", lambda summary, path: None)
