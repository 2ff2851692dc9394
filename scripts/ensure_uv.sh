# shellcheck shell=bash
# Sourced by setup.sh: `ensure_uv PYTHON` puts uv (the package manager the env stage uses) on PATH,
# installing it into ~/.local/bin when it is missing. Returns 2 with a message when it cannot.
#
# Why three ways: a fresh DGX Spark (DGX OS, Ubuntu 24.04) has no uv, and its system Python refuses
# `pip install --user` (PEP 668, "externally-managed-environment") unless told
# --break-system-packages; uv is one static binary in ~/.local/bin, which touches no system package.
# Without pip, uv's own installer (https://docs.astral.sh/uv/getting-started/installation/), told
# not to edit shell start-up files.

ensure_uv() {
  local py="$1"
  [[ -x "$HOME/.local/bin/uv" ]] && export PATH="$HOME/.local/bin:$PATH"   # installed by an earlier run
  command -v uv >/dev/null 2>&1 && return 0
  echo "==> installing uv into ~/.local/bin"
  if "$py" -m pip --version >/dev/null 2>&1; then
    if ! "$py" -m pip install --quiet --user uv 2>/dev/null; then
      echo "==> pip refused a --user install (PEP 668?): retrying with --break-system-packages (uv only)"
      "$py" -m pip install --quiet --user --break-system-packages uv || true
    fi
    [[ -x "$HOME/.local/bin/uv" ]] && export PATH="$HOME/.local/bin:$PATH"
  fi
  # pip can refuse both ways (a python3 of another virtualenv has no user site), or put uv where
  # PATH does not look: uv's own installer then, not an error that says curl failed untried
  if ! command -v uv >/dev/null 2>&1 && command -v curl >/dev/null 2>&1; then
    curl -LsSf https://astral.sh/uv/install.sh | env UV_NO_MODIFY_PATH=1 sh || true
  fi
  [[ -x "$HOME/.local/bin/uv" ]] && export PATH="$HOME/.local/bin:$PATH"
  command -v uv >/dev/null 2>&1 && return 0
  echo "setup.sh: error: could not install uv (pip and curl both failed or are missing): install it" \
       "(https://docs.astral.sh/uv/getting-started/installation/) and rerun" >&2
  return 2
}
