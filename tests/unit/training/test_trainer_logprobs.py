"""The trainer's logprobs run the LM head only where the loss mask reads them, and match the full-vocabulary
computation over every position (values and gradients), for single- and multi-turn items, left or right padded.
Samples that share a prompt run the decoder over it once (`shared_prefix_logprobs`), with the same values and
gradients as a forward over every full sequence."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerances import GRADIENT_OF_LARGEST, SAME_MODEL_LOGPROBS

from nemo_rl_ext.objectives import logprobs as logprobs_module
from nemo_rl_ext.objectives.logprobs import shared_prefix_logprobs, token_logprobs
from nemo_rl_ext.objectives.loss import ClippedPGLossConfig, CompletionTensors
from nemo_rl_ext.training import trainer as trainer_module
from nemo_rl_ext.training.config import OptimizerSettings
from nemo_rl_ext.training.trainer import PolicyTrainer


def full_vocab_logprobs(model, input_ids, attention_mask, temperature=1.0, score_mask=None, entropy=None):
    """The computation the trainer used before: LM head and log-softmax at every position (and with `entropy`,
    -sum p log p of the whole [B, T, vocabulary] at once, with its gradient)."""
    temperature = temperature if temperature > 0 else 1.0
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    scaled = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = scaled.gather(-1, input_ids[:, 1:, None])[..., 0]
    out = torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)
    if entropy is None:
        return out
    h = -(scaled.exp() * scaled).sum(dim=-1)
    h = h if entropy == "grad" else h.detach()
    keep = score_mask[:, 1:] != 0 if score_mask is not None else torch.ones_like(h, dtype=torch.bool)
    return out, torch.cat([torch.zeros_like(h[:, :1]), torch.where(keep, h, torch.zeros_like(h))], dim=1)


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


class DecoderTokens:
    """Counts the token positions (padding included) the decoder embeds (a forward hook on the input embeddings)."""

    def __init__(self, model) -> None:
        self.count = 0
        self.handle = model.get_input_embeddings().register_forward_hook(self._count)

    def _count(self, module, args, output) -> None:
        self.count += args[0].numel()

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
    torch.testing.assert_close(new[scored], old[scored], **SAME_MODEL_LOGPROBS)
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
            token_logprobs(model, ids, attention, 0.0), full_vocab_logprobs(model, ids, attention), **SAME_MODEL_LOGPROBS
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
    torch.testing.assert_close(rows, hidden[:, :-1][mask[:, 1:].bool()], **SAME_MODEL_LOGPROBS)
    assert rows.shape[0] == int(mask.sum()) < ids.shape[0] * (ids.shape[1] - 1)


def test_the_log_softmax_runs_in_chunks(tiny_model_and_tokenizer, monkeypatch):
    model, tokenizer = tiny_model_and_tokenizer
    ids, attention, mask = padded(items_of(len(tokenizer)), left=False)
    with torch.no_grad():
        whole = token_logprobs(model, ids, attention, 0.7, score_mask=mask)
        monkeypatch.setattr(logprobs_module, "LOGSOFTMAX_CHUNK_ELEMENTS", 4 * len(tokenizer))  # 4 rows a chunk
        calls: list[int] = []
        handle = model.get_output_embeddings().register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
        try:
            chunked = token_logprobs(model, ids, attention, 0.7, score_mask=mask)
        finally:
            handle.remove()
    assert calls == [4] * 5 + [1]  # 21 scored rows
    torch.testing.assert_close(chunked, whole, **SAME_MODEL_LOGPROBS)  # other GEMM shapes: 4 ulps apart at -20 seen


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
                                   **SAME_MODEL_LOGPROBS)


def _update(model, items, advantages, loss, reference, micro, minibatches, share=True) -> dict[str, torch.Tensor]:
    trainer = PolicyTrainer(
        model,
        optimizer=OptimizerSettings(micro_batch_size=micro, minibatches_per_step=minibatches, max_grad_norm=None,
                                    share_prompt_prefix=share),
        loss=loss,
        temperature=0.8,
        reference_model=reference,
    )
    start = {k: v.clone() for k, v in trainer.state_dict().items()}
    trainer.optimizer = torch.optim.SGD(trainer.parameters, lr=1.0)  # weight change = -gradient
    counter, tokens = HeadRows(model), DecoderTokens(model)
    try:
        metrics = trainer.train_step(items, advantages)
    finally:
        counter.close()
        tokens.close()
    update = {k: start[k] - v for k, v in trainer.state_dict().items()}
    return {"update": update, "metrics": metrics, "rows": counter.rows, "tokens": tokens.count}


@pytest.mark.parametrize(
    ("micro", "minibatches", "kl_coef", "entropy_coef"),
    [(2, 1, 0.0, 0.0), (1, 2, 0.1, 0.0), (4, 1, 0.1, 0.0), (2, 1, 0.0, 0.5)],
    ids=["micro2", "two-minibatches-kl", "one-micro-kl", "micro2-entropy"],
)
def test_train_step_equals_the_full_vocabulary_trainer(tiny_model_and_tokenizer, monkeypatch, micro, minibatches,
                                                       kl_coef, entropy_coef):
    base, tokenizer = tiny_model_and_tokenizer
    items = items_of(len(tokenizer))
    failed = CompletionTensors(items[0].token_ids, torch.zeros_like(items[0].loss_mask), items[0].generation_logprobs)
    items = [*items, failed]  # a rollout without trained tokens: its micro-batch runs no model
    advantages = torch.tensor([1.0, -0.5, 2.0, 0.0])
    loss = ClippedPGLossConfig(kl_coef=kl_coef, importance_sampling_correction=True, importance_sampling_cap=2.0,
                               entropy_coef=entropy_coef)
    runs = []
    # the chunked side in chunks of 3 rows (the tiny vocabulary would fit one chunk): the entropy, its gradient
    # and the logprobs chunk by chunk against the whole [B, T, vocabulary] at once
    monkeypatch.setattr(logprobs_module, "LOGSOFTMAX_CHUNK_ELEMENTS", 3 * base.get_output_embeddings().out_features)
    for logprobs_fn in (token_logprobs, full_vocab_logprobs):
        monkeypatch.setattr(trainer_module, "token_logprobs", logprobs_fn)
        reference = copy.deepcopy(base) if kl_coef else None
        runs.append(_update(copy.deepcopy(base), items, advantages, loss, reference, micro, minibatches))
    new, old = runs
    trained = sum(int(x.loss_mask.sum()) for x in items)
    passes = 2 if minibatches > 1 else 1  # the minibatches cover the items once; several add an old-policy pass
    assert new["rows"] == trained * passes < old["rows"]  # the reference model has its own head
    assert new["metrics"]["entropy"] > 0.1  # reported at entropy_coef 0 too
    assert (new["metrics"]["loss/entropy"] < 0) == (entropy_coef > 0)
    for key in ("loss", "loss/pg", "loss/kl", "loss/entropy", "grad_norm", "importance_ratio/mean", "kl/mean",
                "gen_kl/mean", "entropy"):
        if key in old["metrics"]:
            assert new["metrics"][key] == pytest.approx(old["metrics"][key], rel=1e-4, abs=1e-6), key
    assert new["metrics"]["num_tokens"] == old["metrics"]["num_tokens"] == trained
    scale = max(float(g.abs().max()) for g in old["update"].values())
    assert scale > 1e-3
    # fp32 rounding: with two SGD steps of lr 1 the second gradient is taken at weights that already differ by
    # rounding. The tied embedding's update differed by 1.9e-5 of the largest update in a standalone run with one
    # torch thread and by 3.4e-6 with two; 1e-5 failed in the whole unit suite (after test_bench_async_grpo)
    tolerance = GRADIENT_OF_LARGEST
    for key, g in old["update"].items():
        torch.testing.assert_close(new["update"][key], g, atol=tolerance * scale, rtol=0, msg=key)


# ---- shared prompts --------------------------------------------------------------------------------------


def tiny_llama(vocab: int) -> torch.nn.Module:
    """A random-init Llama (SmolLM2's architecture) of the tiny model's vocabulary, tied embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).float()


