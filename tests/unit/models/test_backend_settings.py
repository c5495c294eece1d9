"""Each backend owns its section `policy.<name>`: the registry carries the settings model, the policy section
validates every registered backend's section against it, and config validation never imports a backend."""

from __future__ import annotations

import pytest
from pydantic import Field

from nemo_rl_ext.config import ConfigError, StrictModel, load_config
from nemo_rl_ext.evals.config import EvalConfig
from nemo_rl_ext.models import backends
from nemo_rl_ext.models.backend_settings import HfConfig, VllmConfig
from nemo_rl_ext.models.config import PolicyConfig

EVAL = ["eval.dataset_path=d.jsonl", "eval.save_path=out"]


def test_the_builtin_backends_register_their_sections_with_the_old_spellings_and_defaults() -> None:
    assert backends.backend_entry("hf").settings is HfConfig and backends.backend_entry("vllm").settings is VllmConfig
    cfg = PolicyConfig()
    assert cfg.hf == HfConfig() and cfg.vllm == VllmConfig() and cfg.backend_settings() is cfg.hf
    dumped = cfg.model_dump()
    assert dumped["hf"] == {"scheduler": "continuous", "max_prefill_tokens": 16384, "num_threads": 1}
    assert dumped["vllm"] == {"gpu_memory_utilization": 0.9, "tensor_parallel_size": 1, "enforce_eager": False,
                              "enable_prefix_caching": True}
    assert PolicyConfig.model_validate(dumped) == cfg
    set_ = load_config(None, [*EVAL, "policy.hf.scheduler=static", "policy.vllm.tensor_parallel_size=2"], EvalConfig)
    assert set_.policy.hf.scheduler == "static" and set_.policy.vllm.tensor_parallel_size == 2


def test_a_bad_or_unknown_backend_key_is_named_by_its_path_with_every_other_problem() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [*EVAL, "policy.hf.max_prefill_tokens=0", "policy.vllm.typo=1", "policy.hff.x=1",
                           "policy.dtype=int8"], EvalConfig)
    text = str(err.value)
    assert text.startswith("config: 4 problem(s)"), text
    for needle in ("policy.hf.max_prefill_tokens: Input should be greater than or equal to 1 (got 0)",
                   "policy.vllm.typo: Extra inputs are not permitted (got 1)",
                   "policy.hff: Extra inputs are not permitted (got {'x': 1})",
                   "policy.dtype: Input should be"):
        assert needle in text, (needle, text)


class ProbeSettings(StrictModel):
    """A registered backend's own settings."""

    width: int = Field(default=3, ge=1, description="A width.")


def test_a_registered_backend_owns_its_section() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'probe'"):
        PolicyConfig(backend="probe")
    with pytest.raises(ConfigError, match=r"probe: Extra inputs are not permitted"):
        load_config(None, ["probe.width=2"], PolicyConfig)  # before registration: an unknown key

    @backends.register_backend("probe", loads_model_folder=False, settings=ProbeSettings)
    def build_probe(cfg, model, tokenizer, engine_kwargs):
        raise AssertionError("not built here")

    try:
        cfg = load_config(None, ["backend=probe", "probe.width=5"], PolicyConfig)
        assert cfg.probe == ProbeSettings(width=5) and cfg.backend_settings() == cfg.probe
        assert PolicyConfig().probe.width == 3  # every registered section is there, defaults where absent
        with pytest.raises(ConfigError) as err:
            load_config(None, ["probe.width=0", "probe.height=1"], PolicyConfig)
        assert "probe.width: Input should be greater than or equal to 1 (got 0)" in str(err.value)
        assert "probe.height: Extra inputs are not permitted (got 1)" in str(err.value)
    finally:
        del backends._BACKENDS["probe"]
    with pytest.raises(ValueError, match=r"can't own policy.generation: that key is a policy setting"):
        backends.register_backend("generation", loads_model_folder=False, settings=ProbeSettings)


def test_config_validation_imports_no_backend() -> None:
    """The registry sits below models.config: no import chain leads from the config back to backends/policy
    (the cycle models.config -> backends -> policy -> config is gone, function-local imports included)."""
    import grimp

    graph = grimp.build_graph("nemo_rl_ext")
    for below in ("nemo_rl_ext.models.config", "nemo_rl_ext.models.backend_registry"):
        for above in ("nemo_rl_ext.models.backends", "nemo_rl_ext.models.policy"):
            assert not graph.chain_exists(importer=below, imported=above), (below, above)
    mine = [m for m in graph.modules if m.startswith("nemo_rl_ext.models") and ".generation" not in m]
    cycles = [(m, d) for m in mine for d in graph.find_modules_directly_imported_by(m)
              if graph.chain_exists(importer=d, imported=m)]
    assert cycles == []  # models/generation/ (the engines) is left to the package-wide cycle check


def test_the_builtin_factories_named_lazily_exist() -> None:
    """The registry names the built-ins' factories as "module:function" (imported on first use): each exists."""
    import importlib

    from nemo_rl_ext.models.backend_registry import LazyCallable

    lazy = [f for name in ("hf", "vllm") for f in (backends.backend_entry(name).factory,
                                                   backends.backend_entry(name).replica_engine_kwargs)
            if isinstance(f, LazyCallable)]
    assert len(lazy) == 3  # hf's and vllm's factories, vllm's replica engine arguments
    for ref in lazy:
        module, _, name = ref.target.partition(":")
        assert callable(getattr(importlib.import_module(module), name)), ref.target
