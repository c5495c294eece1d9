"""Sharded checkpoints (`torch.distributed.checkpoint`) in one process, without a process group: what they hold (the
trained parameters and their optimizer state only, for a full fine-tune and for LoRA), a bit-exact round trip that
continues as the uninterrupted optimizer does, a consolidated read, a refused misfit, and the completeness rules
(a shards folder without its marker, or with a damaged shard, is never resumed). Two FSDP2 ranks writing and
reading them: tests/functional/test_trainer_workers.py."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch

from nemo_rl_ext.training.checkpoint import (
    MARKER_FILE,
    checkpoint_dir,
    load_checkpoint,
    resumable_checkpoint,
    save_checkpoint,
)
from nemo_rl_ext.training.export_weights import trained_weights
from nemo_rl_ext.training.sharded_checkpoint import (
    SHARDS,
    ShardedCheckpointError,
    check_shards_visible,
    load_trained_state,
    read_trained_weights,
    save_trained_state,
    saved_parameter_names,
)


def _step(model, optimizer) -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    from nemo_rl_ext.training.lora import peft_reads_a_deprecated_alias

    with peft_reads_a_deprecated_alias():
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _save(root: Path, step: int, model, optimizer, tokenizer) -> Path:
    return save_checkpoint(root, step, tokenizer=tokenizer, data_state={"consumed": step},
                           write_state=lambda folder: save_trained_state(folder, model, optimizer))


def test_full_round_trip_is_bit_exact_and_continues_as_the_uninterrupted_run(tiny_model_and_tokenizer, tmp_path):
    base, tokenizer = tiny_model_and_tokenizer
    model = copy.deepcopy(base)
    optimizer = _adamw(model)
    _step(model, optimizer)
    ckpt = load_checkpoint(_save(tmp_path, 1, model, optimizer, tokenizer))
    assert ckpt.sharded and not ckpt.adapters
    files = sorted(p.relative_to(ckpt.path).as_posix() for p in ckpt.path.rglob("*") if p.is_file())
    assert f"{SHARDS}/.metadata" in files and f"{SHARDS}/__0_0.distcp" in files
    assert "policy/config.json" in files and "policy/tokenizer_config.json" in files
    assert not [f for f in files if f.startswith("policy/model")] and "optimizer.pt" not in files  # no weights there
    # every weight under its model name (the tied LM head under both of its names), as the model holds it
    weights = read_trained_weights(ckpt.shards_dir)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())

    fresh = copy.deepcopy(base)
    fresh_optimizer = _adamw(fresh)
    load_trained_state(ckpt.path, fresh, fresh_optimizer)
    # bit-exact: the loaded tensors are copies, and the next steps run the same kernels on the same shapes
    for a, b in zip(fresh_optimizer.state_dict()["state"].values(), optimizer.state_dict()["state"].values(),
                    strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    _step(model, optimizer)
    _step(fresh, fresh_optimizer)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_lora_shards_hold_the_adapters_and_their_optimizer_state_only(tiny_model_and_tokenizer, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    base, tokenizer = tiny_model_and_tokenizer
    model = _lora(copy.deepcopy(base))
    optimizer = _adamw(model)
    _step(model, optimizer)
    ckpt = load_checkpoint(_save(tmp_path, 1, model, optimizer, tokenizer))
    adapters = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert saved_parameter_names(ckpt.shards_dir) == adapters  # nothing of the frozen base model
    keys = FileSystemReader(ckpt.shards_dir).read_metadata().state_dict_metadata
    moments = sorted(k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in keys
                     if k.startswith("optim.state.") and k.endswith(".exp_avg"))
    assert moments == adapters  # one AdamW state per adapter, none for the base
    assert ckpt.adapters  # peft's adapter_config.json, naming the base model
    assert json.loads((ckpt.model_dir / "adapter_config.json").read_text())["r"] == 4
    # consolidated under the names peft's adapter file uses, as a one-process LoRA checkpoint holds them
    from peft import get_peft_model_state_dict

    expected, got = get_peft_model_state_dict(model), trained_weights(ckpt)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], v) for k, v in expected.items())

    fresh = _lora(copy.deepcopy(base))  # new adapters (A random, B 0), then the saved ones loaded over them
    fresh_optimizer = _adamw(fresh)
    load_trained_state(ckpt.path, fresh, fresh_optimizer)
    _step(model, optimizer)
    _step(fresh, fresh_optimizer)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())

    # a full model can't load adapters (and the other way round): one error naming what differs
    with pytest.raises(ShardedCheckpointError, match=r"lacks \d+ trained parameter\(s\) \(lm_head.weight|"
                                                     r"lacks \d+ trained parameter\(s\) \(model\."):
        plain = copy.deepcopy(base)
        load_trained_state(ckpt.path, plain, _adamw(plain))


def test_partial_or_damaged_shards_are_never_resumed(tiny_model_and_tokenizer, tmp_path, caplog):
    base, tokenizer = tiny_model_and_tokenizer
    model = copy.deepcopy(base)
    optimizer = _adamw(model)
    for step in (1, 2, 3):
        _step(model, optimizer)
        _save(tmp_path, step, model, optimizer, tokenizer)
    # what the driver checks after its ranks wrote: every shard file the metadata names is there (a rank on another
    # node without a shared filesystem writes to its own disk)
    check_shards_visible(checkpoint_dir(tmp_path, 3))
    # step 3: a save that never finished (a rank died while writing: a shard missing, no marker)
    (checkpoint_dir(tmp_path, 3) / MARKER_FILE).unlink()
    (checkpoint_dir(tmp_path, 3) / SHARDS / "__0_0.distcp").unlink()
    with pytest.raises(ShardedCheckpointError, match=r"__0_0\.distcp missing\. output_dir must be a filesystem"):
        check_shards_visible(checkpoint_dir(tmp_path, 3))
    # step 2: a shard changed after the save
    shard = checkpoint_dir(tmp_path, 2) / SHARDS / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="nemo_rl_ext.training.checkpoint"):
        ckpt = resumable_checkpoint(tmp_path)
    assert ckpt.step == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(shard) in warnings[0] and "sha256 differs" in warnings[0], warnings
    # a save that dies mid-way leaves no step folder at all (the temporary folder goes)
    def die(folder: Path) -> None:
        save_trained_state(folder, model, optimizer)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 4, tokenizer=tokenizer, data_state={}, write_state=die)
    assert not checkpoint_dir(tmp_path, 4).exists() and not list(tmp_path.glob(".step_*"))
