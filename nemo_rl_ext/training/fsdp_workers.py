"""One trainer rank: a Ray actor that holds an FSDP2 shard of the policy (and of the reference model) and runs
the micro-batches the driver (`distributed_trainer.DistributedTrainer`) hands it.

Every rank runs the same collectives in the same order, or the ranks hang: FSDP2 all-gathers each decoder
layer in every forward and reduce-scatters its gradient in every backward. So the driver gives every rank
the same number of micro-batch slots per pass (a rank without a micro-batch runs a dummy one whose loss is
0), and the forward of a slot always runs the model exactly once (the in-process trainer's prompt-prefix
sharing runs the decoder once or twice depending on the data, so ranks do not use it). The loss of each
micro-batch is divided by the GLOBAL token (or sequence) count the driver computed over the whole
minibatch, and FSDP sums the gradients over ranks (divide factor 1), so the ranks' update is the one the
in-process trainer computes on the whole minibatch. Collectives time out (`COLLECTIVE_TIMEOUT_S`), so a
dead peer never hangs a rank for ever; the driver notices a dead actor at once anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nemo_rl_ext.distillation.local_teacher import score_batch
from nemo_rl_ext.distillation.teacher import TeacherScores
from nemo_rl_ext.models.loading import enable_activation_checkpointing, load_model_and_tokenizer
from nemo_rl_ext.objectives.distillation import DistillationLoss
from nemo_rl_ext.objectives.logprobs import right_pad
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, CompletionTensors
from nemo_rl_ext.training.config import LoraSettings, OptimizerSettings
from nemo_rl_ext.training.fsdp_refit import RefitSource
from nemo_rl_ext.training.fsdp_wrap import (
    WrapSettings,
    adapters_off,
    shard_frozen,
    shard_group,
    shard_model,
)
from nemo_rl_ext.training.sharded_checkpoint import load_trained_state, save_trained_state
from nemo_rl_ext.training.trainer import micro_batch_loss

COLLECTIVE_TIMEOUT_S = 300.0
"""How long a rank waits in one collective (gloo / NCCL) before it fails instead of hanging."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank builds: the model folders, the optimizer and the loss."""

    model_path: str
    """The policy's weights (the initial model, or a checkpoint's `policy/` folder)."""
    reference_path: str | None
    """The KL reference model's folder (the initial policy); None without a KL term."""
    dtype: str
    """The policy's torch dtype name (`policy.dtype`)."""
    device: str
    """`cpu` or `cuda` (each GPU rank sees the one GPU Ray gave it)."""
    optimizer: OptimizerSettings
    """The AdamW and batching settings."""
    loss: ClippedPGLossConfig
    """The clipped policy-gradient loss."""
    temperature: float
    """The sampling temperature the logprobs divide the logits by."""
    pad_token_id: int
    """The id that right-pads a micro-batch."""
    wrap: WrapSettings = WrapSettings()
    """Mixed precision, activation checkpointing, CPU offload and replication (`trainer:`)."""
    lora: LoraSettings | None = None
    """Train LoRA adapters on these modules instead of every weight (the KL reference: adapters disabled)."""
    adapter_dir: str | None = None
    """A LoRA checkpoint's `policy/` folder to resume the adapters from (the base model is `model_path`)."""
    init_seed: int | None = None
    """The torch seed new LoRA adapters are drawn under (`grpo.seed`: the in-process trainer draws them right
    after seeding torch with it, so every worker count starts from the same adapters)."""
    distillation: DistillationLoss | None = None
    """On-policy distillation: how the items' teacher scores enter the loss (as `PolicyTrainer`'s)."""


def use_gloo_interface_of(ip: str) -> None:
    """Make gloo listen on, and tell its peers, the network interface that holds `ip` (the rank's node address).

    Without it gloo takes the address the machine's host name resolves to, and advertises 127.0.0.1 where that
    fails or is a loopback (Debian's 127.0.1.1 too): ranks on other nodes then cannot connect (seen with two
    hosts, `tests/functional/test_two_hosts.py`). A `GLOO_SOCKET_IFNAME` set by the user is kept.
    """
    import psutil  # lazy: only a trainer rank needs it

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addresses):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
            return


Slot = Sequence[CompletionTensors] | None
"""One micro-batch of a pass, or None: the rank runs a dummy micro-batch (its peers have a real one)."""


def _weights_dtype(spec: RankSpec) -> torch.dtype:
    """The dtype a rank loads the policy, the reference and a teacher in: bf16 mixed precision keeps float32
    master weights (FSDP2 casts the gathered weights for compute), else `spec.dtype`."""
    return torch.float32 if spec.wrap.mixed_precision == "bf16" else getattr(torch, spec.dtype)


