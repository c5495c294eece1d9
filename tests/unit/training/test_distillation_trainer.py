"""PolicyTrainer with on-policy distillation on the tiny model: a student equal to its teacher gets advantage 0 on
every token and does not move; a teacher that likes the sampled tokens more pulls them up; the forward KL over the
teacher's top-k is the one an independent forward pass gives, and training on it lowers it."""

from __future__ import annotations

import copy
import dataclasses

import torch
from test_grpo_trainer import sample
from tolerances import SAME_MODEL_LOGPROBS

from nemo_rl_ext.objectives.distillation import DistillationLoss, topk_forward_kl
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, CompletionTensors
from nemo_rl_ext.training.config import OptimizerSettings
from nemo_rl_ext.training.trainer import PolicyTrainer


def _trainer(model, distillation: DistillationLoss, lr: float = 1e-3) -> PolicyTrainer:
    # weight_decay 0: AdamW's decay would move the weights without any gradient
    return PolicyTrainer(model, optimizer=OptimizerSettings(lr=lr, weight_decay=0.0, micro_batch_size=2),
                         loss=ClippedPGLossConfig(kl_coef=0.0), temperature=1.0, pad_token_id=0,
                         distillation=distillation)


def _with_teacher(items, teacher_lp, topk=None) -> list[CompletionTensors]:
    out = []
    for b, x in enumerate(items):
        extra = {}
        if topk is not None:
            extra = dict(teacher_topk_ids=topk[0][b], teacher_topk_logprobs=topk[1][b])
        out.append(dataclasses.replace(x, teacher_logprobs=teacher_lp[b], teacher_mask=x.loss_mask.clone(),
                                       agent_name="yes" if b % 2 else "no", **extra))
    return out


def test_a_student_equal_to_its_teacher_gets_zero_advantages_and_does_not_move(tiny_model_and_tokenizer):
    """The teacher's logprobs are the same model's, from the trainer's own logprob pass over the same micro-batches:
    the same kernels on the same shapes as the update's forward, so s - q is exactly 0 on every token, the
    gradient is exactly 0, and Adam (weight decay 0) moves nothing: torch.equal holds by construction."""
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = _trainer(copy.deepcopy(model), DistillationLoss("reverse", reward_weight=0.0))
    teacher_lp = trainer.logprobs(items)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_step(_with_teacher(items, teacher_lp), torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert metrics["distill/reverse_kl"] == 0.0 and metrics["distill/reverse_kl/yes"] == 0.0
    assert metrics["optimizer_steps"] == 1.0 and metrics["grad_norm"] == 0.0
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_grpo_advantage_alone_moves_the_same_student_when_reward_weight_is_set(tiny_model_and_tokenizer):
    """The control of the test above: the same items with reward_weight 1 do move the weights (so the zero update
    there came from the zero distillation advantage, not from a step that was never taken)."""
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = _trainer(copy.deepcopy(model), DistillationLoss("reverse", reward_weight=1.0))
    teacher_lp = trainer.logprobs(items)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.train_step(_with_teacher(items, teacher_lp), torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_a_teacher_that_prefers_the_sampled_tokens_pulls_them_up(tiny_model_and_tokenizer):
    """q = s + 1 on every sampled token: the reverse advantage is +1 everywhere, so the step raises the student's
    logprob of the sampled tokens (their sum over the batch), with a zero GRPO advantage."""
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    trainer = _trainer(copy.deepcopy(model), DistillationLoss("reverse"), lr=1e-2)
    start = trainer.logprobs(items)
    metrics = trainer.train_step(_with_teacher(items, [lp + x.loss_mask for lp, x in zip(start, items, strict=True)]),
                                 torch.zeros(4))
    assert abs(metrics["distill/reverse_kl"] + 1.0) < 1e-6  # s - q = -1 on every trained token
    end = trainer.logprobs(items)
    gain = sum(float(((e - s) * x.loss_mask).sum()) for s, e, x in zip(start, end, items, strict=True))
    assert gain > 0.5  # a step of lr 1e-2 on every weight: far above rounding (1e-5 of ~100 summed logprobs)


def _top_k(model, items, k: int):
    """The model's own top-k ids and logprobs at every token (full-vocabulary log-softmax), as a teacher's."""
    ids_out, lp_out = [], []
    with torch.no_grad():
        for x in items:
            logits = model(input_ids=x.token_ids[None]).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            shifted = torch.cat([torch.zeros(1, lp.shape[-1]), lp[:-1]])  # position t: the distribution of token t
            top = shifted.topk(k, dim=-1)
            ids_out.append(top.indices)
            lp_out.append(top.values)
    return ids_out, lp_out


def test_forward_kl_equals_an_independent_forward_and_training_on_it_lowers_it(tiny_model_and_tokenizer):
    """Teacher: a perturbed copy of the model (its top-4 at every token). The trainer's distill/forward_kl (mean
    over trained tokens) equals the value computed from a plain forward of the student; after some forward-only
    steps the forward KL is lower."""
    model, tokenizer = tiny_model_and_tokenizer
    items = sample(model, tokenizer, 1.0, n=4)
    teacher = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        head = teacher.get_output_embeddings().weight
        head.add_(0.5 * torch.randn_like(head))
    topk = _top_k(teacher, items, 4)
    trainer = _trainer(copy.deepcopy(model), DistillationLoss("forward", reward_weight=0.0), lr=3e-3)
    distilled = _with_teacher(items, trainer.logprobs(items), topk)

    def forward_kl(m) -> float:
        total, n = 0.0, 0.0
        with torch.no_grad():
            for x, ids, tlp in zip(items, *topk, strict=True):
                lp = torch.log_softmax(m(input_ids=x.token_ids[None]).logits[0].float(), dim=-1)
                shifted = torch.cat([torch.zeros(1, lp.shape[-1]), lp[:-1]])
                fkl = topk_forward_kl(shifted.gather(-1, ids), tlp)
                total += float((fkl * x.loss_mask).sum())
                n += float(x.loss_mask.sum())
        return total / n

    expected = forward_kl(trainer.model)
    metrics = trainer.train_step(distilled, torch.zeros(4))
    tol = SAME_MODEL_LOGPROBS
    assert abs(metrics["distill/forward_kl"] - expected) <= tol["atol"] + tol["rtol"] * abs(expected)
    assert expected > 0.05  # the perturbed teacher disagrees
    for _ in range(4):
        trainer.train_step(distilled, torch.zeros(4))
    assert forward_kl(trainer.model) < 0.8 * expected
