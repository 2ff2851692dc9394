#!/usr/bin/env bash
# Base training in the background: start (nohup, one run per model tag), --status, --stop.
#
#   ./run_train.sh --depth 20 --model-tag d20             start: the flags go to scripts.base_train
#   ./run_train.sh --status [--model-tag d20]             running or not, pid, last step, log tail
#   ./run_train.sh --stop [--model-tag d20] [--timeout 60]  SIGTERM, wait, then SIGKILL
#
# Files live in $NANOCHAT_BASE_DIR/runs/<model-tag>/ (default base dir ~/.cache/nanochat):
#   pid (the run's process group leader), train.log (stdout + stderr), cmd (the command),
#   exit_code (written when the run ends by itself). `./run_train.sh --help` for everything.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
PYTHON="${NANOCHAT_PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON="$(command -v python3 || true)"; fi
fi

usage() {
  cat <<EOF
Usage: ./run_train.sh [run options] [scripts.base_train flags...]
       ./run_train.sh --status [--model-tag TAG] [--lines N]
       ./run_train.sh --stop   [--model-tag TAG] [--timeout SECONDS]

Starts 'python -m scripts.base_train FLAGS' in the background with nohup (its own process group),
writes the pid and the log under \$NANOCHAT_BASE_DIR/runs/<model-tag>/ and returns. The model tag
is --model-tag from the flags, else d<--depth>, else d20 (base_train's defaults). A second start
on a tag whose run is alive is refused; a pid file of a dead run is cleaned up. The flags are
validated (scripts.base_train's own checks) before anything starts, and so is what the run needs
on disk: the tokenizer, the data shards, the checkpoint --resume names (and that these flags can
continue it); a tag that holds checkpoints needs --resume latest (continue) or --overwrite (start
afresh).

Run options (not passed to base_train):
  --nproc N        run under 'torchrun --standalone --nproc_per_node N' (default 1: plain python);
                   TORCH_ELASTIC_SHUTDOWN_TIMEOUT defaults to 3600 there, so that a Ctrl-C or a
                   scheduler's SIGTERM to torchrun leaves the workers time to save
  --base-dir DIR   artefact directory (default \$NANOCHAT_BASE_DIR or ~/.cache/nanochat; exported
                   to the run as NANOCHAT_BASE_DIR)
Modes:
  --status         report every run (or --model-tag's): running or not, pid, last step, log tail;
                   exit 0 if the (single) run asked about is running, 3 if not
  --stop           SIGTERM the run (under torchrun: its worker processes, so that torchrun's own
                   SIGTERM -> SIGKILL wait does not apply), wait --timeout seconds (default
                   600), then SIGKILL everything the run started; without --model-tag, stops
                   the only running run. On SIGTERM the training loop finishes its step and
                   saves a checkpoint first (d20: seconds to a minute or two), so the
                   same flags plus --resume latest continue where it stopped
  --lines N        log lines shown by --status (default 10)
  -h, --help       this text
An option of another mode is refused, not ignored: --nproc starts a run, --lines goes with --status,
--timeout with --stop. A relative --base-dir (or NANOCHAT_BASE_DIR) or --data-dir is the caller's
directory's.
Exit codes: 0 started (the run goes on in the background; its own end is in <run dir>/exit_code),
stopped, nothing to stop, or (--status) running; 1 a run of that tag is already running; 2 a bad
flag or a request refused before anything started; 3 (--status) not running.
The log is appended to across starts of a tag (each start begins with a '==> run_train.sh started'
line; --status reads the latest start's steps): move or delete train.log between runs to rotate it.
Environment: NANOCHAT_PYTHON overrides the interpreter (default .venv/bin/python, else python3).
Examples:
  ./run_train.sh --depth 12 && tail -f ~/.cache/nanochat/runs/d12/train.log
  ./run_train.sh --nproc 8 --depth 20 --model-tag d20
  (--run NAME logs to wandb: it needs the wandb extra, which WANDB_RUN=NAME ./setup.sh installs)
EOF
}

die() { echo "run_train.sh: error: $*" >&2; exit 2; }
say() { echo "run_train.sh: $*"; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
callers_path() {  # a path as the caller means it: ~/x is the home's, a relative one this directory's ('' as is)
  local p="$1"
  [[ "$p" != "~" && "$p" != "~/"* ]] || p="$HOME${p:1}"
  [[ -z "$p" || "$p" == /* ]] || p="$PWD/$p"
  printf '%s' "$p"
}

MODE=start TAG="" DEPTH="" NPROC=1 TIMEOUT=600 LINES=10 TAG_GIVEN=0 BASE_DIR_GIVEN=0
MODES_GIVEN=() RUN_OPTS=()   # --status / --stop given; the run options given, as "flag mode-they-belong-to"
TRAIN_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --status) MODE=status; MODES_GIVEN+=(--status); shift ;;
    --stop) MODE=stop; MODES_GIVEN+=(--stop); shift ;;
    --timeout) [[ $# -ge 2 ]] || die "--timeout needs a value (seconds)"; TIMEOUT="$2"; RUN_OPTS+=("--timeout stop"); shift 2 ;;
    --timeout=*) TIMEOUT="${1#*=}"; RUN_OPTS+=("--timeout stop"); shift ;;
    --lines) [[ $# -ge 2 ]] || die "--lines needs a value"; LINES="$2"; RUN_OPTS+=("--lines status"); shift 2 ;;
    --lines=*) LINES="${1#*=}"; RUN_OPTS+=("--lines status"); shift ;;
    --nproc) [[ $# -ge 2 ]] || die "--nproc needs a value (GPUs on this host)"; NPROC="$2"; RUN_OPTS+=("--nproc start"); shift 2 ;;
    --nproc=*) NPROC="${1#*=}"; RUN_OPTS+=("--nproc start"); shift ;;
    --base-dir) [[ $# -ge 2 ]] || die "--base-dir needs a directory"; BASE_DIR="$2"; BASE_DIR_GIVEN=1; shift 2 ;;
    --base-dir=*) BASE_DIR="${1#*=}"; BASE_DIR_GIVEN=1; shift ;;
    --model-tag|--model_tag) [[ $# -ge 2 ]] || die "$1 needs a value"
      TAG="$2"; TAG_GIVEN=1; TRAIN_ARGS+=("--model-tag" "$2"); shift 2 ;;
    --model-tag=*|--model_tag=*) TAG="${1#*=}"; TAG_GIVEN=1; TRAIN_ARGS+=("--model-tag" "$TAG"); shift ;;
    # the run starts in the repo: a relative --data-dir (the user's own shards) is made the caller's here
    --data-dir|--data_dir) [[ $# -ge 2 ]] || die "$1 needs a directory"; TRAIN_ARGS+=("$1" "$(callers_path "$2")"); shift 2 ;;
    --data-dir=*|--data_dir=*) TRAIN_ARGS+=("${1%%=*}=$(callers_path "${1#*=}")"); shift ;;
    --depth) [[ $# -ge 2 ]] || die "--depth needs a value"; DEPTH="$2"; TRAIN_ARGS+=("$1" "$2"); shift 2 ;;
    --depth=*) DEPTH="${1#*=}"; TRAIN_ARGS+=("$1"); shift ;;
    *) TRAIN_ARGS+=("$1"); shift ;;
  esac
done

# a value left out (`--base-dir $UNSET_VAR --status`) took the next flag as the directory, and a
# --status or --stop started a training run in ./--status instead
[[ $BASE_DIR_GIVEN -eq 0 || "$BASE_DIR" != -* ]] || die "--base-dir: got '$BASE_DIR' (a flag, not a directory: its value left out?);" \
  "accepted: a directory (./$BASE_DIR for a name starting with '-')"
# a run option of another mode would be ignored: --timeout is --stop's, --lines --status's, --nproc a start's
if [[ " ${MODES_GIVEN[*]} " == *" --status "* && " ${MODES_GIVEN[*]} " == *" --stop "* ]]; then
  die "--status and --stop: got both; accepted: one of the two"
fi
for opt in "${RUN_OPTS[@]}"; do
  flag="${opt% *}" belongs="${opt#* }"
  [[ "$belongs" == "$MODE" ]] || die "$flag: got it $([[ $MODE == start ]] && echo "to start a run" || echo "with --$MODE");" \
    "accepted: $flag $([[ $belongs == start ]] && echo "when starting a run (not with --status / --stop)" || echo "with --$belongs only")"
done
[[ -n "$BASE_DIR" ]] || die "--base-dir: got ''; accepted: a directory"
# `--base-dir=~/nc` arrives unexpanded (the shell expands ~ only at a word's start): not ./~/nc
[[ "$BASE_DIR" != "~" && "$BASE_DIR" != "~/"* ]] || BASE_DIR="$HOME${BASE_DIR:1}"
# absolute: the run starts in the repo (cd below), where a relative path would name another directory
[[ "$BASE_DIR" == /* ]] || BASE_DIR="$PWD/$BASE_DIR"
# bounded in digits: bash's 64-bit arithmetic wraps silently, so --timeout 10000000000 ("wait however
# long it takes") made --stop's deadline (now + timeout in ns) negative: SIGKILL at once, no save; and
# --nproc 18446744073709551617 read as 1
up_to() { [[ "$1" =~ ^0*([0-9]{1,$2})$ ]]; }   # value digits -> a whole number of at most that many digits
up_to "$TIMEOUT" 9 && (( 10#$TIMEOUT >= 1 )) || die "--timeout: got '$TIMEOUT'; accepted: an integer 1-999999999 (seconds)"
up_to "$LINES" 9 || die "--lines: got '$LINES'; accepted: an integer 0-999999999"
up_to "$NPROC" 4 && (( 10#$NPROC >= 1 )) || die "--nproc: got '$NPROC'; accepted: an integer 1-9999"
TIMEOUT=$((10#$TIMEOUT)) LINES=$((10#$LINES)) NPROC=$((10#$NPROC))   # "08" is not octal here
if [[ -n "$TAG" && ( ! "$TAG" =~ ^[A-Za-z0-9._-]+$ || "$TAG" == . || "$TAG" == .. ) ]]; then   # '..': the base dir
  die "--model-tag: got '$TAG'; accepted: letters, digits, '.', '_' and '-' (not '.' or '..')"
fi
if [[ "$MODE" != start && ${#TRAIN_ARGS[@]} -gt $((2 * TAG_GIVEN)) ]]; then
  die "--$MODE: takes only --model-tag, --base-dir, --lines (status) and --timeout (stop); got: ${TRAIN_ARGS[*]}"
fi
RUNS_DIR="$BASE_DIR/runs"
self_cmd() {  # this script as typed from here, with --base-dir unless it is the default: the --status /
              # --stop commands it prints (without it they looked in ~/.cache/nanochat, and --stop said
              # "not running" while the run went on; ./run_train.sh names nothing outside the repo)
  local self="$0" where=""
  [[ "$self" == */* ]] || self="./$self"
  [[ "$BASE_DIR" -ef "$HOME/.cache/nanochat" ]] || where=" --base-dir $(printf '%q' "$BASE_DIR")"
  echo "$(printf '%q' "$self")$where"
}

# ---------------------------------------------------------------- pid bookkeeping
run_alive() {  # pid -> 0 if that process exists and is one of our training runs
  local pid="$1" args
  is_uint "$pid" || return 1
  kill -0 "$pid" 2>/dev/null || return 1
  # -ww: ps cuts args at $COLUMNS when it is in the environment (pytest, some CI runners and shells
  # export it): a torchrun command line in a long venv path lost its scripts.base_train at 80
  # characters, and --status / --stop took the live run for a dead one (its pid file removed)
  args="$(ps -ww -o args= -p "$pid" 2>/dev/null || true)"
  [[ "$args" == *scripts.base_train* ]]
}
read_pid() { [[ -f "$1/pid" ]] && tr -dc '0-9' < "$1/pid" || true; }
descendants() {  # pid -> every process below it, parents first (ps --ppid walks one level)
  local todo=("$1") p c
  while [[ ${#todo[@]} -gt 0 ]]; do
    p="${todo[0]}"; todo=("${todo[@]:1}")
    for c in $(ps -o pid= --ppid "$p" 2>/dev/null || true); do echo "$c"; todo+=("$c"); done
  done
}
torchrun_workers() {  # pid -> the workers below it: torchrun starts each in a session of its own
  local c parent
  for c in $(descendants "$1"); do
    [[ "$(ps -o sid= -p "$c" 2>/dev/null | tr -d ' ')" == "$c" ]] || continue
    parent="$(ps -o ppid= -p "$c" 2>/dev/null | tr -d ' ')"
    [[ -n "$parent" && "$(ps -ww -o args= -p "$parent" 2>/dev/null)" == *torch.distributed.run* ]] && echo "$c"
  done
  return 0
}
last_step() {  # log -> "step N/M" of the last step line of the latest start, or "none yet"
  local line   # (the log is appended to: a run just restarted must not show the one before's)
  line="$(awk '/^==> run_train.sh started/ {s = ""} match($0, /^step [0-9]+\/[0-9]+/) {s = substr($0, 1, RLENGTH)}
               END {print s}' "$1" 2>/dev/null || true)"
  echo "${line:-none yet}"
}

status_one() {  # dir -> prints the report; returns 0 if running, 3 if not
  local dir="$1" tag pid rc=3 state
  tag="$(basename "$dir")"; pid="$(read_pid "$dir")"
  if [[ -n "$pid" ]] && run_alive "$pid"; then
    state="running (pid $pid)"; rc=0
  else
    if [[ -n "$pid" ]]; then rm -f "$dir/pid"; fi   # stale: the process is gone
    if [[ -f "$dir/exit_code" ]] && tail -n 3 "$dir/train.log" 2>/dev/null | grep -q "^stopped by run_train.sh --stop"; then
      # torchrun ends with 1 when its workers stop on a signal (they exit 143): not a crash
      state="not running (stopped by --stop, exit code $(cat "$dir/exit_code"); continue with --resume latest)"
    elif [[ -f "$dir/exit_code" ]]; then
      local code; code="$(cat "$dir/exit_code")"
      case "$code" in   # not "finished" for a crash
        0) state="not running (finished, exit code 0)" ;;
        130|143) state="not running (stopped by a signal, exit code $code; continue with --resume latest)" ;;
        137) state="not running (killed by SIGKILL, exit code 137: out of memory? see the log)" ;;
        *) state="not running (failed, exit code $code: see the log)" ;;
      esac
    elif tail -n 1 "$dir/train.log" 2>/dev/null | grep -q "^killed by run_train.sh --stop"; then
      state="not running (killed by --stop after its --timeout, maybe before its save: --resume latest takes the newest checkpoint saved)"
    elif [[ -f "$dir/train.log" ]]; then
      # started (the start clears exit_code), never ended by itself: its wrapper died with it. Said every
      # time, not only while a stale pid file is there to remove (the second --status said just "not running")
      state="not running (died without an exit code${pid:+, pid $pid gone (removed its stale pid file)}: killed with its"
      state+=" wrapper (a kill -9 of its process group) or the machine restarted; see the log's"
      state+=" end; continue with --resume latest)"
    else state="not running${pid:+ (pid $pid is gone; removed its stale pid file)}"; fi
  fi
  echo "[$tag] $state"
  echo "  log:       $dir/train.log"
  [[ -f "$dir/cmd" ]] && echo "  command:   $(cat "$dir/cmd")"
  echo "  last step: $(last_step "$dir/train.log")"
  if [[ "$LINES" -gt 0 && -f "$dir/train.log" ]]; then
    echo "  last $LINES log lines:"
    tail -n "$LINES" "$dir/train.log" | sed 's/^/    /'
  fi
  return $rc
}

# ---------------------------------------------------------------- --status
if [[ "$MODE" == status ]]; then
  if [[ -n "$TAG" ]]; then
    [[ -d "$RUNS_DIR/$TAG" ]] || { echo "[$TAG] not running (no run has been started with this tag in $RUNS_DIR)"; exit 3; }
    status_one "$RUNS_DIR/$TAG" && exit 0 || exit $?
  fi
  shopt -s nullglob; dirs=("$RUNS_DIR"/*/); shopt -u nullglob
  [[ ${#dirs[@]} -gt 0 ]] || { echo "no runs in $RUNS_DIR"; exit 3; }
  any=3
  for d in "${dirs[@]}"; do status_one "${d%/}" && any=0 || true; done
  exit $any
fi

# ---------------------------------------------------------------- --stop
if [[ "$MODE" == stop ]]; then
  if [[ -z "$TAG" ]]; then
    running=()
    shopt -s nullglob
    for d in "$RUNS_DIR"/*/; do p="$(read_pid "${d%/}")"; [[ -n "$p" ]] && run_alive "$p" && running+=("$(basename "$d")"); done
    shopt -u nullglob
    [[ ${#running[@]} -gt 0 ]] || { say "no run is running in $RUNS_DIR"; exit 0; }
    [[ ${#running[@]} -eq 1 ]] || die "--model-tag: several runs are running (${running[*]}); name one with --model-tag"
    TAG="${running[0]}"
  fi
  dir="$RUNS_DIR/$TAG"; pid="$(read_pid "$dir")"
  if [[ -z "$pid" ]] || ! run_alive "$pid"; then
    [[ -n "$pid" ]] && rm -f "$dir/pid"
    say "[$TAG] is not running in $RUNS_DIR${pid:+ (removed the stale pid file of pid $pid)}"; exit 0
  fi
  # Under torchrun the workers get the SIGTERM themselves: signalled, torchrun would pass it on
  # and SIGKILL them 30 s later (its default), which a step plus a save can outlast. Once they
  # have saved and exited, torchrun ends by itself. Without workers (one process, or torchrun
  # still starting them) the process group gets it.
  workers=($(torchrun_workers "$pid"))
  if [[ ${#workers[@]} -gt 0 ]]; then
    say "[$TAG] sending SIGTERM to the ${#workers[@]} torchrun workers (${workers[*]}); waiting up to ${TIMEOUT} s (the run saves a checkpoint first)"
    kill -TERM "${workers[@]}" 2>/dev/null || true
  else
    say "[$TAG] sending SIGTERM to process group $pid; waiting up to ${TIMEOUT} s (the run saves a checkpoint first)"
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  fi
  deadline_ns=$(( $(date +%s%N) + TIMEOUT * 1000000000 ))
  while run_alive "$pid" && (( $(date +%s%N) < deadline_ns )); do sleep 0.2; done
  killed=0
  if run_alive "$pid"; then
    killed=1
    say "[$TAG] still alive after ${TIMEOUT} s: sending SIGKILL"
    # the process group, and every process below the run (torchrun's workers sit in sessions of
    # their own, and would outlive a dead torchrun holding their GPUs)
    below=($(descendants "$pid"))
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    [[ ${#below[@]} -gt 0 ]] && { kill -KILL "${below[@]}" 2>/dev/null || true; }
    for _ in $(seq 50); do run_alive "$pid" || break; sleep 0.1; done
    run_alive "$pid" && die "[$TAG] pid $pid survived SIGKILL"
  fi
  rm -f "$dir/pid"
  if (( killed )); then   # maybe no save at the stop: not "stopped" as if it had saved
    echo "killed by run_train.sh --stop (SIGKILL after ${TIMEOUT} s) at $(date -u +%FT%TZ)" >> "$dir/train.log"
    say "[$TAG] killed (last step logged: $(last_step "$dir/train.log")) before it finished stopping: --resume" \
        "latest continues from the newest checkpoint it saved (the stop's if it got to save it, else its last" \
        "--save-every one, if any)"
  else
    echo "stopped by run_train.sh --stop at $(date -u +%FT%TZ)" >> "$dir/train.log"
    say "[$TAG] stopped (last step: $(last_step "$dir/train.log"))"
  fi
  exit 0
fi

# ---------------------------------------------------------------- start
[[ -n "$PYTHON" ]] || die "no Python found: run ./setup.sh --only env first (or set NANOCHAT_PYTHON)"
# a bad NANOCHAT_PYTHON ended in env's "No such file or directory" (exit 127) or a Python's traceback
PY_OK="accepted: a Python with this project installed (default $REPO/.venv/bin/python, which ./setup.sh --only env builds)"
if [[ -n "${NANOCHAT_PYTHON:-}" ]]; then
  command -v "$PYTHON" >/dev/null 2>&1 || die "NANOCHAT_PYTHON: got '$PYTHON' (no such program); $PY_OK"
fi
export RUN_TRAIN_PY_OK="$PY_OK"   # the check below names the interpreter when it lacks a module
# the base dir's flag named as the user gave it: base_train's own check below blames NANOCHAT_BASE_DIR
# (which this script sets from --base-dir) and says "set NANOCHAT_BASE_DIR" to a --base-dir user
existing="$BASE_DIR" from=--base-dir; [[ $BASE_DIR_GIVEN -eq 1 ]] || from=NANOCHAT_BASE_DIR
while [[ ! -e "$existing" && "$existing" != / ]]; do existing="$(dirname "$existing")"; done
[[ -d "$existing" && -w "$existing" ]] || die "$from: got '$BASE_DIR' ('$existing' is not a directory you can" \
  "write to); accepted: a writable directory, existing or one that can be made"
if [[ -z "$TAG" ]]; then
  if [[ -n "$DEPTH" ]]; then
    is_uint "$DEPTH" || die "--depth: got '$DEPTH'; accepted: an integer 1..256"
    TAG="d$((10#$DEPTH))"   # base_train's own default: --depth 012 trains d12
  else TAG="d20"; fi
fi
# --fsdp shards over torchrun's processes, and --nproc 1 runs plain python: base_train's own refusal
# told the user to launch torchrun by hand, not that this script's --nproc is the way to it
if (( NPROC == 1 )); then
  for a in "${TRAIN_ARGS[@]}"; do
    [[ "$a" != --fsdp ]] || die "--fsdp: got it with --nproc 1 (one plain python process, no torchrun);" \
      "accepted: --fsdp with --nproc 2 or more (it shards the model over the run's processes), or leave --fsdp out"
  done
fi
# base_train's own validation (flag names, batch arithmetic over --nproc ranks, devices, and its
# first checks of the disk: tokenizer, shards, checkpoints) before anything starts.
export NANOCHAT_BASE_DIR="$BASE_DIR"
rank_env=(WORLD_SIZE="$NPROC"); (( NPROC > 1 )) && rank_env+=(RANK=0)   # as torchrun will set them
(cd "$REPO" && env "${rank_env[@]}" "$PYTHON" - "$NPROC" "${TRAIN_ARGS[@]}" <<'EOF'
import os
import sys

try:
    import torch

    from scripts.base_train import parse_config
except ImportError as e:   # another Python (NANOCHAT_PYTHON, or python3 without a .venv)
    who = f"NANOCHAT_PYTHON: got '{os.environ['NANOCHAT_PYTHON']}'" if os.environ.get("NANOCHAT_PYTHON") \
        else f"the interpreter {sys.executable}"
    print(f"run_train.sh: error: {who}, which cannot import {e.name or e}; {os.environ['RUN_TRAIN_PY_OK']}",
          file=sys.stderr)
    sys.exit(2)


def check_device(device: str, nproc: int) -> None:
    """The device for --nproc processes, as each worker's init_runtime will resolve it: found here,
    not after torchrun has started nproc workers that each fail (or fight over one GPU) in the log."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            raise ValueError("--device cuda: no CUDA device is visible; use --device cpu or auto")
        if nproc > gpus:
            raise ValueError(f"--nproc: got {nproc} with {gpus} GPU(s) visible; accepted: 1..{gpus} "
                             "(one process per GPU; CUDA_VISIBLE_DEVICES narrows the set)")
    elif device == "mps" and not torch.backends.mps.is_available():
        raise ValueError("--device mps: the MPS backend is not available on this machine; use --device cpu or auto")
    elif device == "mps" and nproc > 1:
        raise ValueError(f"--nproc: got {nproc} on --device mps; accepted: 1 (torchrun is not supported on MPS)")
    elif device == "cpu" and nproc > (os.cpu_count() or 1):
        print(f"run_train.sh: WARNING: --nproc {nproc} on --device cpu with {os.cpu_count()} CPU core(s): "
              "each process gets less than a core", file=sys.stderr)


def check_free(cfg) -> bool:
    """A run already saving into this tag's checkpoint directory (./setup.sh's pretrain stage, a
    base_train in another terminal) would refuse this one in the log only: say it here. False: a
    run this script started is alive there (the shell refuses the start, naming its pid and --stop)."""
    from nanochat.checkpoint import checkpoint_dir
    from nanochat.common import get_base_dir
    from nanochat.writer_lock import holder, refusal

    tag = cfg.model_tag or f"d{cfg.depth}"
    try:
        os.kill(int((get_base_dir() / "runs" / tag / "pid").read_text()), 0)
        return False
    except (OSError, ValueError):
        pass
    ckpt_dir = checkpoint_dir("base", tag, get_base_dir())
    who = holder(ckpt_dir)
    if who:
        raise ValueError(refusal(ckpt_dir, who))
    return True


def check_inputs(cfg, nproc: int) -> None:
    """What base_train refuses in its first seconds, with its own calls and words: no tokenizer, no
    data shards, --resume latest|STEP without that checkpoint, a fresh start into a tag that holds
    checkpoints (the same command again after a --stop), a resume (auto too) that these flags cannot
    continue (another --depth, --max-seq-len, total batch, --nproc or --recipe; a checkpoint past
    --num-iterations). Refused in the log only, the start said "started" and exited 0 while the run
    had already ended."""
    from pathlib import Path

    from nanochat import binshards, dataset
    from nanochat.checkpoint import checkpoint_dir
    from nanochat.common import get_base_dir
    from nanochat.tokenizer import get_tokenizer
    from scripts.base_train import plan_run

    tokenizer = get_tokenizer(get_base_dir())
    data_dir = Path(cfg.data_dir) if cfg.data_dir else dataset.default_data_dir()
    if not binshards.list_bin_shards(binshards.default_bin_dir(data_dir)):   # else the loader checks them
        dataset.split_shards(dataset.list_shards(data_dir), "train")
    ckpt_dir = checkpoint_dir("base", cfg.model_tag or f"d{cfg.depth}", get_base_dir())
    # base_train's own checks of the flags against the tag's checkpoints (meta.json; no writer holds
    # the directory: check_free), its --resume auto line left to the run's log
    plan_run(cfg, tokenizer, nproc, ckpt_dir, log=lambda line: None)


try:
    cfg = parse_config(sys.argv[2:])
    check_device(cfg.device, int(sys.argv[1]))
    if check_free(cfg):
        check_inputs(cfg, int(sys.argv[1]))
except ValueError as e:
    print(f"run_train.sh: error: {e}", file=sys.stderr)
    sys.exit(2)
EOF
) || exit $?

dir="$RUNS_DIR/$TAG"
mkdir -p "$dir"
exec 9>"$dir/lock"
flock -n 9 || die "[$TAG] another run_train.sh is starting this tag right now"
pid="$(read_pid "$dir")"
if [[ -n "$pid" ]]; then
  if run_alive "$pid"; then
    echo "run_train.sh: error: [$TAG] a run is already running (pid $pid, log $dir/train.log); stop it with" \
         "'$(self_cmd) --stop --model-tag $TAG' or pick another --model-tag" >&2
    exit 1
  fi
  say "[$TAG] removing the stale pid file of pid $pid (that process is gone)"
  rm -f "$dir/pid"
fi

if (( NPROC > 1 )); then
  # torchrun SIGKILLs its workers this long after passing a Ctrl-C / SIGTERM on (torch versions
  # with --shutdown-timeout; 30 s otherwise): the loop finishes its step and saves first
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-3600}"
  launcher=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m scripts.base_train)
  # torchrun (Python 3.11's argparse) reads the script's --run as an ambiguous prefix of its own
  # --run-path and exits 2 in the log after "started": base_train takes --run-name for it (nanochat/flags.py)
  for i in "${!TRAIN_ARGS[@]}"; do
    case "${TRAIN_ARGS[$i]}" in --run) TRAIN_ARGS[$i]=--run-name ;; --run=*) TRAIN_ARGS[$i]="--run-name=${TRAIN_ARGS[$i]#--run=}" ;; esac
  done
else
  launcher=("$PYTHON" -m scripts.base_train)
fi
cmd=("${launcher[@]}" "${TRAIN_ARGS[@]}")
printf '%q ' "${cmd[@]}" | sed 's/ $//' > "$dir/cmd"
rm -f "$dir/exit_code"
{ echo "==> run_train.sh started at $(date -u +%FT%TZ) on $(hostname): $(cat "$dir/cmd")"; } >> "$dir/train.log"
# setsid: the run leads its own process group (--stop signals it, or torchrun's workers) and the
# wrapper shell writes its pid before exec'ing nothing else: `$$` is the group id we signal. The
# wrapper traps TERM (a no-op: children get the default back) so that it outlives the SIGTERM the
# whole group gets and --stop waits while the training loop saves its checkpoint.
cd "$REPO"
nohup setsid bash -c 'echo $$ > "$0/pid.tmp" && mv -f "$0/pid.tmp" "$0/pid"; shift; trap ":" TERM
  "$@"; rc=$?; echo $rc > "$0/exit_code"; echo "==> exited with code $rc at $(date -u +%FT%TZ)"; exit $rc' \
  "$dir" _ "${cmd[@]}" >> "$dir/train.log" 2>&1 < /dev/null 9>&- &
for _ in $(seq 100); do [[ -f "$dir/pid" ]] && break; sleep 0.05; done
pid="$(read_pid "$dir")"
[[ -n "$pid" ]] || die "[$TAG] the run did not start (no pid file after 5 s); see $dir/train.log"
say "[$TAG] started pid $pid"
say "  log:    $dir/train.log   (tail -f it)"
say "  status: $(self_cmd) --status --model-tag $TAG"
say "  stop:   $(self_cmd) --stop --model-tag $TAG"