class TrainerRank:
    """One rank of the distributed trainer (hosted by `ray.remote`); the driver calls every rank alike."""

    def __init__(self, rank: int, world_size: int, torch_threads: int | None = 1) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)  # Ray does not cap torch threads
        self.rank, self.world_size = rank, world_size
        self.policy: Any = None
        self.reference: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.teachers: dict[str, Any] = {}  # distillation teachers by key: frozen, sharded, never optimized
        self._listen: socket.socket | None = None  # rank 0: the rendezvous socket (`where`, else `setup`)
        self._ip: str | None = None  # this rank's node address (`where`): gloo's connections use it

    def where(self) -> dict[str, Any]:
        """This rank's node, IP address and pid, and (for rank 0) a free port for the rendezvous."""
        # Ray actor code: runs in the worker process (ray loads only when Ray is used)
        import ray

        ip = self._ip = ray.util.get_node_ip_address()
        info: dict[str, Any] = {"rank": self.rank, "pid": os.getpid(), "ip": ip,
                                "node_id": ray.get_runtime_context().get_node_id()}
        if self.rank == 0:  # the rendezvous listens on this socket, bound to the node's address only (no race)
            self._listen = socket.socket()
            self._listen.bind((ip, 0))
            self._listen.listen()
            info["port"] = self._listen.getsockname()[1]
        return info

    def setup(self, master: str, port: int, spec: RankSpec) -> dict[str, Any]:
        """Join the process group, load and shard the policy (and the reference); returns the model's parameter
        count, the trained ones' and whether a reference model was loaded."""
        import torch.distributed as dist  # lazy: torch.distributed loads only where a rank uses it

        self.spec = spec
        self.device = torch.device("cuda", 0) if spec.device.startswith("cuda") else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        # torch's own TCPStore server would listen on every interface; rank 0's listens on the socket `where`
        # bound to the node's address (127.0.0.1 on a local Ray)
        if self.rank == 0 and self._listen is None:  # set up without `where` (no Ray: scripts/gpu_check.py)
            self._listen = socket.create_server((master, port))
        if self._ip is not None:
            use_gloo_interface_of(self._ip)
        # the store gets its own copy of the fd: it closes the one it is given when it is destroyed (at garbage
        # collection), and `shutdown` closes `_listen`; on one shared number the later close hit whatever file
        # reused it (a second rank set up in the same process read its tokenizer through a closed fd)
        listen_fd = os.dup(self._listen.fileno()) if self._listen is not None else None
        store = dist.TCPStore(master, port, self.world_size, self.rank == 0, timeout, wait_for_workers=False,
                              master_listen_fd=listen_fd)
        backend = "gloo"
        if self.device.type == "cuda":  # offloaded shards live on the CPU: their gathers (refit, checkpoint) use gloo
            backend = "cpu:gloo,cuda:nccl" if spec.wrap.cpu_offload else "nccl"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)
        self._load_models(spec)
        self.parameters = [p for p in self.policy.parameters() if p.requires_grad]
        opt = spec.optimizer
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
            fused=True if self.device.type in ("cpu", "cuda") else None,
        )
        return {"parameters": sum(p.numel() for p in self.model.parameters()),
                "trained": sum(p.numel() for p in self.parameters), "reference_loaded": self.reference is not None}

    def _load_models(self, spec: RankSpec) -> None:
        """Load the policy (LoRA-wrapped with `spec.lora`) and the reference model, each wrapped and sharded."""
        dtype = _weights_dtype(spec)
        # with CPU offload FSDP2 moves the shards to the CPU itself; the model is built on the GPU first
        model, _ = load_model_and_tokenizer(spec.model_path, dtype=dtype, device=str(self.device))
        if spec.lora is not None:  # adapters before sharding: each layer's FSDP unit holds its adapters
            from nemo_rl_ext.training.lora import with_lora

            if spec.init_seed is not None:
                torch.manual_seed(spec.init_seed)
            model = with_lora(model, spec.lora, adapter_dir=spec.adapter_dir)
        if spec.wrap.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.model = model
        self.refit = RefitSource(model)
        wrap = (spec.wrap, self.device, self.world_size)
        self.policy = shard_model(model, spec.temperature, *wrap)
        if spec.reference_path is not None and spec.lora is None:  # a LoRA policy is its own reference
            reference, _ = load_model_and_tokenizer(spec.reference_path, dtype=dtype, device=str(self.device))
            no_ac = dataclasses.replace(spec.wrap, activation_checkpointing=False)  # never trained: no backward
            self.reference = shard_model(reference.eval().requires_grad_(False), spec.temperature, no_ac,
                                         self.device, self.world_size)

    def load_teacher(self, key: str, path: str) -> int:
        """Load the distillation teacher at `path` as `key` (after `setup`: it is never given to the optimizer),
        frozen and sharded as the reference model is (same dtype and wrapping); returns its parameter count."""
        model, _ = load_model_and_tokenizer(path, dtype=_weights_dtype(self.spec), device=str(self.device))
        no_ac = dataclasses.replace(self.spec.wrap, activation_checkpointing=False)  # never trained: no backward
        self.teachers[key] = shard_frozen(model, no_ac, self.device, self.world_size)
        return sum(p.numel() for p in model.parameters())

    def teacher_scores(self, key: str, slots: Sequence[list[list[int]] | None], top_k: int
                       ) -> list[list[TeacherScores] | None]:
        """Teacher `key`'s scores of each batch of id sequences (`local_teacher.score_batch`, the local teacher's
        math); a None slot runs a two-token dummy forward (its peers have a batch: the same collectives)."""
        teacher = self.teachers[key]
        out: list[list[TeacherScores] | None] = []
        for batch in slots:
            scores = score_batch(teacher, batch or [[self.spec.pad_token_id] * 2], top_k, self.device)
            out.append(None if batch is None else scores)
        return out

    # ---- passes -----------------------------------------------------------------------------------

    def _batch(self, items: Slot) -> tuple[torch.Tensor, ...]:
        """(ids, attention, loss mask, generation logprobs), right-padded on the device; a dummy for None."""
        if items is None:
            ids = torch.full((1, 2), self.spec.pad_token_id, dtype=torch.int64)
            return tuple(t.to(self.device) for t in (ids, torch.ones_like(ids), torch.zeros(1, 2), torch.zeros(1, 2)))
        ids = right_pad([x.token_ids for x in items], self.spec.pad_token_id, torch.int64)
        attention = right_pad([torch.ones_like(x.token_ids) for x in items], 0, torch.int64)
        mask = right_pad([x.loss_mask for x in items], 0.0, torch.float32)
        gen = right_pad([x.generation_logprobs for x in items], 0.0, torch.float32)
        return tuple(t.to(self.device) for t in (ids, attention, mask, gen))

    @torch.no_grad()
    def logprobs(self, slots: Sequence[Slot], reference: bool = False) -> list[list[torch.Tensor] | None]:
        """Per-token logprobs (on the loss mask, 0 elsewhere) of each item of each slot, under the policy or
        the reference model; None for a dummy slot."""
        lora_reference = reference and self.spec.lora is not None
        module = self.policy if lora_reference or not reference else self.reference
        was_training = module.training
        module.eval()
        out: list[list[torch.Tensor] | None] = []
        # a LoRA policy's reference is itself with the adapters disabled (peft): no copy of the model
        with adapters_off(self.model) if lora_reference else contextlib.nullcontext():
            for items in slots:
                ids, attention, mask, _ = self._batch(items)
                lp = module(ids, attention, mask).cpu()
                out.append(None if items is None else [lp[b, : x.token_ids.numel()].clone()
                                                       for b, x in enumerate(items)])
        module.train(was_training)
        return out

    def train_minibatch(
        self,
        slots: Sequence[tuple[Sequence[CompletionTensors], torch.Tensor, list | None, list | None] | None],
        count: float,
    ) -> tuple[list[dict[str, float] | None], float | None]:
        """Accumulate this rank's share of one minibatch's gradients (each loss divided by the global `count`),
        then one optimizer step on the global gradient; returns each slot's loss metrics and the global grad
        norm (None: no step: nothing trained, or a non-finite gradient)."""
        assert self.optimizer is not None
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        out: list[dict[str, float] | None] = []
        for slot in slots:
            if slot is None:
                ids, attention, mask, _ = self._batch(None)
                logprobs = self.policy(ids, attention, mask)
                if count > 0:
                    logprobs.sum().backward()  # zero gradients: this rank's share of the collectives
                out.append(None)
                continue
            loss, metrics = self._micro_batch_loss(*slot, count)
            if count > 0:
                loss.backward()
            out.append(metrics)
        self.policy.eval()
        if count == 0:
            return out, None
        norm = self._clip_gradients()
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return out, None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return out, norm

    def _micro_batch_loss(
        self, items: Sequence[CompletionTensors], advantages: torch.Tensor, old: list | None, ref: list | None,
        count: float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss and metrics (`trainer.micro_batch_loss`, as the in-process trainer's)."""
        ids, attention, mask, gen = self._batch(items)
        entropy_mode = "grad" if self.spec.loss.entropy_coef != 0.0 else "detached"
        return micro_batch_loss(
            lambda topk_ids: self.policy(ids, attention, mask, entropy_mode, topk_ids), items, mask, gen,
            advantages, old, ref, count, self.spec.loss, self.spec.distillation,
        )

    def _clip_gradients(self) -> float:
        """Clip by the norm of the whole (global) gradient, as `clip_grad_norm_` does on one process: each rank's
        shards' squared norms, summed over ranks; every rank then scales its shards by the same factor."""
        import torch.distributed as dist  # lazy: torch.distributed loads only where a rank uses it
        from torch.distributed.tensor import DTensor

        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                 for p in self.parameters if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in local:  # with CPU offload the gradient shards live on the CPU
            squares += grad.detach().float().pow(2).sum().to(self.device)
        dist.all_reduce(squares, group=shard_group(self.parameters[0]))  # replicated ranks: each holds the whole
        total = squares.sqrt()
        max_norm = self.spec.optimizer.max_grad_norm
        if max_norm is not None:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(local, coef.to(device=local[0].device, dtype=local[0].dtype))
        return float(total)

    # ---- weights and optimizer state --------------------------------------------------------------

    def tensor_sizes(self) -> list[tuple[str, int, str | None, bool]]:
        """The plain model's state-dict entries (`RefitSource.layout`): (name, bytes, tied-to name, changes)."""
        return self.refit.layout()

    def trained_names(self) -> list[str]:
        """The names of the trained parameters, in the order an optimizer over `model.parameters()` numbers them."""
        return [name for name, param in self.model.named_parameters() if param.requires_grad]

    def gather(self, names: Sequence[str]) -> dict[str, torch.Tensor] | None:
        """The full tensors of `names` (plain names; a LoRA target module's weight merged with its adapter): on
        rank 0, on the CPU; None on the others."""
        return self.refit.gather(names, keep=self.rank == 0)

    def optimizer_state(self) -> dict[str, Any] | None:
        """The full AdamW state keyed by parameter name, gathered tensor by tensor (rank 0; None on the others):
        {"state": {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [hyperparameters]}."""
        # lazy: torch.distributed loads only where a rank uses it
        from torch.distributed.tensor import DTensor

        assert self.optimizer is not None
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in self.model.named_parameters():
            for key, value in self.optimizer.state.get(param, {}).items():
                full = value.full_tensor() if isinstance(value, DTensor) else value
                if self.rank == 0:
                    state.setdefault(name, {})[key] = full.detach().to("cpu", copy=True)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups} if self.rank == 0 else None

    def load_optimizer_state(self, saved: Mapping[str, Any]) -> None:
        """Load `optimizer_state`'s full state: each rank keeps its shard of every tensor (no communication)."""
        # lazy: torch.distributed loads only where a rank uses it
        from torch.distributed.tensor import DTensor, distribute_tensor

        assert self.optimizer is not None
        for name, param in self.model.named_parameters():
            entry = saved["state"].get(name)
            if entry is None:
                continue
            device = param.to_local().device if isinstance(param, DTensor) else param.device  # CPU when offloaded
            self.optimizer.state[param] = {
                key: distribute_tensor(value.to(device), param.device_mesh, param.placements, src_data_rank=None)
                if isinstance(param, DTensor) and key != "step" else value.to(device)
                for key, value in entry.items()
            }
        for group, hyper in zip(self.optimizer.param_groups, saved["param_groups"], strict=True):
            group.update(hyper)

    def save_sharded(self, folder: str) -> None:
        """Write this rank's shards of the trained parameters and their optimizer state into the checkpoint
        folder (`sharded_checkpoint`); rank 0 also the model's config files."""
        assert self.optimizer is not None
        save_trained_state(folder, self.model, self.optimizer, metadata=self.rank == 0)

    def load_sharded(self, folder: str) -> None:
        """Load this rank's shards of a sharded checkpoint (resharded when another number of ranks wrote it)."""
        assert self.optimizer is not None
        load_trained_state(folder, self.model, self.optimizer)

    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next optimizer steps (`optimizer.scheduler`; every rank the same)."""
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def shutdown(self) -> None:
        import torch.distributed as dist  # lazy: torch.distributed loads only where a rank uses it

        if dist.is_initialized():
            dist.destroy_process_group()
        if self._listen is not None:
            self._listen.close()
            self._listen = None
