"""A tiny random-init Qwen2-style causal LM with a trained byte-level BPE tokenizer, built offline.

`build_tiny_model` writes a transformers folder (model + tokenizer + generation config) in well under a
second, so tests and examples never need a model hub. The weights are random: the model is only good for
exercising code paths (shapes, token ids, logprobs, batching), never for answers.

Tokenizer pitfall: `AutoTokenizer` reloads a `qwen2`-typed folder as `Qwen2Tokenizer`, which
rebuilds the pipeline from vocab + merges with Qwen2's normalizer and pre-tokenizer. We therefore train with
exactly that pipeline (NFC, Qwen2 split regex, `ByteLevel(use_regex=False)`) so ids survive the round trip.
"""

from __future__ import annotations

import argparse
import json
import operator
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT_REGEX

from nemo_rl_ext.models.loading import load_model_and_tokenizer

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)


# ChatML, generic over roles. Assistant `tool_calls` (OpenAI or HF style) render as Hermes/Qwen-style
# `<tool_call>{"name": ..., "arguments": ...}</tool_call>` after the content. With `tools`, a first system
# block (Qwen2.5 style) holds the system message's content, then the tools' JSON schemas inside
# `<tools></tools>` and how to call them; without `tools` the output is plain ChatML.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
"""Start of the tools section of the system block; each tool's JSON follows on its own line."""
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>{"name": <function-name>, "arguments": <args-json-object>}'
    "</tool_call>"
)
"""End of the tools section of the system block."""


def _jinja_literal(text: str) -> str:
    """`text` as a single-quoted Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


CHAT_TEMPLATE = (
    "{%- set loop_messages = messages -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string and messages[0]['content'] -%}"
    "{{ messages[0]['content'] + '\\n\\n' }}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- endif -%}"
    "{{ " + _jinja_literal(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ " + _jinja_literal(TOOLS_POSTAMBLE + IM_END + "\n") + " }}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{ '<tool_call>{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{{- fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson) -}}"
    "{{ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_WORDS = (
    "the a an is are was be to of and in that it for on with as at by from this not or but what which who "
    "how why when where all there their one two three four five six seven eight nine ten zero hundred "
    "answer question compute calculate result number sum product difference total value equals plus minus "
    "times divided step think let us first then so therefore final correct wrong yes no please thank you "
    "hello hi world model assistant user system tool call calculator expression name arguments function "
    "weather search query city today tomorrow temperature json error ok true false null none return "
    "apple banana orange book car house tree water fire river mountain cat dog bird fish time day year "
    "good bad big small new old long short fast slow hot cold happy sad red blue green black white "
    "helpful harmless honest you are I we they he she can will would should could must have has had do "
    "does did make take give get go come see know want need use find tell ask work try leave feel "
    "über café naïve résumé 数学 答案 問題 привет мир γεια κόσμε"
).split()
_SYLLABLES = "ka ri to ne mo shi la pe vu zo gra tal bon mir dex qua fen lor sip tun wex yal".split()
_TOOL_NAMES = ("calculator", "get_weather", "search", "lookup", "python")
_ROLES = ("system", "user", "assistant", "tool")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _corpus(num_lines: int = 1000, seed: int = 0) -> Iterator[str]:
    """Yield deterministic training text: arithmetic Q/A, words, digits, ChatML and tool-call JSON."""
    rng = random.Random(seed)
    for _ in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        expr = f"{a}{op}{b}"
        answer = _OPS[op](a, b)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        pseudo = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        call = {"name": rng.choice(_TOOL_NAMES), "arguments": {"expression": expr}}
        yield f"What is {a} {op} {b}? Let's think step by step. The answer is \\boxed{{{answer}}}."
        yield f"{words.capitalize()}, {pseudo}: {rng.randint(0, 10**6)}; {rng.random():.4f}!"
        yield f"<tool_call>{json.dumps(call)}</tool_call>"
        yield json.dumps({"result": answer, "error": None, "ok": True})
        yield f"{IM_START}{rng.choice(_ROLES)}\n{words}{IM_END}\n{IM_START}assistant\n"


def build_tokenizer(vocab_size: int = 1024, model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (Qwen2 pipeline) on generated text and wrap it with a ChatML template.

    The result is deterministic and independent of any model seed. Its length may be below `vocab_size`
    if the generated corpus runs out of merges.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.3,
    seed: int = 0,
    tie_word_embeddings: bool = True,
) -> Path:
    """Build a random-init Qwen2 causal LM (fp32, tied embeddings unless `tie_word_embeddings=False`) plus
    tokenizer into `out_dir`.

    `initializer_range` is larger than the usual 0.02 so logits are far from uniform and greedy decoding
    has no near-ties. The same `seed` gives identical weights; the tokenizer does not depend on `seed`.
    Global torch RNG state is left untouched. Returns `out_dir` as a `Path`.
    """
    out = Path(out_dir)
    tokenizer = build_tokenizer(vocab_size, model_max_length=max_position_embeddings)
    pad_id, eos_id = tokenizer.convert_tokens_to_ids([PAD_TOKEN, IM_END])
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: build the tiny model into OUT_DIR and print its path and a one-line summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out_dir, seed=args.seed)
    model, tokenizer = load_model_and_tokenizer(path)
    n_params = sum(p.numel() for p in model.parameters())
    print(path)
    print(
        f"qwen2 tiny: {n_params:,} params, vocab {len(tokenizer)}, eos {tokenizer.eos_token!r}, seed {args.seed}"
    )


if __name__ == "__main__":
    main()
