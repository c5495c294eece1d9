"""The vLLM backend's pure parts, without vLLM: finish-reason mapping, weight packing, config.

These run everywhere (CI included); the engine itself is tested in test_vllm_backend.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rl_ext.config import ConfigError, load_config
from nemo_rl_ext.models.config import PolicyConfig
from nemo_rl_ext.models.generation import FinishReason, GenerationConfig
from nemo_rl_ext.models.generation.vllm_backend import to_generation_output, weight_version_of
from nemo_rl_ext.models.generation.vllm_worker import pack_state_dict, unpack_state_dict

EOS = 2
CFG = GenerationConfig(max_new_tokens=4, stop_token_ids=(7,), stop_strings=("ab",))


def completion(ids, finish_reason, stop_reason=None):
    """A stand-in for vLLM's CompletionOutput with `logprobs=0` (one {token: Logprob} dict per token)."""
    steps = [{t: SimpleNamespace(logprob=-0.5 - i, rank=1)} for i, t in enumerate(ids)]
    return SimpleNamespace(
        token_ids=list(ids), logprobs=steps, finish_reason=finish_reason, stop_reason=stop_reason
    )


@pytest.mark.parametrize(
    ("ids", "reason", "stop", "budget", "budget_reason", "expected", "matched"),
    [
        ((5, 6, 9, 9), "length", None, 4, FinishReason.MAX_NEW_TOKENS, FinishReason.MAX_NEW_TOKENS, None),
        ((5, 6), "length", None, 2, FinishReason.MAX_MODEL_LEN, FinishReason.MAX_MODEL_LEN, None),
        ((5, EOS), "stop", None, 4, FinishReason.MAX_NEW_TOKENS, FinishReason.EOS, EOS),
        ((5, 7), "stop", 7, 4, FinishReason.MAX_NEW_TOKENS, FinishReason.STOP_TOKEN, 7),
        ((5, 11), "stop", 11, 4, FinishReason.MAX_NEW_TOKENS, FinishReason.EOS, 11),  # generation-config EOS
        ((5, 6), "stop", "ab", 4, FinishReason.MAX_NEW_TOKENS, FinishReason.STOP_STRING, "ab"),
        ((5, EOS), "stop", "ab", 4, FinishReason.MAX_NEW_TOKENS, FinishReason.EOS, EOS),  # EOS before string
        ((5, 7), "stop", "ab", 4, FinishReason.MAX_NEW_TOKENS, FinishReason.STOP_TOKEN, 7),  # token first
    ],
)
def test_finish_reasons_follow_the_hf_backend(ids, reason, stop, budget, budget_reason, expected, matched):
    out = to_generation_output(
        completion(ids, reason, stop), CFG, budget, budget_reason, frozenset({EOS, 11})
    )
    assert out.output_ids == ids  # the stopping token stays in the output
    assert out.logprobs == tuple(-0.5 - i for i in range(len(ids)))
    assert out.finish_reason is expected and out.matched_stop == matched
    assert out.truncated == expected.truncated


@pytest.mark.parametrize(("reason", "ids"), [("abort", (5,)), ("error", ()), ("repetition", (5, 5))])
def test_engine_side_endings_raise(reason, ids):
    with pytest.raises(RuntimeError, match=f"finish_reason='{reason}'"):
        to_generation_output(completion(ids, reason), CFG, 4, FinishReason.MAX_NEW_TOKENS, frozenset({EOS}))


def test_an_abort_by_a_weight_update_keeps_the_partial_output_with_its_version():
    out = to_generation_output(
        completion((5, 6, 9), "abort"),
        CFG,
        4,
        FinishReason.MAX_NEW_TOKENS,
        frozenset({EOS}),
        weight_version=3,
        aborted_by_update=True,
    )
    assert out.finish_reason is FinishReason.ABORTED and not out.truncated
    assert out.output_ids == (5, 6, 9) and out.logprobs == (-0.5, -1.5, -2.5)
    assert out.weight_version == 3 and out.matched_stop is None


@pytest.mark.parametrize(
    ("ids", "reason", "stop"), [((5, 6, 9, 9), "length", None), ((5, EOS), "stop", None), ((5, 7), "stop", 7)]
)
def test_every_finished_output_carries_its_weight_version(ids, reason, stop):
    out = to_generation_output(
        completion(ids, reason, stop), CFG, 4, FinishReason.MAX_NEW_TOKENS, frozenset({EOS}), weight_version=2
    )
    assert out.weight_version == 2


def span(version, start, end):
    return SimpleNamespace(version=version, start=start, end=end)


def test_the_weight_version_is_read_from_vllms_spans():
    assert weight_version_of(SimpleNamespace(token_ids=[5, 6], weight_versions=[span("4", 0, 2)])) == 4
    with pytest.raises(RuntimeError, match=r"weight versions \['1', '2'\] for 3 tokens"):
        weight_version_of(SimpleNamespace(token_ids=[5, 6, 7], weight_versions=[span("1", 0, 1), span("2", 1, 3)]))
    with pytest.raises(RuntimeError, match=r"weight versions \[\] for 2 tokens"):
        weight_version_of(SimpleNamespace(token_ids=[5, 6], weight_versions=None))  # no label reported


