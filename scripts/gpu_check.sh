#!/usr/bin/env bash
# The trainer's device checks and the learning bench on a lent GPU machine, under 10 minutes, one report file:
#     bash scripts/gpu_check.sh [--device cuda|cpu]
# The report goes to $OUT/gpu_report.md when $OUT is set (the lent machine's result folder), else ./gpu_report.md.
# The image has torch (CUDA), transformers, peft and accelerate, but not the project's small pure-Python
# dependencies: carry them as wheels in wheels/ (or $WHEELS); see docs/training.md, "Checking on a GPU".
# Exit status: gpu_check.py's (0: no check failed; 1: a check failed; 2: no CUDA device), 124 past the deadline.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-wheels}
# 570 s: the checks, then the learning bench in the time left (gpu_check.py reads the deadline to budget it)
export GPU_CHECK_DEADLINE_S=${GPU_CHECK_DEADLINE_S:-570}
DEADLINE_S=$GPU_CHECK_DEADLINE_S

if compgen -G "$WHEELS/*.whl" > /dev/null; then
    # --no-deps: only the carried wheels, never the index, never another torch
    "$PYTHON" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" "$WHEELS"/*.whl
fi
"$PYTHON" -c 'import sys, torch, transformers; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, '\
'transformers {transformers.__version__}, cuda available: {torch.cuda.is_available()}")'
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
exec timeout --kill-after=15 "$DEADLINE_S" "$PYTHON" scripts/gpu_check.py "$@"
