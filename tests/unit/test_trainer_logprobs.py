"""The trainer's logprobs run the LM head only where the loss mask reads them, and match the full-vocabulary
computation over every position (values and gradients), for single- and multi-turn items, left or right padded."""

from __future__ import annotations

import copy

import pytest
import torch

from nemo_rl_ext.algorithms import trainer as trainer_module
from nemo_rl_ext.algorithms.grpo_config import OptimizerSettings
from nemo_rl_ext.algorithms.loss import ClippedPGLossConfig, CompletionTensors
from nemo_rl_ext.algorithms.trainer import PolicyTrainer, token_logprobs


def full_vocab_logprobs(model, input_ids, attention_mask, temperature=1.0, score_mask=None):
    """The computation the trainer used before: LM head and log-softmax at every position."""
    temperature = temperature if temperature > 0 else 1.0
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    scaled = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = scaled.gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def spans(*parts: tuple[int, bool]) -> torch.Tensor:
    """A 0/1 mask from (length, trained) parts."""
    return torch.cat([torch.full((n,), 1.0 if on else 0.0) for n, on in parts])


def items_of(vocab: int, seed: int = 0) -> list[CompletionTensors]:
    """A single-turn item, a multi-turn item (prompt, assistant, tool result, assistant) and a short one."""
    g = torch.Generator().manual_seed(seed)
    masks = [
        spans((9, False), (7, True)),
        spans((6, False), (5, True), (8, False), (6, True)),  # two assistant spans
        spans((4, False), (3, True)),
    ]
    out = []
    for m in masks:
        ids = torch.randint(3, vocab, (m.numel(),), generator=g)
        gen = torch.where(m.bool(), -torch.rand(m.numel(), generator=g), torch.zeros(m.numel()))
        out.append(CompletionTensors(ids, m, gen))
    return out


def padded(items: list[CompletionTensors], left: bool) -> tuple[torch.Tensor, ...]:
    """(ids, attention, mask) padded with token 0 on the left or the right."""
    width = max(x.token_ids.numel() for x in items)
    ids = torch.zeros(len(items), width, dtype=torch.int64)
    attention = torch.zeros(len(items), width, dtype=torch.int64)
    mask = torch.zeros(len(items), width)
    for b, x in enumerate(items):
        n = x.token_ids.numel()
        cols = slice(width - n, width) if left else slice(0, n)
        ids[b, cols], attention[b, cols], mask[b, cols] = x.token_ids, 1, x.loss_mask
    return ids, attention, mask


