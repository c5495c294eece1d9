"""Structured output on the hf engine: a JSON Schema compiled by llguidance into a per-row token mask.

- `grammar_of(spec)`: the llguidance grammar of a `StructuredOutput`; a `GrammarError` (a ValueError) with the
  reason when the schema is invalid, uses a keyword llguidance does not implement, is larger than
  `SCHEMA_MAX_BYTES`, or is one the grammar cannot serve (`probe_grammar`: no JSON value satisfies it, or the
  parser exceeds its limits within the first `PROBE_BYTES` bytes of output). It needs no model tokenizer, so the
  policy server refuses such a schema (a 400) before anything reaches a batch, in bounded time.
- `Grammars`: one per engine, built on the engine's tokenizer the first time a request has a grammar.
  `row(spec)` gives a request its own matcher (a copy of one compiled per schema and kept); `mask(logits,
  grammars)` sets to -inf, in each grammar row, every token its grammar does not allow next, so the row samples,
  and reports logprobs, from the masked distribution. Rows without a grammar are not touched, and a batch
  without any grammar row costs one pass over a list.
- `RowGrammar.accept(token)` advances a row's matcher with the token it sampled; a grammar that fails later in
  a generation (a limit the probe's path did not reach) raises `GrammarError`, which ends that row alone.
- `vllm_structured_outputs(spec)`: the same constraint for the vLLM backend, vLLM's `StructuredOutputsParams(json=
  schema)`, what vLLM's own OpenAI server makes of a `response_format`; vLLM's structured-output backend (`auto`:
  xgrammar, else guidance, i.e. llguidance) then masks the logits, so vLLM's logprobs are the masked ones too.

EOS is allowed only where the grammar is complete; once the JSON value is closed (nothing else may follow) EOS is
the only token allowed, so the row ends at its next step with EOS, as in vLLM. JSON is compact: no whitespace
between tokens (`JSON_OPTIONS`), so a model cannot spend its budget on blank space (vLLM's
`disable_any_whitespace`).
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Iterable, Sequence

import llguidance
import llguidance.hf
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from nemo_rl_ext.models.generation.interfaces import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False}
"""How llguidance compiles a schema: compact JSON (`,` and `:` separators, no whitespace between tokens)."""
_NEG_INF_BITS = np.uint32(0xFF800000)
"""The bits of float32 -inf."""
MATCHERS_KEPT = 64
"""Compiled matchers an engine keeps, one per schema, least recently used dropped first."""
SCHEMA_MAX_BYTES = 64 * 1024
"""The largest schema served, in bytes of compact JSON: compiling grows faster than linearly with the schema
(measured: 2,500 optional properties, 71 KB, 0.2 s; 9,000, 260 KB, 5.3 s), and a request must be refused or
accepted in bounded time. OpenAI's own limits are of the same order (5,000 properties, 120,000 characters of
names and values)."""
PROBE_BYTES = 64
"""Bytes of output `probe_grammar` walks through the grammar before a schema is accepted."""


class GrammarError(ValueError):
    """A JSON schema the grammar cannot serve (invalid, too large, unsatisfiable, or over the parser's limits)."""


class _ByteTokens:
    """A tokenizer with one token per byte (and an EOS), what `probe_grammar` walks the grammar with: every
    model's tokens are byte strings, so what fails here on the first bytes fails for any tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))


def _reason(error: str) -> str:
    """llguidance's error, its first line without its advice to grammar writers."""
    return error.splitlines()[0].split("; consider ")[0] if error else "not allowed"


def probe_grammar(grammar: str) -> None:
    """Walk `grammar` for `PROBE_BYTES` bytes of output, taking the lowest allowed byte each step (into the
    first key of an object, the first character of a string): a `GrammarError` when no JSON value satisfies the
    schema, or when the parser exceeds its limits on the way (e.g. thousands of optional properties make one
    Earley row of more than 2,000 items). A schema that passes may still fail later in a generation; the engine
    then ends that request alone."""
    tokenizer = _byte_tokenizer()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0,
                                   limits=llguidance.LLParserLimits(verbose_errors=False))
    bits = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.uint32)
    for step in range(PROBE_BYTES):
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if matcher.is_error():
            break
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[: _ByteTokens.eos_token_id])
        if allowed.size == 0:  # only EOS (a complete value) or nothing at all
            if step == 0 and not matcher.is_accepting():
                raise GrammarError("no JSON value satisfies this schema (e.g. a $ref that only refers to itself)")
            return
        matcher.consume_token(int(allowed[0]))
    if matcher.is_error():
        error = matcher.get_error()
        if "NoExtensionBias" in error or ("fails parse" in error and step == 0):
            raise GrammarError("no JSON value satisfies this schema (e.g. a $ref that only refers to itself)")
        raise GrammarError(f"the grammar cannot serve this schema: {_reason(error)} (too many alternatives at "
                           "one point of the output, e.g. thousands of optional properties)")


