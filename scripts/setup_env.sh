# shellcheck shell=bash
# The env stage of setup.sh (sourced by it; uses its globals: REPO, PY, GPU_NAME, GPU_CC, DRIVER,
# CUDA_DRIVER_VERSION, TORCH_INDEX, FORCE, INSTALL_RUST, CURRENT_STAGE and its say/die helpers):
# uv, .venv, torch for this machine's driver, the project with its extras, and the Rust tokenizer;
# and check_chat_data: whether that venv finds the data mid_train / chat_sft will train on.
# The env stage's done-marker lives in .venv (deleting .venv forgets it) and holds the interpreter,
# the torch index, the extras and a hash of the files that define the install (pyproject.toml and
# the Rust crate); a rerun skips the installs when all match and the venv imports torch + rustbpe.
ENV_MARKER="$REPO/.venv/.setup-env.done"
env_torch_args() {
  [[ -z "$TORCH_INDEX" ]] || printf '%s\n' --index-url "$TORCH_INDEX"
}
TORCH_MARKER="$REPO/.venv/.setup-torch"
torch_ok() {  # keep the venv's torch: it imports and came from this index, or (installed before the
              # index was recorded, and no index named) it sees the GPU; the end of the stage checks it
  .venv/bin/python -c 'import torch' >/dev/null 2>&1 || return 1
  if [[ -f "$TORCH_MARKER" ]]; then [[ "$(cat "$TORCH_MARKER")" == "${TORCH_INDEX:-PyPI}" ]] && return 0; return 1; fi
  [[ -z "${TORCH_INDEX_URL:-}" ]] || return 1
  [[ -z "$GPU_NAME" ]] || gpu_runs
}
# A kernel launch, not is_available(): that says True for a GPU the build has no kernels for (a V100
# under an sm_75+ build), whose first real kernel then fails in base_train, after data and tokenizer
GPU_LAUNCH='import sys, torch
torch.cuda.is_available() or sys.exit(1)
torch.ones(1, device="cuda").add_(1).item()'
gpu_runs() { .venv/bin/python -c "$GPU_LAUNCH" >/dev/null 2>&1; }
env_extras() {
  local extras="web,dev"
  [[ -n "$GPU_NAME" ]] && extras="web,dev,gpu"
  # Hopper (cc 9.0) with a CUDA 13 driver: FlashAttention-4's backward, which --attn-backend auto picks
  # there after a probe launch (nanochat/fa4_attention.py); its CuTe DSL libraries are the cu13 build
  [[ "$GPU_CC" == 9.0 && "${CUDA_DRIVER_VERSION%%.*}" -ge 13 ]] 2>/dev/null && extras="$extras,fa4"
  [[ -n "${WANDB_RUN:-}" ]] && extras="$extras,wandb"
  # the hub extra (datasets): the GPU presets' mid / SFT train on the train splits of MMLU, ARC and
  # GSM8K, which only the hub has (../shared/data holds test files), and without ../shared/data (a
  # fresh clone) every chat stage reads the hub; without it mid_train stopped after base training.
  # By preset, not by GPU: --preset tiny on a GPU box with ../shared/data reads nothing from the hub;
  # once installed it stays (else each switch of preset changed the marker and reinstalled the venv)
  [[ "$PRESET" != tiny || ! -d "$REPO/../shared/data/eval" || ! -d "$REPO/../shared/data/sft" ]] \
    || grep -q '^extras=.*,hub$' "$ENV_MARKER" 2>/dev/null && extras="$extras,hub"
  echo "$extras"
}
env_marker_text() {
  echo "python=$PY ($("$PY" --version 2>&1))"
  echo "torch_args=$(env_torch_args | tr '\n' ' ')"
  echo "extras=$(env_extras)"
  echo "bytecode=compiled"   # venvs made before compile_bytecode existed run the stage once more
  (cd "$REPO" && find pyproject.toml rustbpe -type f \( -name '*.toml' -o -name '*.rs' \) \
     -not -path 'rustbpe/target/*' -print0 | sort -z | xargs -0 sha256sum)
}
env_done() {
  [[ $FORCE -eq 0 && -f "$ENV_MARKER" && "$(cat "$ENV_MARKER")" == "$(env_marker_text)" ]] \
    && .venv/bin/python -c 'import torch, rustbpe, nanochat' >/dev/null 2>&1
}
env_why() {  # why the env stage (re)installs: what differs from the record of its last finished run
  [[ -x .venv/bin/python ]] || { echo "no .venv yet"; return; }
  [[ $FORCE -eq 0 ]] || { echo "--force"; return; }
  [[ -f "$ENV_MARKER" ]] || { echo "no record of a finished env stage in .venv"; return; }
  local changed
  changed="$( { diff <(cat "$ENV_MARKER") <(env_marker_text) || true; } | sed -n 's/^[<>] //p' \
    | sed 's/^\(python\|torch_args\|extras\|bytecode\)=.*/\1/; s/^[0-9a-f]\{64\}  //' | sort -u | paste -sd, - \
    | sed 's/,/, /g')"
  if [[ -n "$changed" ]]; then echo "changed since .venv was set up: $changed"
  else echo ".venv does not import torch, rustbpe and nanochat"; fi
}
env_plan() {  # what the env stage would do, as --dry-run says it
  local idx="${TORCH_INDEX:-PyPI}"
  if [[ ! -x .venv/bin/python ]]; then echo "create .venv, install torch from $idx, the project and rustbpe"
  elif torch_ok; then   # (its index is recorded since the stage records it; an older venv's is not known)
    echo "keep .venv's torch$([[ -f "$TORCH_MARKER" ]] && echo " (from $(cat "$TORCH_MARKER"))"), reinstall the project and rustbpe"
  else echo "reinstall torch from $idx, the project and rustbpe in .venv"; fi
}
rust_ready() {  # cargo on PATH, or in rustup's ~/.cargo/bin (installed after this shell started)
  [[ -x "$HOME/.cargo/bin/cargo" ]] && export PATH="$HOME/.cargo/bin:$PATH"
  command -v cargo >/dev/null 2>&1
}
NO_CARGO="cargo not found: the tokenizer is built from Rust. Install Rust (https://rustup.rs) or rerun with --install-rust"
# Rust links with the system's C compiler driver, absent from minimal cloud images: without it the
# tokenizer's build failed ("linker `cc` not found") after the torch download
# Python turns a module into bytecode on import and caches it as a .pyc beside it, unless it may not
# write (PYTHONDONTWRITEBYTECODE=1, set in many container images; a read-only venv): then every process
# compiles what it imports again. uv does not compile at install time either. Measured on 2 CPU cores,
# torch 2.15: `import torch` 4.0 s -> 2.0 s, torch._dynamo (every optimizer's first param group
# imports it) 9.9 s -> 3.5 s, so each training or test subprocess starts ~6 s sooner.
compile_bytecode() {
  local site log="$REPO/.venv/.compileall.log" t0=$SECONDS failed
  site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  if .venv/bin/python -m compileall -q -j 0 "$site" > "$log" 2>&1; then failed=0
  else failed="$(grep -c '^\*\*\* Error compiling' "$log" || true)"; fi
  # a file written for a newer Python (torch ships py3.12-only test helpers) fails here and is only
  # read as source if imported: it is counted, not fatal
  say "bytecode: the venv's packages compiled in $((SECONDS - t0)) s ($failed file(s) skipped, see $log)"
}
NO_CC="cc (a C compiler, the linker Rust uses) not found: install one (Debian/Ubuntu: sudo apt-get install build-essential) and rerun"
env_only_needs_bytecode() {  # a venv set up before compile_bytecode existed, the same otherwise
  [[ $FORCE -eq 0 && -f "$ENV_MARKER" && "$(cat "$ENV_MARKER")" == "$(env_marker_text | grep -vx 'bytecode=compiled')" ]] \
    && .venv/bin/python -c 'import torch, rustbpe, nanochat' >/dev/null 2>&1
}
env_run() {  # command... -> run it; a failure (uv's resolver, a download, the Rust build) ends setup.sh
            # with a line naming the step and the command to rerun, not silently under set -e
  local rc=0
  "$@" || rc=$?
  (( rc == 0 )) && return 0
  echo "setup.sh: stage 'env' failed (exit $rc) running: $(shell_words "$@"). Fix the problem (see the" \
       "lines above) and rerun $(rerun_cmd): the packages already installed are kept." >&2
  exit 1
}
env_stage() {
  if env_done; then say "[env] done already (same config): skipping"; return 0; fi
  if env_only_needs_bytecode; then   # no reinstall (which would need the network, cargo and cc)
    compile_bytecode
    env_marker_text > "$ENV_MARKER.tmp" && mv -f "$ENV_MARKER.tmp" "$ENV_MARKER"
    say "[env] done already (same config; its packages compiled to bytecode now)"; return 0
  fi
  CURRENT_STAGE=env
  say "[env] $(env_plan) ($(env_why))"
  rust_ready || [[ $INSTALL_RUST -eq 1 ]] || die "$NO_CARGO"   # before any download
  command -v cc >/dev/null 2>&1 || die "$NO_CC"
  local t0=$SECONDS
  source "$REPO/scripts/ensure_uv.sh"
  ensure_uv "$PY" || exit 2
  [[ -x .venv/bin/python ]] || env_run uv venv --quiet --python "$PY" .venv
  local torch_args=()
  mapfile -t torch_args < <(env_torch_args)
  if ! torch_ok; then
    if .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
      say "the installed torch is from another index or cannot use this GPU: reinstalling it"
      env_run uv pip uninstall --quiet -p .venv/bin/python torch
    fi
    say "installing torch from ${TORCH_INDEX:-PyPI}"
    env_run uv pip install --quiet -p .venv/bin/python "${torch_args[@]}" "torch>=2.9"
    printf '%s\n' "${TORCH_INDEX:-PyPI}" > "$TORCH_MARKER"
  fi
  local extras
  extras="$(env_extras)"
  say "installing nanochat-spark[$extras]"
  env_run uv pip install --quiet -p .venv/bin/python -e ".[$extras]"
  if ! rust_ready; then
    say "installing a Rust toolchain with rustup (--install-rust)"
    env_run bash -o pipefail -c "curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal"
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
  say "building the Rust tokenizer (rustbpe) with maturin"
  env_run uv pip install --quiet -p .venv/bin/python ./rustbpe
  compile_bytecode
  # the installs said nothing wrong, yet the venv may not import them (a rustbpe built for another
  # Python): named as the env stage's failure, not a bare traceback that set -e ends setup.sh on
  env_run .venv/bin/python -c 'import rustbpe, torch; print("env ok: torch", torch.__version__, "cuda", torch.cuda.is_available())'
  if [[ -n "$GPU_NAME" ]] && ! gpu_runs; then
    .venv/bin/python -c "$GPU_LAUNCH" 2>&1 | tail -n 1 >&2 || true   # torch's own reason, for the record
    local built
    built="$(.venv/bin/python -c 'import torch; a = " ".join(torch.cuda.get_arch_list())
print(f"{torch.__version__} (CUDA {torch.version.cuda}, kernels for {a})")')" || built="(version unknown)"
    die "torch $built cannot run a kernel on the $GPU_NAME (cc ${GPU_CC:-?}) with driver $DRIVER" \
        "(CUDA $CUDA_DRIVER_VERSION): set TORCH_INDEX_URL to a torch wheel index this driver can run and" \
        "that has this GPU's kernels (e.g. https://download.pytorch.org/whl/cu126) and rerun"
  fi
  env_marker_text > "$ENV_MARKER.tmp" && mv -f "$ENV_MARKER.tmp" "$ENV_MARKER"
  CURRENT_STAGE=""
  say "[env] finished in $((SECONDS - t0)) s"
}
# The chat stages' data, found by mid_train / chat_sft's own loaders (nanochat/chat_data.py) before the
# data stage and base training: without ../shared/data (a fresh clone) and the hub extra, or on a GPU
# preset (train splits only the hub has) without it, mid_train stopped on a missing file days later.
# With `datasets` importable the hub's part is not fetched here (gigabytes): only the word list, which
# has no hub copy, is looked for. Skipped for a stage whose done-marker is there (rerun: it found its
# data before); a check that fails otherwise (no nanochat in the venv) leaves it to the stage.
check_chat_data() {
  local s stages=() cmd holdout=-1 i
  for s in mid_train chat_sft; do
    should_run "$s" && [[ $FORCE -eq 1 || ! -f "$STATE_DIR/$s.done" ]] && stages+=("$s")
  done
  [[ ${#stages[@]} -gt 0 && $DRY_RUN -eq 0 && -x .venv/bin/python ]] || return 0
  mapfile -t cmd < <(stage_cmd "${stages[0]}")   # offline (tiny): --test-holdout N, the local test files
  for i in "${!cmd[@]}"; do [[ "${cmd[$i]}" != --test-holdout ]] || holdout="${cmd[$((i + 1))]}"; done
  local said rc=0
  said="$(.venv/bin/python - "$holdout" "${stages[@]}" 2>/dev/null <<'PY'
import contextlib
import importlib.util
import sys

from nanochat.errors import RequestError

holdout, stages = int(sys.argv[1]), sys.argv[2:]
stage = stages[0]
hub = importlib.util.find_spec("datasets") is not None
try:
    with contextlib.redirect_stdout(sys.stderr):   # the loaders' progress lines: stdout is the verdict
        if hub:
            from nanochat.tasks.spelling import load_words
            load_words()
        else:
            from nanochat.chat_data import build_mixture
            for stage in stages:
                phase = {"mid_train": "mid", "chat_sft": "sft"}[stage]
                build_mixture(phase, "train", test_holdout=holdout)
                build_mixture(phase, "val", test_holdout=holdout)
except RequestError as e:   # MissingDataError, DataError: a file missing or broken
    print(f"{stage}\n{int(hub)}\n{e}")
    sys.exit(3)
PY
)" || rc=$?
  (( rc == 3 )) || return 0
  local stage="${said%%$'\n'*}" rest="${said#*$'\n'}" advice="Put the files named above in place"
  # with `datasets` there only the word list (no hub copy) was looked for: the hub extra cannot help
  [[ "${rest%%$'\n'*}" == 1 ]] || advice="For the hub's copies install the hub extra (in $REPO: uv pip install -p"\
" .venv/bin/python -e '.[hub]'; ./setup.sh --only env does so for a GPU preset or without ../shared/data), or put the files named above in place"
  die "stage '$stage' would stop on its data (checked now, before the data stage and base training):" \
    "${rest#*$'\n'}"$'\n'"$advice"
}
