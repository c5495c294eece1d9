# Shared by scripts/setup_*.sh (sourced, not run): the build-once steps of a cached virtual environment.
#
# The caller sets, before sourcing:
#   LOG_TAG   prefix of its log lines, e.g. setup_nemo_gym
#   VENV      the venv folder;  STAMP  the file whose last line describes a finished build
#   REBUILD   1: discard an existing venv and build again
# and defines `venv_ok` (true when the venv at $VENV is complete and current).
#
# A stamp file written as the very last step marks a finished build; a venv without it (an interrupted
# build) is deleted and rebuilt. Virtual environments are not relocatable (console scripts carry the
# absolute interpreter path), so the build happens in place and the stamp, not a rename, marks completion.

log() { echo "[$LOG_TAG] $*" >&2; }
die() { echo "[$LOG_TAG] ERROR: $*" >&2; exit 1; }

# Print the venv path and exit 0 when it is built (and no rebuild is asked for).
exit_if_built() {
    if [[ "${REBUILD:-0}" != "1" ]] && venv_ok; then
        log "already built ($(tail -n1 "$STAMP"))"
        echo "$VENV"
        exit 0
    fi
}

# lock_for_build LOCKFILE: wait (up to 30 min) for any other run building the same venv, return at once if
# that run finished it, and otherwise remove what an interrupted or stale build left. Holds the lock (fd 9)
# until the script exits.
lock_for_build() {
    local lock="$1"
    mkdir -p "$(dirname "$lock")"
    exec 9>"$lock"
    flock -w 1800 9 || die "timed out after 1800 s waiting for another $(basename "$0") run (lock $lock)"
    exit_if_built
    if [[ -e "$VENV" ]]; then
        log "removing incomplete or stale venv at $VENV"
        rm -rf "$VENV"
    fi
}

# quiet_pip PYTHON ARGS...: `PYTHON -m pip ARGS`, keeping its exit status and every line but the noise about
# this machine's empty local package-index mirrors ("Location ... is neither a file nor a directory").
quiet_pip() {
    local py="$1"
    shift
    "$py" -m pip "$@" 2>&1 | { grep -v 'is neither a file nor a directory' || true; } >&2
}