@functools.lru_cache(maxsize=256)
def _grammar(json_schema: str) -> str:
    size = len(json_schema.encode())
    if size > SCHEMA_MAX_BYTES:
        raise GrammarError(f"the schema is {size:,} bytes of JSON; at most {SCHEMA_MAX_BYTES:,} are served")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json_schema, defaults=JSON_OPTIONS)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"invalid JSON schema: {error}")
    probe_grammar(grammar)
    return grammar


def vllm_structured_outputs(spec: StructuredOutput | None):
    """vLLM's `StructuredOutputsParams` for `spec` (None for None): the schema as `json` (a dict), as vLLM 0.32's
    OpenAI server passes a response_format's `json_schema.schema`. Imports vLLM only for a constrained request."""
    if spec is None:
        return None
    # optional dependency: vllm, only for the vLLM backend
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(json=json.loads(spec.json_schema))


def grammar_of(spec: StructuredOutput) -> str:
    """The llguidance grammar of `spec`; a `GrammarError` saying what is wrong with its schema otherwise."""
    try:
        return _grammar(spec.json_schema)
    except GrammarError:
        raise
    except ValueError as exc:  # llguidance's compiler: an invalid schema or an unimplemented keyword
        raise GrammarError(f"invalid JSON schema: {exc}") from None


class RowGrammar:
    """One request's matcher: what it may generate next, advanced with each token it samples."""

    def __init__(self, matcher: llguidance.LLMatcher, words: int) -> None:
        self.matcher = matcher
        self.words = words
        """32-bit words of its mask (its tokenizer's vocabulary, rounded up to 32 token ids)."""

    def fill(self, bits: np.ndarray) -> None:
        """Write the allowed next tokens, one bit per token id, into the start of `bits` (a C-contiguous int32 row
        of at least `words` words)."""
        if bits.dtype != np.int32 or not bits.flags.c_contiguous or bits.size < self.words:
            raise ValueError(f"a mask row must be {self.words} contiguous int32 words or more")
        self.matcher.unsafe_compute_mask_ptr(bits.ctypes.data, self.words * 4)

    def accept(self, token: int) -> None:
        """Advance with the sampled `token`; a ValueError if the grammar did not allow it."""
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar failed at generated token {token}: "
                               f"{_reason(self.matcher.get_error())}")

    @property
    def complete(self) -> bool:
        """True when the text so far matches the whole grammar (EOS is allowed)."""
        return self.matcher.is_accepting()


class Grammars:
    """An engine's grammar machinery: its tokenizer as llguidance sees it, compiled matchers, the mask."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._matchers: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()

    def row(self, spec: StructuredOutput) -> RowGrammar:
        """A fresh matcher for one request (thread-safe; compiling runs here, never on the engine thread)."""
        grammar = grammar_of(spec)
        with self._lock:
            template = self._matchers.get(spec.json_schema)
            if template is None:
                template = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
                if template.is_error():
                    raise GrammarError(f"invalid JSON schema: {_reason(template.get_error())}")
                self._matchers[spec.json_schema] = template
                while len(self._matchers) > MATCHERS_KEPT:
                    self._matchers.popitem(last=False)
            self._matchers.move_to_end(spec.json_schema)
            return RowGrammar(template.deep_copy(), (self._llg_tokenizer().vocab_size + 31) // 32)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_ids
            )
        return self._ll_tokenizer

    @staticmethod
    def mask(logits: torch.Tensor, grammars: Sequence[RowGrammar | None]) -> torch.Tensor:
        """`logits` [rows, vocab] with every token a row's grammar forbids next set to -inf (a copy), or
        `logits` itself when no row has a grammar."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return logits
        vocab = logits.shape[-1]
        bits = np.zeros((len(rows), max((vocab + 31) // 32, *(grammars[i].words for i in rows))), dtype=np.int32)
        for j, i in enumerate(rows):
            grammars[i].fill(bits[j])
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, count=vocab, bitorder="little")
        # 0.0 where allowed, -inf where not, built from the bits: a masked_fill / where over a scattered mask
        # branches per token and took 12x longer on a 49k vocabulary
        bias = ((allowed ^ 1).astype(np.uint32) * _NEG_INF_BITS).view(np.float32)
        bias = torch.from_numpy(bias).to(device=logits.device, dtype=logits.dtype)
        if len(rows) == len(grammars):
            return logits + bias
        index = torch.tensor(rows, device=logits.device)
        masked = logits.clone()
        masked[index] = logits[index] + bias
        return masked