def grouped_items(vocab: int, seed: int = 0) -> list[CompletionTensors]:
    """Three groups of samples whose prompts differ in length (9, 4 and 13 tokens); the second group's samples
    are multi-turn (assistant, tool result, assistant); plus a lone sample with its own prompt and a failed
    rollout (nothing trained) that repeats the first prompt."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> torch.Tensor:
        return torch.randint(3, vocab, (n,), generator=g)

    def item(prompt: torch.Tensor, parts: list[tuple[int, bool]]) -> CompletionTensors:
        mask = torch.cat([torch.zeros(prompt.numel()), spans(*parts)])
        ids = torch.cat([prompt, rand(int(mask.numel()) - prompt.numel())])
        gen = torch.where(mask.bool(), -torch.rand(mask.numel(), generator=g), torch.zeros(mask.numel()))
        return CompletionTensors(ids, mask, gen)

    first, second, third, lone = rand(9), rand(4), rand(13), rand(6)
    out = [item(first, [(n, True)]) for n in (5, 8, 3)]
    out += [item(second, [(a, True), (4, False), (b, True)]) for a, b in ((3, 2), (6, 1))]
    out += [item(third, [(n, True)]) for n in (2, 7, 7, 4)]
    out.append(item(lone, [(5, True)]))
    failed = item(first, [(6, True)])
    out.append(CompletionTensors(failed.token_ids, torch.zeros_like(failed.loss_mask), failed.generation_logprobs))
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_shared_prompts_give_the_full_forwards_logprobs_and_gradients(tiny_model_and_tokenizer, arch, temperature):
    base, tokenizer = tiny_model_and_tokenizer
    model = (copy.deepcopy(base) if arch == "qwen2" else tiny_llama(len(tokenizer))).train()
    items = grouped_items(len(tokenizer))
    ids, attention, mask = padded(items, left=False)
    tokens, head = DecoderTokens(model), HeadRows(model)
    try:
        shared = shared_prefix_logprobs(model, ids, attention, temperature, score_mask=mask)
    finally:
        tokens.close()
        head.close()
    shared_grads = grads_of(model, shared, mask)
    full = token_logprobs(model, ids, attention, temperature, score_mask=mask)
    full_grads = grads_of(model, full, mask)
    scored = mask.bool()
    assert shared.shape == full.shape and int(scored.sum()) == 16 + 12 + 20 + 5
    torch.testing.assert_close(shared[scored], full[scored], **SAME_MODEL_LOGPROBS)
    assert bool((shared[~scored] == 0).all())
    assert float(full[scored].detach().abs().min()) > 1e-3  # real logprobs, not zeros
    assert shared_grads.keys() == full_grads.keys()
    for key, g in full_grads.items():
        scale = float(g.abs().max())
        assert scale > 0, key
        torch.testing.assert_close(shared_grads[key], g, atol=GRADIENT_OF_LARGEST * scale, rtol=0, msg=key)
    # the decoder ran over the 4 distinct prompts once (padded to 13), then over each trained sample's rest
    # (padded to the longest rest, 3 + 4 + 4 = 11 tokens); the failed rollout did not run
    assert tokens.count == 4 * 13 + 10 * 11 < ids.numel()
    assert head.rows == int(scored.sum())  # the head sees only the scored positions


def test_nothing_shared_means_nothing_to_save(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    items = items_of(len(tokenizer))  # three different prompts
    with torch.no_grad():
        ids, attention, mask = padded(items, left=False)
        assert shared_prefix_logprobs(model, ids, attention, score_mask=mask) is None
        assert shared_prefix_logprobs(model, ids, attention) is None  # no score mask: every position, no prefix


def test_a_train_step_on_groups_shares_their_prompts_with_the_same_update(tiny_model_and_tokenizer):
    base, tokenizer = tiny_model_and_tokenizer
    items = grouped_items(len(tokenizer), seed=3)
    advantages = torch.linspace(-1.0, 1.5, len(items))
    loss = ClippedPGLossConfig(kl_coef=0.1, importance_sampling_correction=True, importance_sampling_cap=2.0)
    runs = [
        _update(copy.deepcopy(base), items, advantages, loss, copy.deepcopy(base), micro=6, minibatches=1, share=share)
        for share in (True, False)
    ]
    shared, full = runs
    assert shared["tokens"] < full["tokens"]  # the policy pass shares the prompts (the reference has its own hook)
    assert shared["rows"] == full["rows"]  # the head still sees exactly the trained positions
    for key in ("loss", "loss/pg", "grad_norm", "importance_ratio/mean", "num_tokens"):
        assert shared["metrics"][key] == pytest.approx(full["metrics"][key], rel=1e-4, abs=1e-6), key
    scale = max(float(g.abs().max()) for g in full["update"].values())
    assert scale > 1e-3
    # the decoder's sums run in another order (other matmul shapes): equal to fp32 rounding, 1e-4 of the largest
    for key, g in full["update"].items():
        torch.testing.assert_close(shared["update"][key], g, atol=GRADIENT_OF_LARGEST * scale, rtol=0, msg=key)


def test_the_no_grad_passes_share_prompts_too(tiny_model_and_tokenizer):
    """The old-policy pass (several minibatches) and the reference pass go through `_frozen_logprobs`."""
    model, tokenizer = tiny_model_and_tokenizer
    items = grouped_items(len(tokenizer), seed=4)
    passes = []
    for share in (True, False):
        trainer = PolicyTrainer(copy.deepcopy(model), optimizer=OptimizerSettings(micro_batch_size=6,
                                share_prompt_prefix=share), loss=ClippedPGLossConfig(kl_coef=0.0), temperature=0.8)
        tokens = DecoderTokens(trainer.model)
        try:
            passes.append((trainer.logprobs(items), tokens.count))
        finally:
            tokens.close()
    (shared, shared_tokens), (full, full_tokens) = passes
    assert shared_tokens < full_tokens
    for x, a, b in zip(items, shared, full, strict=True):
        assert a.shape == b.shape == x.token_ids.shape
        torch.testing.assert_close(a, b, **SAME_MODEL_LOGPROBS)
        assert bool((a[x.loss_mask == 0] == 0).all())