def grads_of(model, lp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of a weighted sum of the masked logprobs (weights vary per token)."""
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1.0, 2.0, mask.numel()).reshape(mask.shape)
    (lp * mask * weights).sum().backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


class HeadRows:
    """Counts the rows the LM head computes (a forward hook on the output embeddings)."""

    def __init__(self, model) -> None:
        self.rows = 0
        self.handle = model.get_output_embeddings().register_forward_hook(self._count)

    def _count(self, module, args, output) -> None:
        self.rows += args[0].reshape(-1, args[0].shape[-1]).shape[0]

    def close(self) -> None:
        self.handle.remove()


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_masked_logprobs_and_gradients_equal_the_full_vocabulary_pass(tiny_model_and_tokenizer, left, temperature):
    base, tokenizer = tiny_model_and_tokenizer
    model = copy.deepcopy(base).train()
    ids, attention, mask = padded(items_of(len(tokenizer)), left)
    new = token_logprobs(model, ids, attention, temperature, score_mask=mask)
    new_grads = grads_of(model, new, mask)
    old = full_vocab_logprobs(model, ids, attention, temperature)
    old_grads = grads_of(model, old, mask)
    scored = mask.bool()
    assert int(scored.sum()) == 7 + 5 + 6 + 3
    torch.testing.assert_close(new[scored], old[scored], atol=1e-5, rtol=0)
    assert bool((new[~scored] == 0).all())  # nothing outside the loss mask is computed
    assert float(old[scored].detach().abs().min()) > 1e-3  # real logprobs, not zeros
    assert new_grads.keys() == old_grads.keys() and "model.embed_tokens.weight" in new_grads  # the (tied) head
    for key, g in old_grads.items():
        scale = float(g.abs().max())
        torch.testing.assert_close(new_grads[key], g, atol=1e-5 * max(scale, 1.0), rtol=0, msg=key)


def test_no_score_mask_scores_every_position(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    ids, attention, _ = padded(items_of(len(tokenizer), seed=1), left=False)
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(model, ids, attention, 0.0), full_vocab_logprobs(model, ids, attention), atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("left", [False, True], ids=["right-padded", "left-padded"])
def test_the_head_sees_only_the_scored_positions(tiny_model_and_tokenizer, left):
    model, tokenizer = tiny_model_and_tokenizer
    ids, attention, mask = padded(items_of(len(tokenizer)), left)
    seen: list[torch.Tensor] = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            token_logprobs(model, ids, attention, 1.0, score_mask=mask)
            hidden = model.get_decoder()(input_ids=ids, attention_mask=attention).last_hidden_state
            token_logprobs(model, ids, attention, 1.0, score_mask=torch.zeros_like(mask))  # nothing to score
    finally:
        handle.remove()
    rows = torch.cat([s.reshape(-1, s.shape[-1]) for s in seen])
    # the rows are the states just before each trained token, in order; nothing else reaches the head
    torch.testing.assert_close(rows, hidden[:, :-1][mask[:, 1:].bool()], atol=1e-6, rtol=0)
    assert rows.shape[0] == int(mask.sum()) < ids.shape[0] * (ids.shape[1] - 1)


def test_the_log_softmax_runs_in_chunks(tiny_model_and_tokenizer, monkeypatch):
    model, tokenizer = tiny_model_and_tokenizer
    ids, attention, mask = padded(items_of(len(tokenizer)), left=False)
    with torch.no_grad():
        whole = token_logprobs(model, ids, attention, 0.7, score_mask=mask)
        monkeypatch.setattr(trainer_module, "LOGSOFTMAX_CHUNK_ELEMENTS", 4 * len(tokenizer))  # 4 rows a chunk
        calls: list[int] = []
        handle = model.get_output_embeddings().register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
        try:
            chunked = token_logprobs(model, ids, attention, 0.7, score_mask=mask)
        finally:
            handle.remove()
    assert calls == [4] * 5 + [1]  # 21 scored rows
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)


def test_a_model_with_transformed_logits_takes_the_full_forward(tiny_model_and_tokenizer):
    base, tokenizer = tiny_model_and_tokenizer
    model = copy.deepcopy(base)
    model.config.final_logit_softcapping = 30.0  # as Gemma 2: logits are not just lm_head(hidden states)
    ids, attention, mask = padded(items_of(len(tokenizer)), left=False)
    counter = HeadRows(model)
    try:
        with torch.no_grad():
            lp = token_logprobs(model, ids, attention, 1.0, score_mask=mask)
    finally:
        counter.close()
    assert counter.rows == ids.numel()  # the model's own forward: every position
    with torch.no_grad():
        torch.testing.assert_close(lp[mask.bool()], full_vocab_logprobs(model, ids, attention)[mask.bool()],
                                   atol=1e-5, rtol=0)


def _update(model, items, advantages, loss, reference, micro, minibatches) -> dict[str, torch.Tensor]:
    trainer = PolicyTrainer(
        model,
        optimizer=OptimizerSettings(micro_batch_size=micro, minibatches_per_step=minibatches, max_grad_norm=None),
        loss=loss,
        temperature=0.8,
        reference_model=reference,
    )
    start = {k: v.clone() for k, v in trainer.state_dict().items()}
    trainer.optimizer = torch.optim.SGD(trainer.parameters, lr=1.0)  # weight change = -gradient
    counter = HeadRows(model)
    try:
        metrics = trainer.train_step(items, advantages)
    finally:
        counter.close()
    update = {k: start[k] - v for k, v in trainer.state_dict().items()}
    return {"update": update, "metrics": metrics, "rows": counter.rows}


@pytest.mark.parametrize(
    ("micro", "minibatches", "kl_coef"),
    [(2, 1, 0.0), (1, 2, 0.1), (4, 1, 0.1)],
    ids=["micro2", "two-minibatches-kl", "one-micro-kl"],
)
def test_train_step_equals_the_full_vocabulary_trainer(tiny_model_and_tokenizer, monkeypatch, micro, minibatches,
                                                       kl_coef):
    base, tokenizer = tiny_model_and_tokenizer
    items = items_of(len(tokenizer))
    failed = CompletionTensors(items[0].token_ids, torch.zeros_like(items[0].loss_mask), items[0].generation_logprobs)
    items = [*items, failed]  # a rollout without trained tokens: its micro-batch runs no model
    advantages = torch.tensor([1.0, -0.5, 2.0, 0.0])
    loss = ClippedPGLossConfig(kl_coef=kl_coef)  # with the importance-sampling correction
    runs = []
    for logprobs_fn in (token_logprobs, full_vocab_logprobs):
        monkeypatch.setattr(trainer_module, "token_logprobs", logprobs_fn)
        reference = copy.deepcopy(base) if kl_coef else None
        runs.append(_update(copy.deepcopy(base), items, advantages, loss, reference, micro, minibatches))
    new, old = runs
    trained = sum(int(x.loss_mask.sum()) for x in items)
    passes = 2 if minibatches > 1 else 1  # the minibatches cover the items once; several add an old-policy pass
    assert new["rows"] == trained * passes < old["rows"]  # the reference model has its own head
    for key in ("loss", "loss/pg", "loss/kl", "grad_norm", "importance_ratio/mean", "kl/mean", "gen_kl/mean"):
        if key in old["metrics"]:
            assert new["metrics"][key] == pytest.approx(old["metrics"][key], rel=1e-4, abs=1e-6), key
    assert new["metrics"]["num_tokens"] == old["metrics"]["num_tokens"] == trained
    scale = max(float(g.abs().max()) for g in old["update"].values())
    assert scale > 1e-3
    for key, g in old["update"].items():
        torch.testing.assert_close(new["update"][key], g, atol=1e-5 * scale, rtol=0, msg=key)
