"""A peft LoRA adapter folder as `policy.model_name` (`models.adapters`): its base model (adapter_config.json's
base_model_name_or_path) with the adapters merged in, written once to the cache with the folder's tokenizer; a
folder without adapter weights or whose base model is not here is one message saying to export instead. The
eval on a LoRA run's `<step>/policy` and `--adapter-only` export: tests/functional/test_export.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.models.adapters import MERGED_DIR, peft_reads_a_deprecated_alias
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.loading import load_tokenizer
from nemo_rl_ext.models.policy import resolve_model_path
from nemo_rl_ext.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model, and a peft adapter folder over it (random, non-zero B: the merge changes the weights) with
    the tokenizer beside it, as a one-process LoRA checkpoint's `policy/` is."""
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_model(root / "tiny", seed=0)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with peft_reads_a_deprecated_alias():
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    model.save_pretrained(root / "policy")
    load_tokenizer(base).save_pretrained(root / "policy")
    return {"base": base, "adapters": root / "policy"}


def test_an_adapter_folder_loads_as_its_base_model_with_the_adapters_merged(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_RL_EXT_CACHE", str(tmp_path / "cache"))
    cfg = PolicyConfig(model_name=str(folders["adapters"]))
    assert cfg.model_folder_problem() is None  # before: "... nor a model folder with config.json"
    merged = resolve_model_path(cfg)
    assert merged.parent == tmp_path / "cache" / MERGED_DIR and (merged / "config.json").is_file()
    with peft_reads_a_deprecated_alias():
        expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folders["base"], dtype=torch.float32),
                                             folders["adapters"]).merge_and_unload().state_dict()
    got = load_file(merged / "model.safetensors")
    base = load_file(folders["base"] / "model.safetensors")
    assert set(got) == set(base)
    for name, value in got.items():  # peft's merge of the same tensors in the same dtype: the same bits
        assert torch.equal(value, expected[name]), name
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert (merged / "tokenizer_config.json").read_bytes() == (folders["adapters"] / "tokenizer_config.json").read_bytes()
    assert not (merged / "adapter_config.json").exists()
    written = (merged / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path(cfg) == merged and (merged / "model.safetensors").stat().st_mtime_ns == written  # cached


def test_an_adapter_folder_without_weights_or_base_is_one_message_saying_to_export(folders, tmp_path):
    no_weights = tmp_path / "sharded_policy"  # the policy/ of a LoRA run on FSDP2 ranks: config, no adapter weights
    shutil.copytree(folders["adapters"], no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    problem = PolicyConfig(model_name=str(no_weights)).model_folder_problem()
    assert problem == (f"policy.model_name={str(no_weights)!r} holds adapter_config.json but no adapter weights "
                       "(adapter_model.safetensors or adapter_model.bin; a LoRA checkpoint of FSDP2 ranks keeps them in "
                       "shards/): export the run's merged model (python examples/run_grpo.py export RUN_DIR [--step N]) "
                       "and load that")

    moved = tmp_path / "moved"
    shutil.copytree(folders["adapters"], moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    cfg = PolicyConfig(model_name=str(moved))
    with pytest.raises(ConfigError) as err:
        resolve_model_path(cfg)
    assert str(err.value) == cfg.model_folder_problem() == (
        f"policy.model_name={str(moved)!r} is a LoRA adapter folder whose base model {str(tmp_path / 'gone')!r} "
        "(adapter_config.json's base_model_name_or_path) is not a model folder here: restore it there, or export the "
        "run's merged model (python examples/run_grpo.py export RUN_DIR [--step N]) and load that")


def test_a_base_named_by_a_builtin_name_is_that_model(folders, tmp_path, monkeypatch):
    monkeypatch.setenv("NEMO_RL_EXT_CACHE", str(tmp_path / "cache"))
    named = tmp_path / "named"
    shutil.copytree(folders["adapters"], named)
    config = json.loads((named / "adapter_config.json").read_text())
    (named / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "tiny"}))
    cfg = PolicyConfig(model_name=str(named))
    assert cfg.model_folder_problem() is None
    merged = load_file(resolve_model_path(cfg) / "model.safetensors")
    tiny = load_file(resolve_model_path(PolicyConfig(model_name="tiny")) / "model.safetensors")
    assert set(merged) == set(tiny)
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], tiny["model.layers.0.mlp.up_proj.weight"])  # no adapter
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], tiny["model.layers.0.self_attn.q_proj.weight"])
