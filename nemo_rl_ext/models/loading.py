"""Loading a causal LM folder (tiny, SmolLM2 or any transformers folder) and its tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, padding on the left (batched prompts end where generation starts): the one
    every backend, replica pool and trainer serves."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return tokenizer


def load_model_and_tokenizer(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM folder (tiny or SmolLM2) in eval mode, with its `load_tokenizer` tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return model, load_tokenizer(path)
