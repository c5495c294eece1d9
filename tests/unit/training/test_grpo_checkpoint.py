"""Checkpoints: a round trip restores model, optimizer, RNG and data position; saves are atomic; a damaged
checkpoint is named and skipped for the previous whole one."""

from __future__ import annotations

import copy
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_rl_ext.config import ConfigError
from nemo_rl_ext.models.loading import load_model_and_tokenizer
from nemo_rl_ext.training.checkpoint import (
    MARKER_FILE,
    CheckpointError,
    checkpoint_dir,
    get_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resumable_checkpoint,
    save_checkpoint,
)


def trained_model_and_optimizer(model):
    """A copy of the model with one AdamW step taken, so the optimizer has state."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def test_round_trip(tiny_model_and_tokenizer, tmp_path):
    base, tokenizer = tiny_model_and_tokenizer
    model, optimizer = trained_model_and_optimizer(base)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_checkpoint(
        tmp_path, 7, model=model, tokenizer=tokenizer, optimizer=optimizer,
        data_state={"consumed": 28, "num_rows": 8}, extra={"note": "x"},
    )
    expected_draws = (random.random(), np.random.rand(), torch.rand(1))

    assert path == checkpoint_dir(tmp_path, 7) and latest_checkpoint(tmp_path) == path
    ckpt = load_checkpoint(path)
    assert (ckpt.step, ckpt.data_state, ckpt.extra) == (7, {"consumed": 28, "num_rows": 8}, {"note": "x"})
    ckpt.restore_rng()  # bit-exact below: restored RNG states and saved tensors are copies, no arithmetic
    assert (random.random(), np.random.rand()) == expected_draws[:2]
    assert torch.equal(torch.rand(1), expected_draws[2])

    loaded, loaded_tokenizer = load_model_and_tokenizer(ckpt.model_dir)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded_tokenizer("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]
    fresh = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    fresh.load_state_dict(ckpt.optimizer_state())
    for a, b in zip(fresh.state_dict()["state"].values(), optimizer.state_dict()["state"].values(), strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_a_save_can_store_rng_states_taken_earlier(tiny_model_and_tokenizer, tmp_path):
    """What a stop does: it checkpoints a step that ended a while ago, with the RNG states of that moment."""
    base, tokenizer = tiny_model_and_tokenizer
    model, optimizer = trained_model_and_optimizer(base)
    torch.manual_seed(5)
    at_step_end = get_rng_state()
    expected = torch.rand(3)
    torch.rand(100)  # the next step's rollouts drew from the RNG before the stop
    path = save_checkpoint(tmp_path, 2, model=model, tokenizer=tokenizer, optimizer=optimizer,
                           data_state={"consumed": 8, "num_rows": 8}, rng_state=at_step_end)
    torch.manual_seed(6)
    load_checkpoint(path).restore_rng()
    assert torch.equal(torch.rand(3), expected)  # the same RNG state and kernel: bit-exact


def test_incomplete_saves_are_ignored_and_old_ones_pruned(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kwargs = dict(model=model, tokenizer=tokenizer, optimizer=optimizer, data_state={})
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, keep_last=2, **kwargs)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    # a save killed midway leaves a hidden temp folder; a folder without the completeness marker (a crash
    # mid-write where renames aren't atomic) is not a checkpoint, even with every other file in it
    (tmp_path / ".step_00000004.tmpabc").mkdir()
    (tmp_path / "step_00000005").mkdir()
    shutil.copytree(checkpoint_dir(tmp_path, 3), tmp_path / "step_00000006")
    (tmp_path / "step_00000006" / MARKER_FILE).unlink()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 3)
    assert resumable_checkpoint(tmp_path).step == 3
    save_checkpoint(tmp_path, 4, **kwargs)
    assert not (tmp_path / ".step_00000004.tmpabc").exists()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 4)


def test_a_failed_save_leaves_nothing(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer

    class Broken:
        def state_dict(self):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 1, model=model, tokenizer=tokenizer, optimizer=Broken(), data_state={})
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match=f"not a complete checkpoint: it has no {MARKER_FILE}"):
        load_checkpoint(tmp_path)
    assert resumable_checkpoint(tmp_path) is None


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _random_bytes(path: Path) -> None:
    """64 random bytes over the middle of the file (same size: only a checksum can tell)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    noise = random.Random(0).randbytes(64)
    assert noise != data[mid : mid + 64]
    data[mid : mid + 64] = noise
    path.write_bytes(bytes(data))


DAMAGES: dict[str, tuple[str, Callable[[Path], None]]] = {
    "truncated weights": ("policy/model.safetensors", _truncate),
    "random bytes in the weights": ("policy/model.safetensors", _random_bytes),
    "truncated optimizer state": ("optimizer.pt", _truncate),
    "truncated state.json": ("state.json", _truncate),
    "missing RNG file": ("rng.pt", Path.unlink),
}


@pytest.fixture
def two_checkpoints(tiny_model_and_tokenizer, tmp_path) -> Path:
    base, tokenizer = tiny_model_and_tokenizer
    model, optimizer = trained_model_and_optimizer(base)
    for step in (1, 2):
        save_checkpoint(
            tmp_path, step, model=model, tokenizer=tokenizer, optimizer=optimizer, data_state={"consumed": step},
        )
    return tmp_path


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_used(two_checkpoints, damage, caplog):
    name, spoil = DAMAGES[damage]
    damaged_file = checkpoint_dir(two_checkpoints, 2) / name
    spoil(damaged_file)

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(checkpoint_dir(two_checkpoints, 2))
    assert str(err.value).startswith(str(damaged_file)), err.value
    assert isinstance(err.value, ConfigError)  # a user-facing error: the CLIs print it alone

    with caplog.at_level(logging.WARNING, logger="nemo_rl_ext.training.checkpoint"):
        ckpt = resumable_checkpoint(two_checkpoints)
    assert (ckpt.path, ckpt.step, ckpt.data_state) == (checkpoint_dir(two_checkpoints, 1), 1, {"consumed": 1})
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(damaged_file) in warnings[0], warnings
    ckpt.restore_rng()  # the fallback is whole: its files load
    assert ckpt.optimizer_state()["state"]


def test_no_whole_checkpoint_is_a_clean_error(two_checkpoints, caplog):
    _truncate(checkpoint_dir(two_checkpoints, 2) / "optimizer.pt")
    (checkpoint_dir(two_checkpoints, 1) / "rng.pt").unlink()
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError) as err:
        resumable_checkpoint(two_checkpoints)
    text = str(err.value)
    assert text.startswith(f"no usable checkpoint in {two_checkpoints}"), text
    assert str(checkpoint_dir(two_checkpoints, 2) / "optimizer.pt") in text
    assert str(checkpoint_dir(two_checkpoints, 1) / "rng.pt") in text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the error is the one message
    # a damaged marker is damage too, named as such
    (checkpoint_dir(two_checkpoints, 1) / MARKER_FILE).write_text("{")
    with pytest.raises(CheckpointError, match=f"{MARKER_FILE} is damaged"):
        load_checkpoint(checkpoint_dir(two_checkpoints, 1))