def test_a_length_stop_short_of_the_budget_is_an_error():
    with pytest.raises(RuntimeError, match="after 2 tokens; max_tokens was 4"):
        to_generation_output(completion((5, 6), "length"), CFG, 4, FinishReason.MAX_NEW_TOKENS, frozenset())


def test_state_dict_packing_round_trips_with_shared_tensors():
    embed = torch.randn(10, 4)
    state = {
        "embed.weight": embed,
        "lm_head.weight": embed,
        "norm.weight": torch.ones(4, dtype=torch.bfloat16),
    }
    back = unpack_state_dict(pack_state_dict(state))
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)  # bytes copied: bit-exact


def test_vllm_knobs_live_under_policy_vllm(tmp_path):
    cfg = load_config(
        None,
        [
            "backend=vllm",
            "vllm.gpu_memory_utilization=0.5",
            "vllm.tensor_parallel_size=2",
            "vllm.enforce_eager=true",
        ],
        PolicyConfig,
    )
    assert cfg.backend == "vllm" and cfg.max_model_len == 1024
    assert (cfg.vllm.gpu_memory_utilization, cfg.vllm.tensor_parallel_size, cfg.vllm.enforce_eager) == (
        0.5,
        2,
        True,
    )
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            ["vllm.gpu_memory_utilization=1.5", "vllm.tensor_parallel_size=0", "vllm.typo=1"],
            PolicyConfig,
        )
    message = str(err.value)
    assert "3 problem(s)" in message
    assert (
        "vllm.gpu_memory_utilization" in message
        and "vllm.tensor_parallel_size" in message
        and "vllm.typo" in message
    )


def _lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_top_and_prompt_logprobs_are_read_from_vllms_dicts(stand_in_vllm):
    """vLLM's shapes (logprobs=2, prompt_logprobs=1): a sampled token outside the top 2 is left out of the
    alternatives, but keeps its own logprob; the first prompt token has no entry."""
    from nemo_rl_ext.models.generation.vllm_logprobs import with_extra_logprobs

    config = GenerationConfig(max_new_tokens=2, top_logprobs=2, prompt_logprobs=1)
    steps = [
        {5: _lp(-0.1, 1), 8: _lp(-2.0, 2)},  # sampled the best token: k entries
        {EOS: _lp(-3.0, 4), 6: _lp(-0.2, 1), 9: _lp(-1.5, 2)},  # sampled the 4th: k + 1 entries, sampled first
    ]
    completion = SimpleNamespace(token_ids=[5, EOS], logprobs=steps, finish_reason="stop", stop_reason=None)
    out = to_generation_output(completion, config, 2, FinishReason.MAX_NEW_TOKENS, frozenset({EOS}))
    prompt = [11, 12, 13]
    prompt_steps = [None, {12: _lp(-4.0, 7), 40: _lp(-0.3, 1)}, {13: _lp(-0.6, 1)}]
    out = with_extra_logprobs(out, completion, config, prompt, prompt_steps)
    assert out.logprobs == (-0.1, -3.0)
    assert out.top_logprobs == (((5, -0.1), (8, -2.0)), ((6, -0.2), (9, -1.5)))
    assert out.prompt_logprobs == (-4.0, -0.6)
    assert out.prompt_top_logprobs == (((40, -0.3),), ((13, -0.6),))
    with pytest.raises(RuntimeError, match="1 prompt logprob entries for 2 positions"):
        with_extra_logprobs(out, completion, config, prompt, prompt_steps[:2])
    # nothing asked: the output as it was, and the request asks vLLM for the sampled token only
    plain = GenerationConfig(max_new_tokens=2)
    assert with_extra_logprobs(out, completion, plain, prompt, None) is out
    _, gen = stand_in_vllm
    assert (gen.sampling_params(plain, 2)["logprobs"], gen.sampling_params(plain, 2)["prompt_logprobs"]) == (0, None)
    assert (gen.sampling_params(config, 2)["logprobs"], gen.sampling_params(config, 2)["prompt_logprobs"]) == (2, 1)


def test_a_streams_new_tokens_carry_their_top_alternatives_when_asked():
    from nemo_rl_ext.models.generation.vllm_logprobs import send_new_tokens

    steps = [{5: _lp(-0.1, 1), 8: _lp(-2.0, 2)}, {9: _lp(-3.0, 3), 6: _lp(-0.2, 1), 7: _lp(-1.5, 2)}]
    sent = []
    cumulative = SimpleNamespace(token_ids=[5, 9], logprobs=steps)
    assert send_new_tokens(SimpleNamespace(token_ids=[5], logprobs=steps[:1]), 0, lambda *a: sent.append(a), 2) == 1
    assert send_new_tokens(cumulative, 1, lambda *a: sent.append(a), 2) == 2
    assert sent == [([5], [-0.1], [((5, -0.1), (8, -2.0))]), ([9], [-3.0], [((6, -0.2), (7, -1.5))])]
    assert send_new_tokens(cumulative, 0, lambda *a: sent.append(a)) == 2 and sent[-1] == ([5, 9], [-0.1, -3.0], None)
