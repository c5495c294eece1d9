#!/usr/bin/env bash
# Build (once) a NeMo Gym 0.7.0 virtual environment on Python 3.13 outside the repo.
#
#   scripts/setup_nemo_gym.sh            # builds if needed; the LAST line of stdout is the venv path
#   VENV=$(scripts/setup_nemo_gym.sh | tail -n1)
#
# Environment:
#   NEMO_RL_EXT_CACHE   cache root (default: $HOME/.cache/nemo_rl_ext)
#   NEMO_GYM_PYTHON     interpreter to use (default: pyenv's 3.13.0, else python3.13 on PATH)
#   NEMO_GYM_REBUILD=1  discard an existing venv and build again
#
# nemo-gym 0.7.0 declares Requires-Python >= 3.13.14, which no installable interpreter here
# satisfies; it installs and runs on 3.13.0 with --ignore-requires-python.
#
# Idempotent: a second run with the stamp of a finished build present returns at once; an interrupted
# build is deleted and rebuilt; a lock (flock) keeps two concurrent runs from building the same folder
# (scripts/venv_build.sh).
set -euo pipefail

GYM_VERSION="0.7.0"
GYM_TRANSFORMERS="5.24.0"
CACHE_ROOT="${NEMO_RL_EXT_CACHE:-$HOME/.cache/nemo_rl_ext}"
VENV="${CACHE_ROOT}/nemo-gym-${GYM_VERSION}"
STAMP="${VENV}/.nemo_rl_ext_complete"
LOG_TAG="setup_nemo_gym"
REBUILD="${NEMO_GYM_REBUILD:-0}"
source "$(dirname "${BASH_SOURCE[0]}")/venv_build.sh"

venv_ok() {
    # a stamp from before transformers was added names no transformers: that venv is topped up, not reused
    [[ -f "$STAMP" && -x "$VENV/bin/python" && -x "$VENV/bin/ng_run" ]] &&
        grep -q "transformers==${GYM_TRANSFORMERS}" "$STAMP"
}

exit_if_built  # fast path: no lock, no interpreter probing

find_python() {
    local cand
    local -a cands=()
    if [[ -n "${NEMO_GYM_PYTHON:-}" ]]; then
        cands+=("$NEMO_GYM_PYTHON")
    else
        if command -v pyenv >/dev/null 2>&1; then
            cands+=("$(pyenv root)/versions/3.13.0/bin/python3.13")
        fi
        cands+=("${PYENV_ROOT:-$HOME/.pyenv}/versions/3.13.0/bin/python3.13")
        if command -v python3.13 >/dev/null 2>&1; then
            cands+=("$(command -v python3.13)")
        fi
    fi
    for cand in "${cands[@]}"; do
        if [[ -x "$cand" ]] &&
            "$cand" -c 'import sys, venv; sys.exit(0 if sys.version_info[:2] == (3, 13) else 1)' 2>/dev/null; then
            echo "$cand"
            return 0
        fi
    done
    return 1
}

PY="$(find_python)" || die "no Python 3.13 interpreter found. Install one (e.g. 'pyenv install 3.13.0') \
or point NEMO_GYM_PYTHON at a python3.13 binary. Tried: \$NEMO_GYM_PYTHON, \$(pyenv root)/versions/3.13.0, python3.13 on PATH."
log "using $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

lock_for_build "${CACHE_ROOT}/.nemo-gym-${GYM_VERSION}.lock"

start=$SECONDS
log "creating venv at $VENV"
"$PY" -m venv "$VENV"
log "installing nemo-gym==${GYM_VERSION} (about a minute; ~1.4 GB)"
quiet_pip "$VENV/bin/python" install --quiet --ignore-requires-python "nemo-gym==${GYM_VERSION}"
# Gym's vllm_model renders chat templates itself in its completions mode (use_completions_api with
# render_chat_template, tests/functional/test_eval_gym_completions.py) and imports transformers for it
# (tokenizers only: no torch); nemo-gym does not depend on it.
log "installing transformers==${GYM_TRANSFORMERS} (for vllm_model's render_chat_template)"
quiet_pip "$VENV/bin/python" install --quiet "transformers==${GYM_TRANSFORMERS}"

# Sanity check before stamping: the CLI entry points exist and the server packages import.
"$VENV/bin/python" - >&2 <<'EOF'
import importlib.metadata as md
import nemo_gym, responses_api_agents.simple_agent.app, responses_api_models.vllm_model.app, transformers
import resources_servers.example_single_tool_call.app
print("nemo-gym", md.version("nemo-gym"), "imports OK")
EOF
[[ -x "$VENV/bin/ng_run" ]] || die "ng_run missing from $VENV/bin after install"

printf 'nemo-gym==%s transformers==%s python=%s built=%s in %ss\n' "$GYM_VERSION" "$GYM_TRANSFORMERS" \
    "$("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])')" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$((SECONDS - start))" >"${STAMP}.tmp"
mv "${STAMP}.tmp" "$STAMP"
log "done in $((SECONDS - start)) s"
echo "$VENV"
