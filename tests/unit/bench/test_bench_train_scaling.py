"""bench/train_scaling.py's accounting on the tiny model: the bytes it reports for parameters, gradients and AdamW
state are the sums of numel x element_size of those tensors (a tied weight once; a DTensor by its local shard)."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, CompletionTensors
from nemo_rl_ext.training.config import LoraSettings, OptimizerSettings
from nemo_rl_ext.training.lora import with_lora
from nemo_rl_ext.training.trainer import PolicyTrainer

BENCH = Path(__file__).resolve().parents[3] / "bench" / "train_scaling.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_scaling_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _items() -> tuple[list[CompletionTensors], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    items = []
    for n in (9, 12):
        ids = torch.randint(0, 200, (n,), generator=g)
        mask = torch.cat([torch.zeros(4), torch.ones(n - 4)])
        items.append(CompletionTensors(ids, mask, -torch.rand(n, generator=g) * mask))
    return items, torch.tensor([1.0, -1.0])


def _by_storage(tensors) -> int:
    """numel x element_size summed over distinct storages (an independent way to count a tied weight once)."""
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())


@pytest.mark.parametrize("lora", [False, True])
def test_state_bytes_of_the_in_process_trainer(bench, tiny_model_and_tokenizer, lora: bool) -> None:
    model = copy.deepcopy(tiny_model_and_tokenizer[0])
    if lora:
        model = with_lora(model, LoraSettings(r=4, target_modules=("q_proj", "v_proj")))
    probe = bench.StateProbe()
    try:
        trainer = PolicyTrainer(model, optimizer=OptimizerSettings(lr=1e-3), loss=ClippedPGLossConfig(kl_coef=0.0),
                                temperature=1.0)
        trainer.train_step(*_items())
    finally:
        probe.close()
    trained = [p for p in model.parameters() if p.requires_grad]
    every = [p for _, p in model.named_parameters(remove_duplicate=False)]  # the tied embedding listed twice
    assert probe.steps == 1
    assert bench.local_bytes(every) == _by_storage(every)
    assert probe.grads == _by_storage(trained) > 0  # gradients as they were when the optimizer stepped
    # AdamW: exp_avg and exp_avg_sq like each weight, plus a float32 step counter per trained tensor
    assert probe.optimizer == 2 * _by_storage(trained) + 4 * len(trained)
    assert bench.optimizer_state_bytes(trainer.optimizer) == probe.optimizer
    if lora:  # the optimizer holds the adapters alone
        assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
        assert probe.optimizer < 0.2 * bench.local_bytes(every)


def test_a_dtensor_counts_its_local_shard(bench, tiny_model_and_tokenizer, tmp_path: Path) -> None:
    """FSDP2 at world size 1 (gloo, a FileStore): every parameter is a DTensor whose local shard is all of it; each
    `to_local()` is a fresh view, whose id may be a freed view's (the count must not skip those)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = copy.deepcopy(tiny_model_and_tokenizer[0])
    expected = _by_storage(list(model.parameters()))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        params = list(model.parameters())
        assert params and all(isinstance(p, DTensor) for p in params)
        assert bench.local_bytes(params) == expected
    finally:
        dist.destroy_process_group()
