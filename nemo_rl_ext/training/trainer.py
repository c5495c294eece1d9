"""The policy trainer: per-token logprobs of padded batches, and micro-batched clipped-PG optimizer steps.

The trainer owns its own copy of the model (the generation backend holds another) and hands its weights
over with `state_dict()` after each step. Logprobs use the generation backend's distribution,
`log_softmax(logits / T)`, so the engine's logprobs and the trainer's are directly comparable. They are
computed only where the loss mask reads them (`logprobs.py`): the LM head and the full-vocabulary
log-softmax run on the scored positions only (completion tokens, assistant spans), in chunks of rows, and
with `optimizer.share_prompt_prefix` (the default) the decoder runs once over a prompt that several samples
of a micro-batch share.

Memory savers (`trainer:` settings, see `training.config`): a LoRA policy (a peft `PeftModel`, see `lora.py`)
trains its adapters alone and is its own KL reference with the adapters disabled; `activation_checkpointing`
recomputes each decoder layer's activations in the backward pass; `mixed_precision="bf16"` runs every
forward under bf16 autocast while the weights, their gradients and AdamW's state stay float32.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from nemo_rl_ext.models.adapters import is_peft_model
from nemo_rl_ext.models.loading import enable_activation_checkpointing
from nemo_rl_ext.objectives.aggregation import minibatch_count
from nemo_rl_ext.objectives.distillation import (
    DistillationLoss,
    distillation_terms,
    means_of_sums,
    teacher_batch,
)
from nemo_rl_ext.objectives.kl_reward import fit_to, kl_in_reward_advantages
from nemo_rl_ext.objectives.logprobs import right_pad, shared_prefix_logprobs, token_logprobs
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, CompletionTensors, clipped_pg_loss
from nemo_rl_ext.training.config import OptimizerSettings
from nemo_rl_ext.training.lora import merged_state_dict, streamed_merged_weights

logger = logging.getLogger(__name__)

_MEAN_METRICS = (
    "clip_fraction",
    "clip_fraction/low",
    "clip_fraction/high",
    "dual_clip_fraction",
    "policy_ratio/mean",
    "importance_ratio/mean",
    "is_weight/mean",
    "is_weight/truncated_fraction",
    "kl/mean",
    "gen_kl/mean",
    "entropy",
)
_MAX_METRICS = ("policy_ratio/max", "importance_ratio/max")
_SUM_METRICS = ("loss", "loss/pg", "loss/kl", "loss/entropy", "num_tokens", "num_sequences", "is/masked_tokens", "is/masked_sequences")


def _needed(ref: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """The reference logprobs `loss.use_kl_in_reward` subtracts the KL with (its config rule: kl_coef > 0)."""
    if ref is None:
        raise ValueError("loss.use_kl_in_reward needs the reference policy's logprobs (kl_coef > 0)")
    return ref


def minibatch_bounds(num_items: int, advantages: torch.Tensor, minibatches_per_step: int) -> list[int]:
    """The item index where each of a step's minibatches starts, then `num_items` (as even as rounding allows);
    ValueError unless there is one advantage per item and at least one item."""
    if num_items != advantages.shape[0]:
        raise ValueError(f"{num_items} completions but {advantages.numel()} advantages")
    if not num_items:
        raise ValueError("train_step needs at least one completion")
    n_mini = min(minibatches_per_step, num_items)
    return [round(i * num_items / n_mini) for i in range(n_mini + 1)]


class _MetricSums:
    """Combines per-micro-batch loss metrics: token-weighted means, maxima and sums."""

    def __init__(self) -> None:
        self.weighted: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.sums: dict[str, float] = {}
        self.tokens = 0.0

    def add(self, metrics: Mapping[str, float]) -> None:
        n = metrics["num_tokens"]
        self.tokens += n
        for key in _MEAN_METRICS:
            if key in metrics:
                self.weighted[key] = self.weighted.get(key, 0.0) + metrics[key] * n
        for key in _MAX_METRICS:
            if key in metrics:
                self.maxima[key] = max(self.maxima.get(key, -math.inf), metrics[key])
        for key in _SUM_METRICS:
            self.sums[key] = self.sums.get(key, 0.0) + metrics.get(key, 0.0)
        for key, value in metrics.items():  # `sum:<key>` / `n:<key>` pairs: means over their own counts
            if key.startswith(("sum:", "n:")):
                self.sums[key] = self.sums.get(key, 0.0) + value

    def skip(self, masked_tokens: Sequence[float]) -> None:
        """A micro-batch skipped for its zero advantages (its samples' masked-token counts): its tokens and
        sequences count, its loss is 0, its samples are counted in `zero_advantage_skipped`."""
        add = {"loss": 0.0, "loss/pg": 0.0, "loss/kl": 0.0, "loss/entropy": 0.0, "num_tokens": float(sum(masked_tokens)),
               "num_sequences": float(sum(1 for n in masked_tokens if n > 0)),
               "zero_advantage_skipped": float(len(masked_tokens))}
        for key, value in add.items():
            self.sums[key] = self.sums.get(key, 0.0) + value

    def step_result(self, minibatches: int, grad_norms: Sequence[float], skipped: int, lr: float) -> dict[str, float]:
        """A GRPO step's metrics (both trainers'): `result()` with the losses averaged over the step's minibatches,
        the mean grad norm, the optimizer steps taken and skipped, and the lr."""
        metrics = self.result()
        for key in ("loss", "loss/pg", "loss/kl", "loss/entropy"):
            metrics[key] = metrics.get(key, 0.0) / minibatches
        metrics["grad_norm"] = float(sum(grad_norms) / len(grad_norms)) if grad_norms else 0.0
        metrics["optimizer_steps"] = float(len(grad_norms))
        metrics["skipped_minibatches"] = float(skipped)
        metrics.setdefault("zero_advantage_skipped", 0.0)  # the FSDP2 ranks run every micro-batch
        for key in (*_MEAN_METRICS, *_MAX_METRICS, *_SUM_METRICS):  # every micro-batch skipped: nothing was
            if key != "kl/mean":  # measured, 0.0 as over no trained token (kl/mean: only with a reference)
                metrics.setdefault(key, 0.0)
        metrics["lr"] = float(lr)
        return metrics

    def result(self) -> dict[str, float]:
        out = {k: v for k, v in self.sums.items() if not k.startswith(("sum:", "n:"))}
        out.update(means_of_sums(self.sums))
        masked = out.get("is/masked_tokens", 0.0)
        if masked > 0 and masked == out.get("num_tokens"):
            logger.warning("every trained token of this step (%d) was masked by loss.truncated_importance_sampling_"
                           "type (engine/trainer ratio outside the band): the policy-gradient term trained on nothing",
                           int(masked))
        out.update({k: v / self.tokens if self.tokens else 0.0 for k, v in self.weighted.items()})
        out.update({k: (v if math.isfinite(v) else 0.0) for k, v in self.maxima.items()})
        return out


class PolicyTrainer:
    """Trains a causal LM with the clipped policy-gradient loss on completions and their advantages."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        optimizer: OptimizerSettings,
        loss: ClippedPGLossConfig,
        temperature: float,
        pad_token_id: int = 0,
        reference_model: PreTrainedModel | None = None,
        mixed_precision: str | None = None,
        activation_checkpointing: bool = False,
        distillation: DistillationLoss | None = None,
    ) -> None:
        self.distillation = distillation
        """On-policy distillation: how the items' teacher scores enter the loss (`objectives.distillation`)."""
        self.lora = is_peft_model(model)
        """The model is a LoRA policy: adapters train, its reference is itself with the adapters disabled."""
        self.refit_partial = self.lora
        """`refit_weights` holds only the tensors training changes (the engine keeps the others)."""
        if loss.kl_coef != 0.0 and reference_model is None and not self.lora:
            raise ValueError("loss.kl_coef != 0 needs a reference_model (the initial policy)")
        if self.lora and reference_model is not None:
            raise ValueError("a LoRA policy is its own reference (adapters disabled): pass no reference_model")
        if mixed_precision not in (None, "bf16"):
            raise ValueError(f"mixed_precision must be None or 'bf16', not {mixed_precision!r}")
        if mixed_precision and any(p.dtype != torch.float32 for p in model.parameters() if p.requires_grad):
            raise ValueError("mixed_precision='bf16' keeps float32 master weights: load the policy in float32")
        self.mixed_precision = mixed_precision
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        self.model = model
        self.settings = optimizer
        self.loss_config = loss
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.reference_model = reference_model.eval().requires_grad_(False) if reference_model else None
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(
            self.parameters,
            lr=optimizer.lr,
            betas=optimizer.betas,
            eps=optimizer.eps,
            weight_decay=optimizer.weight_decay,
            # the fused kernel (CPU and CUDA; the same update up to rounding): SmolLM2-135M's step takes
            # 0.07 s instead of 0.3-0.5 s on one CPU thread. Other devices keep the default implementation.
            fused=True if self.device.type in ("cpu", "cuda") else None,
        )

    def _batch(self, items: Sequence[CompletionTensors]) -> tuple[torch.Tensor, ...]:
        """(input ids, attention mask, loss mask, generation logprobs), right-padded, on the device."""
        ids = right_pad([x.token_ids for x in items], self.pad_token_id, torch.int64)
        attention = right_pad([torch.ones_like(x.token_ids) for x in items], 0, torch.int64)
        mask = right_pad([x.loss_mask for x in items], 0.0, torch.float32)
        gen = right_pad([x.generation_logprobs for x in items], 0.0, torch.float32)
        return tuple(t.to(self.device) for t in (ids, attention, mask, gen))

    @torch.no_grad()
    def logprobs(self, items: Sequence[CompletionTensors]) -> list[torch.Tensor]:
        """Per-token logprobs of each completion under the current weights (one 1-D tensor per item), on the
        tokens of its loss mask (the only ones the loss reads); 0 elsewhere."""
        return self._frozen_logprobs(self.model, items)

    def reference_logprobs(self, items: Sequence[CompletionTensors]) -> list[torch.Tensor]:
        """`logprobs` under the KL reference: the reference model, or a LoRA policy with its adapters disabled."""
        if self.lora:
            with self.model.disable_adapter():
                return self._frozen_logprobs(self.model, items)
        if self.reference_model is None:
            raise ValueError("this trainer has no KL reference (kl_coef == 0 and no reference_model)")
        return self._frozen_logprobs(self.reference_model, items)

    def _compute(self) -> contextlib.AbstractContextManager[None]:
        """The forward passes' precision: bf16 autocast with `mixed_precision="bf16"`, else the weights' dtype."""
        if self.mixed_precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _frozen_logprobs(self, model: PreTrainedModel, items: Sequence[CompletionTensors]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for start in range(0, len(items), self.settings.micro_batch_size):
                chunk = items[start : start + self.settings.micro_batch_size]
                ids, attention, mask, _ = self._batch(chunk)
                lp = self._token_logprobs(model, ids, attention, mask).cpu()
                out.extend(lp[b, : x.token_ids.numel()] for b, x in enumerate(chunk))
        model.train(was_training)
        return out

    def train_step(self, items: Sequence[CompletionTensors], advantages: torch.Tensor) -> dict[str, float]:
        """One GRPO update on these completions (`advantages[i]` per completion): returns flat metrics.

        The samples are split into `minibatches_per_step` contiguous minibatches, one optimizer step each;
        each minibatch runs in micro-batches whose gradients accumulate, every micro-batch's loss divided by
        the minibatch's masked-token (or sequence) count, so the sum equals the minibatch loss. With one
        minibatch the old policy is the current one (its detached logprobs); with several, the old
        logprobs come from a no-grad pass before the first update. A minibatch without trained tokens
        takes no optimizer step.
        """
        bounds = minibatch_bounds(len(items), advantages, self.settings.minibatches_per_step)
        n_mini = len(bounds) - 1
        in_reward = self.loss_config.use_kl_in_reward
        old = self.logprobs(items) if n_mini > 1 or in_reward else None
        has_reference = self.reference_model is not None or (self.lora and self.loss_config.kl_coef != 0.0)
        ref = self.reference_logprobs(items) if has_reference else None
        if in_reward:  # Reinforce++: the KL moves from the loss into the advantages, per token
            advantages = kl_in_reward_advantages(advantages, [x.loss_mask for x in items], old, _needed(ref),
                                                 self.loss_config)
        self.model.train()
        sums, grad_norms, skipped = _MetricSums(), [], 0
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            norm = self._minibatch(items, advantages, range(lo, hi), old, ref, sums)
            if norm is None:
                skipped += 1
            else:
                grad_norms.append(norm)
        self.model.eval()
        return sums.step_result(n_mini, grad_norms, skipped, self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next optimizer steps (`optimizer.scheduler`)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _minibatch(
        self,
        items: Sequence[CompletionTensors],
        advantages: torch.Tensor,
        indices: range,
        old: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
        sums: _MetricSums,
    ) -> float | None:
        """Accumulate the gradients of one minibatch and take an optimizer step; returns the grad norm."""
        masks = [items[i].loss_mask for i in indices]
        count = minibatch_count(masks, self.loss_config)
        self.optimizer.zero_grad(set_to_none=True)
        size = self.settings.micro_batch_size
        for start in range(indices.start, indices.stop, size):
            chunk = list(range(start, min(start + size, indices.stop)))
            if self._contributes_nothing(advantages[chunk], ref, [items[i] for i in chunk]):
                sums.skip([float(items[i].loss_mask.sum()) for i in chunk])
                continue
            loss, metrics = self._micro_batch_loss(items, chunk, advantages, old, ref, count)
            if count > 0 and loss.requires_grad:  # a micro-batch without trained tokens ran no model
                loss.backward()
            sums.add(metrics)
        if count == 0:
            return None
        for param in self.parameters:  # every micro-batch skipped: Adam still steps (its momentum moves weights)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        max_norm = self.settings.max_grad_norm if self.settings.max_grad_norm is not None else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.parameters, max_norm))
        if not math.isfinite(norm):  # a NaN/inf gradient would poison the weights: skip the update
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _micro_batch_loss(
        self, items: Sequence[CompletionTensors], chunk: list[int], advantages: torch.Tensor,
        old: list[torch.Tensor] | None, ref: list[torch.Tensor] | None, count: float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss (its share of the minibatch's, divided by `count`) and metrics."""
        chunk_items = [items[i] for i in chunk]
        entropy_mode = "grad" if self.loss_config.entropy_coef != 0.0 else "detached"
        ids, attention, mask, gen = self._batch(chunk_items)
        return micro_batch_loss(
            lambda topk_ids: self._token_logprobs(self.model, ids, attention, mask, entropy_mode, topk_ids),
            chunk_items, mask, gen, advantages[chunk], [old[i] for i in chunk] if old else None,
            [ref[i] for i in chunk] if ref else None, count, self.loss_config, self.distillation,
        )

    def _contributes_nothing(
        self, advantages: torch.Tensor, ref: list[torch.Tensor] | None, chunk: Sequence[CompletionTensors]
    ) -> bool:
        """A micro-batch whose every advantage is 0 adds exactly 0 to the gradient when the loss has no term
        without the advantage (no KL penalty, no teacher scores): its forward and backward are skipped
        (`trainer.skip_zero_advantage`), its tokens still count in the normalisation, so the update is bit for bit
        the one without skipping."""
        distilled = self.distillation is not None and any(x.teacher_mask is not None for x in chunk)
        return (self.settings.skip_zero_advantage and ref is None and self.loss_config.kl_coef == 0.0
                and self.loss_config.entropy_coef == 0.0 and not distilled
                and not bool(torch.any(advantages != 0)))

    def _token_logprobs(
        self, model: PreTrainedModel, ids: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor,
        entropy: str | None = None, topk_ids: torch.Tensor | None = None,
    ) -> Any:
        """[B, T] logprobs of a micro-batch on its loss mask (`_batch`'s right-padded tensors): each shared
        prompt computed once with `optimizer.share_prompt_prefix`, else a forward over every token; with
        `entropy` ("detached" or "grad") the pair (logprobs, entropies); with `topk_ids` the triple with the
        logprobs of those ids (`logprobs.token_logprobs`; a forward over every token)."""
        with self._compute():
            if self.settings.share_prompt_prefix and topk_ids is None:
                shared = shared_prefix_logprobs(model, ids, attention, self.temperature, score_mask=mask,
                                                entropy=entropy)
                if shared is not None:
                    return shared
            extra = {"topk_ids": topk_ids} if topk_ids is not None else {}
            return token_logprobs(model, ids, attention, self.temperature, score_mask=mask, entropy=entropy, **extra)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights to hand to the generation backend (`update_weights`), under the plain model's names;
        detached, not copied. A LoRA policy's target modules come merged (`lora.merged_state_dict`)."""
        if self.lora:
            return merged_state_dict(self.model)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def refit_weights(self) -> Mapping[str, torch.Tensor]:
        """What a refit hands the engine: `state_dict()`, or of a LoRA policy the merged target weights alone
        (the engine's embeddings, norms and untargeted layers are the base model's, which never change), each
        made as the engine reads it (`lora.streamed_merged_weights`)."""
        if self.lora:
            return streamed_merged_weights(self.model)
        return self.state_dict()

    def refit_metrics(self) -> dict[str, float]:
        """Metrics of the last `state_dict` hand-over: none here (the weights are not copied)."""
        return {}

    def close(self) -> None:
        """Nothing to release (the model is freed with this object)."""


def micro_batch_loss(
    forward: Callable[[torch.Tensor | None], Any],
    items: Sequence[CompletionTensors],
    mask: torch.Tensor,
    gen: torch.Tensor,
    advantages: torch.Tensor,
    old: list[torch.Tensor] | None,
    ref: list[torch.Tensor] | None,
    count: float,
    loss_config: ClippedPGLossConfig,
    distillation: DistillationLoss | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's loss and metrics, for both trainers: `forward(topk_ids)` is the policy's logprob pass over
    the micro-batch (the pair (logprobs, entropies); the triple with the top-k logprobs when `topk_ids` is given);
    with teacher scores and `distillation`, its per-token advantages and forward-KL term (`objectives.distillation`).
    `mask`, `gen`: the right-padded loss mask and engine logprobs on the device; `old`, `ref`: per-item logprobs."""
    device = mask.device
    teacher = teacher_batch(items, device) if distillation is not None else None
    topk_ids = teacher.topk_ids if teacher is not None and distillation.forward_weight else None
    out = forward(topk_ids)
    logprobs, entropy, student_topk = out if topk_ids is not None else (*out, None)
    old_lp = right_pad(old, 0.0, torch.float32).to(device) if old else logprobs.detach()
    ref_lp = right_pad(ref, 0.0, torch.float32).to(device) if ref else None
    adv = fit_to(advantages, mask).to(device)
    terms = None
    if teacher is not None:
        terms = distillation_terms(distillation, teacher, old_logprobs=old_lp, advantages=adv, mask=mask,
                                   student_topk_logprobs=student_topk, loss_config=loss_config, count=count,
                                   agents=[x.agent_name for x in items])
        adv = terms.advantages
    loss, metrics = clipped_pg_loss(
        logprobs, old_lp, adv, mask, loss_config, generation_logprobs=gen, reference_logprobs=ref_lp,
        global_normalization_count=count, entropy=entropy,
    )
    metrics["gen_kl/mean"] = _gen_kl(old_lp, gen, mask)
    if terms is not None:
        metrics.update(terms.metrics)
        if terms.extra_loss is not None:
            loss = loss + terms.extra_loss
            metrics["loss"] = float(loss.detach())
    return loss, metrics


@torch.no_grad()
def _gen_kl(trainer_lp: torch.Tensor, gen_lp: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 estimate of KL(engine || trainer) over the masked tokens: how far the two policies disagree."""
    valid = mask.bool()
    if not bool(valid.any()):
        return 0.0
    log_ratio = (trainer_lp.detach() - gen_lp)[valid]
    return float((torch.exp(log_ratio) - log_ratio - 1.0).mean())
