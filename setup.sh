#!/usr/bin/env bash
# nanochat-spark set-up and main job: check the machine, build the environment, then run the
# pipeline stage by stage (data -> tokenizer -> base -> eval -> mid -> SFT -> chat eval -> report).
# Every stage writes a done-marker holding its exact command and the files it left (relative to
# the base dir: a base dir moved or copied keeps its finished stages); a rerun skips stages whose
# command is unchanged and outputs are there, reruns the others, and every stage after a model
# stage that ran, in that run or (stopped, or under --only) the next (MODEL_MAKERS below).
# `./setup.sh --help` for options.
set -euo pipefail
# bash reads a script as it runs it: the braces make it read all of it first, so an edit to this file
# during a days-long run (saved in place) cannot have the run go on from an old offset in the new text
{
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CALLER_DIR="$PWD"   # relative paths in the flags are the caller's
ORIG_ARGS=("$@")    # for the "rerun" hints: a plain ./setup.sh would drop e.g. --depth 12 and train another model
cd "$REPO"

# chat_eval evaluates the SFT model; RL (python -m scripts.chat_rl) is optional and not a stage.
STAGES=(env data tokenizer tok_eval base_train base_eval mid_train chat_sft chat_eval report)

usage() {
  cat <<EOF
Usage: ./setup.sh [--preset auto|tiny|spark|h100] [options]

Builds .venv (uv, torch for this machine, the project, the Rust tokenizer) and runs the pipeline:
  ${STAGES[*]}

Options:
  --preset NAME      auto (default: spark on a GB10, h100 on Hopper and other GPUs, tiny
                     without a GPU; GPUs all hidden by CUDA_VISIBLE_DEVICES are refused: name
                     --preset tiny to run on the CPU),
                     tiny (offline demo: Shakespeare, a tiny model, minutes on a CPU),
                     spark (DGX Spark defaults), h100 (one H100/H200; on a GPU with less
                     memory the device batch is lowered to fit, the total batch kept)
  --depth N          model depth instead of the preset's (tiny 2, spark/h100 20), 1-64: on
                     spark/h100 the training tokens (20 per scaling parameter), the data shards
                     downloaded and the device batch follow it; e.g. --depth 12 trains ~4x fewer
                     tokens (tiny keeps its 250 steps of 4,096 tokens)
  --device-batch-size N
                     sequences per GPU micro-batch instead of the preset's (fitted to the GPU's
                     memory); the total batch is kept by gradient accumulation, so lower it after
                     an out-of-memory stop and rerun: the stage resumes from its last checkpoint
  --only S1,S2       run only these stages (others are neither run nor checked)
  --from STAGE       start at STAGE (earlier stages must already be done: their done-markers
                     are checked); not with --only
  --force            rerun stages even if their done-marker matches
  --install-rust     install a Rust toolchain with rustup if cargo is missing
  --conversations F  a JSONL file of your own conversations ({"messages": [...]} per line) for
                     mid_train and chat_sft (their --extra-conversations); repeat for more files
  --identity NAME    the model's name in the built-in identity conversations (default
                     nanochat-spark; 1-64 printable characters)
  --no-identity      train mid / SFT without the built-in identity conversations
  --base-dir DIR     artefact directory (default \$NANOCHAT_BASE_DIR or ~/.cache/nanochat); one
                     moved or copied elsewhere keeps its finished stages
  --dry-run          print what would run, run nothing
  --list-stages      print the stage names, one per line, and exit
  -h, --help         this text
Environment: WANDB_RUN=name turns on wandb logging; TORCH_INDEX_URL overrides the torch wheel index.
Ctrl-C, a hangup (the ssh connection drops; the output then goes to <base dir>/hangup.log) or a
SIGTERM stops a training stage after its step and a checkpoint (exit 130 / 129 / 143); rerun
the command it prints (yours, flags and all) to continue.
EOF
}

die() { echo "setup.sh: error: $*" >&2; exit 2; }
say() { echo "==> $*"; }
warn() { echo "setup.sh: warning: $*" >&2; }

PRESET=auto DBS_FLAG="" DBS_GIVEN=0 ONLY="" FROM="" FORCE=0 INSTALL_RUST=0 DRY_RUN=0 DEPTH_FLAG="" DEPTH_GIVEN=0 NO_IDENTITY=0 IDENTITY=""
# *_GIVEN: the flag was given, so its value is checked whatever it is (an empty one is an error, not "not given")
ONLY_GIVEN=0 FROM_GIVEN=0 IDENTITY_GIVEN=0 BASE_DIR_GIVEN=0 LIST_STAGES=0
CONV_FILES=()
add_conversations() {  # a --conversations value: an existing file, kept as an absolute path
  local f="$1"
  # as --base-dir: `--conversations=~/c.jsonl` arrives with its ~ (a home file said not to exist), and
  # one spelling per file, since the mid / SFT done-markers record it (./c.jsonl or c.jsonl, or the
  # same file named from another directory, must not read as a changed config and rerun the chat stages)
  [[ "$f" != "~/"* ]] || f="$HOME/${f:2}"
  [[ "$f" == /* ]] || f="$CALLER_DIR/$f"
  f="$(realpath -m -- "$f" 2>/dev/null || printf '%s' "$f")"   # symlinks first: "link/.." is where the OS goes
  [[ -f "$f" ]] || die "--conversations: got '$1'; accepted: an existing JSONL file of conversations"
  CONV_FILES+=("$f")
}
BASE_DIR="${NANOCHAT_BASE_DIR:-$HOME/.cache/nanochat}"
ENV_BASE_DIR="${NANOCHAT_BASE_DIR:-}"   # given in the environment (the rerun hints repeat it)
while [[ $# -gt 0 ]]; do
  case "$1" in
    --preset) [[ $# -ge 2 ]] || die "--preset needs a value (auto|tiny|spark|h100)"; PRESET="$2"; shift 2 ;;
    --preset=*) PRESET="${1#*=}"; shift ;;
    --depth) [[ $# -ge 2 ]] || die "--depth needs a value (an integer 1-64)"; DEPTH_FLAG="$2"; DEPTH_GIVEN=1; shift 2 ;;
    --depth=*) DEPTH_FLAG="${1#*=}"; DEPTH_GIVEN=1; shift ;;
    --device-batch-size) [[ $# -ge 2 ]] || die "--device-batch-size needs a value (an integer 1-1024)"; DBS_FLAG="$2"; DBS_GIVEN=1; shift 2 ;;
    --device-batch-size=*) DBS_FLAG="${1#*=}"; DBS_GIVEN=1; shift ;;
    --only) [[ $# -ge 2 ]] || die "--only needs a comma-separated list of stages"; ONLY="$2"; ONLY_GIVEN=1; shift 2 ;;
    --only=*) ONLY="${1#*=}"; ONLY_GIVEN=1; shift ;;
    --from) [[ $# -ge 2 ]] || die "--from needs a stage name"; FROM="$2"; FROM_GIVEN=1; shift 2 ;;
    --from=*) FROM="${1#*=}"; FROM_GIVEN=1; shift ;;
    --force) FORCE=1; shift ;;
    --install-rust) INSTALL_RUST=1; shift ;;
    --conversations) [[ $# -ge 2 ]] || die "--conversations needs a JSONL file"; add_conversations "$2"; shift 2 ;;
    --conversations=*) add_conversations "${1#*=}"; shift ;;
    --identity) [[ $# -ge 2 ]] || die "--identity needs a name"; IDENTITY="$2"; IDENTITY_GIVEN=1; shift 2 ;;
    --identity=*) IDENTITY="${1#*=}"; IDENTITY_GIVEN=1; shift ;;
    --no-identity) NO_IDENTITY=1; shift ;;
    --base-dir) [[ $# -ge 2 ]] || die "--base-dir needs a directory"; BASE_DIR="$2"; BASE_DIR_GIVEN=1; shift 2 ;;
    --base-dir=*) BASE_DIR="${1#*=}"; BASE_DIR_GIVEN=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --list-stages) LIST_STAGES=1; shift ;;   # after the checks below: a bad flag is not ignored
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see ./setup.sh --help)" ;;
  esac
done

case "$PRESET" in auto|tiny|spark|h100) ;; *) die "--preset: got '$PRESET'; accepted: auto|tiny|spark|h100" ;; esac
BASE_DIR_FROM=--base-dir; [[ $BASE_DIR_GIVEN -eq 1 ]] || BASE_DIR_FROM=NANOCHAT_BASE_DIR
BASE_DIR_OK="accepted: a directory (made if missing), not an existing file or a path under one"
[[ -n "$BASE_DIR" ]] || die "$BASE_DIR_FROM: got ''; $BASE_DIR_OK"   # "" would be the caller's directory
# a value left out (`--base-dir $UNSET_VAR --dry-run`) took the next flag as the directory: a real run
# began in ./--dry-run instead of the dry run asked for
[[ $BASE_DIR_GIVEN -eq 0 || "$BASE_DIR" != -* ]] \
  || die "--base-dir: got '$BASE_DIR' (a flag, not a directory: its value left out?); $BASE_DIR_OK (./$BASE_DIR for a name starting with '-')"
BASE_DIR_ARG="$BASE_DIR"
# the shell expands ~ only at a word's start: `--base-dir=~/nc` (or a quoted "~/nc") arrives as is,
# and read as relative it made a directory named '~' in the caller's directory
[[ "$BASE_DIR" != "~" && "$BASE_DIR" != "~/"* ]] || BASE_DIR="$HOME${BASE_DIR:1}"
[[ "$BASE_DIR" == /* ]] || BASE_DIR="$CALLER_DIR/$BASE_DIR"   # the stages run in the repo, not where you are
# one spelling per directory (the done-markers record it): "dir/", "dir//" or "./dir" must not read
# as another base dir and rerun every stage. Lexical (-s): a symlinked home keeps the path it had.
BASE_DIR="$(realpath -ms -- "$BASE_DIR" 2>/dev/null || printf '%s' "$BASE_DIR")"
existing="$BASE_DIR"   # its nearest existing part must be a directory, or mkdir fails hours later
while [[ ! -e "$existing" && "$existing" != / ]]; do existing="$(dirname "$existing")"; done
[[ -d "$existing" ]] || die "$BASE_DIR_FROM: got '$BASE_DIR_ARG' ('$existing' is not a directory); $BASE_DIR_OK"
if [[ $IDENTITY_GIVEN -eq 1 ]]; then   # nanochat/tasks/identity.py's rule (bar its Unicode cases), before hours of training
  [[ ${#IDENTITY} -ge 1 && ${#IDENTITY} -le 64 && "$IDENTITY" != " "* && "$IDENTITY" != *" " && "$IDENTITY" != *[[:cntrl:]]* ]] \
    || die "--identity: got '$IDENTITY'; accepted: a name of 1-64 printable characters (no leading or trailing spaces)"
  # '-x': mid/SFT's argparse takes it for a flag (after base training); `--identity $UNSET --dry-run` ran for real
  [[ "$IDENTITY" != -* ]] || die "--identity: got '$IDENTITY' (a flag, not a name: its value left out?);" \
    "accepted: a name of 1-64 printable characters not starting with '-'"
  [[ $NO_IDENTITY -eq 0 ]] || die "--identity: got '$IDENTITY' and --no-identity; accepted: one of the two"
fi
if [[ $DEPTH_GIVEN -eq 1 ]] && ! { [[ "$DEPTH_FLAG" =~ ^[0-9]{1,3}$ ]] && (( 10#$DEPTH_FLAG >= 1 && 10#$DEPTH_FLAG <= 64 )); }; then
  die "--depth: got '$DEPTH_FLAG'; accepted: an integer 1-64"
fi
if [[ $DBS_GIVEN -eq 1 ]] && ! { [[ "$DBS_FLAG" =~ ^[0-9]{1,4}$ ]] && (( 10#$DBS_FLAG >= 1 && 10#$DBS_FLAG <= 1024 )); }; then
  die "--device-batch-size: got '$DBS_FLAG'; accepted: an integer 1-1024"
fi
valid_stage() { local s; for s in "${STAGES[@]}"; do [[ "$s" == "$1" ]] && return 0; done; return 1; }
# an empty --only / --from would otherwise read as "not given" and run every stage
if [[ $ONLY_GIVEN -eq 1 && ! "$ONLY" =~ ^[^,]+(,[^,]+)*$ ]]; then
  die "--only: got '$ONLY' (an empty stage name); accepted: a comma-separated list of: ${STAGES[*]}"
fi
IFS=',' read -r -a ONLY_LIST <<< "$ONLY"
for s in "${ONLY_LIST[@]}"; do valid_stage "$s" || die "--only: unknown stage '$s'; accepted: ${STAGES[*]}"; done
[[ $FROM_GIVEN -eq 0 ]] || valid_stage "$FROM" || die "--from: got '$FROM'; accepted: one of ${STAGES[*]}"
[[ $ONLY_GIVEN -eq 0 || $FROM_GIVEN -eq 0 ]] \
  || die "--only and --from: got both (--only '$ONLY', --from '$FROM'); accepted: one of the two"
if [[ $LIST_STAGES -eq 1 ]]; then printf '%s\n' "${STAGES[@]}"; exit 0; fi

# ---------------------------------------------------------------- stage bookkeeping
source "$REPO/scripts/setup_stages.sh"   # should_run, run_stage, rerun_cmd, the signal handling they use
source "$REPO/scripts/setup_gpus.sh"     # visible_gpu_row, visible_gpu_count, hidden_gpus: the GPU CUDA will use
source "$REPO/scripts/setup_batch.sh"    # choose_device_batch: the device batch that fits this machine

# --from skips the stages before it, so they must have finished (the env stage's marker lives in
# .venv and is not checked). A dry run says so and still lists what would run. The way on is the
# user's own command with another --from: a bare `./setup.sh --from data` dropped e.g. --base-dir and
# --preset, and looked for that stage in another base dir.
STATE_DIR="$BASE_DIR/setup_state"
if [[ -n "$FROM" ]]; then
  for s in "${STAGES[@]}"; do
    [[ "$s" != "$FROM" ]] || break
    [[ "$s" == env || -f "$STATE_DIR/$s.done" ]] && continue
    msg="--from: got '$FROM', but the earlier stage '$s' has not finished (no $STATE_DIR/$s.done); accepted: a stage after finished ones, so rerun with --from $s ($(rerun_cmd "$s")) or without --from"
    if [[ $DRY_RUN -eq 1 ]]; then warn "$msg"; else die "$msg"; fi
    break
  done
fi
say_if_moved   # one line when this base dir was elsewhere when setup.sh last ran on it

# ---------------------------------------------------------------- machine checks (no installs)
ARCH="$(uname -m)"; OS="$(uname -s)"
[[ "$OS" == "Linux" ]] || warn "only Linux is tested (found $OS)"
GPU_NAME="" GPU_CC="" DRIVER="" GPU_MEM_MIB="" GPU_COUNT=0 HIDDEN_GPUS=0   # HIDDEN_GPUS: listed, all hidden by CUDA_VISIBLE_DEVICES
# nvidia-smi there but failing (a driver not loaded after a reboot or a kernel update, a GPU fallen off
# the bus) is not "no GPU": --preset auto took it for a CPU machine and a rerun meant to continue a
# GPU run went on as the tiny preset, its tokenizer stage overwriting the run's tokenizer
SMI_ERROR=""
if command -v nvidia-smi >/dev/null 2>&1; then
  smi_rc=0; smi_out="$(nvidia-smi 2>&1)" || smi_rc=$?
  if (( smi_rc == 0 )); then
    # one line per GPU: `sed -n 1p` reads them all, where `head -n1` could end first and a nvidia-smi
    # still writing died of SIGPIPE, which pipefail + set -e made the end of setup.sh (exit 141)
    GPU_COUNT="$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c . || true)"
    GPU_ROW="$(visible_gpu_row)"   # the stages run on CUDA's device 0: size for it, not nvidia-smi's first GPU
    if [[ -n "$GPU_ROW" ]]; then
      GPU_NAME="$(nvidia-smi --query-gpu=name --format=csv,noheader | sed -n "${GPU_ROW}p")"
      GPU_CC="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | sed -n "${GPU_ROW}p" || true)"
      GPU_MEM_MIB="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | sed -n "${GPU_ROW}p" || true)"
      [[ -z "${CUDA_VISIBLE_DEVICES:-}" ]] || GPU_COUNT="$(visible_gpu_count)"
    fi
    if [[ -z "$GPU_ROW" || "$GPU_COUNT" == 0 ]]; then   # (said, or refused, with the preset below; a
      # repeated entry such as "0,0" names a GPU first yet shows CUDA none)
      HIDDEN_GPUS="$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c . || true)" GPU_COUNT=0
      GPU_NAME="" GPU_CC="" GPU_MEM_MIB=""
    fi
    DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | sed -n 1p)"
  else
    SMI_ERROR="exit $smi_rc: $(printf '%s\n' "$smi_out" | grep -m1 . || true)"
  fi
fi
CUDA_DRIVER_VERSION=""
if [[ -n "$DRIVER" ]]; then   # (with every GPU hidden too: the machine line said a blank "CUDA ")
  CUDA_DRIVER_VERSION="$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -n1)"
fi
# The torch wheel index: a driver runs CUDA runtimes of its own major version up to the "CUDA
# Version" nvidia-smi prints (minor-version compatibility), never a newer major. PyPI's Linux torch
# wheels are CUDA 13 builds (torch 2.15: cu132), which a CUDA 12 driver (535-575, still common on
# cloud images) cannot run: torch would import, see no GPU and train on the CPU. PyTorch's own
# indexes keep CUDA 12 builds: cu126 for any 12.x driver, cu128 (which adds Blackwell) from 12.8.
TORCH_INDEX=""
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  TORCH_INDEX="$TORCH_INDEX_URL"
elif [[ -n "$GPU_NAME" ]]; then
  drv_major="${CUDA_DRIVER_VERSION%%.*}" drv_minor=0
  [[ "$CUDA_DRIVER_VERSION" == *.* ]] && drv_minor="$(echo "$CUDA_DRIVER_VERSION" | cut -d. -f2)"
  if [[ ! "$drv_major" =~ ^[0-9]+$ || ! "$drv_minor" =~ ^[0-9]+$ ]]; then
    warn "could not read the driver's CUDA version from nvidia-smi; installing torch for CUDA 13 (set TORCH_INDEX_URL to choose)"
    drv_major=13
  fi
  # A GPU older than Turing (cc < 7.5: V100, P100, GTX 10xx) has no kernels in the CUDA 13 and cu128
  # builds (torch 2.15+cu132 lists sm_75..sm_120), where is_available() still says True and the first
  # kernel fails ("no kernel image is available"), days into the pipeline; cu126 keeps sm_50..sm_70.
  pre_turing=0
  [[ "$GPU_CC" =~ ^([0-9]+)\.([0-9])$ ]] && (( BASH_REMATCH[1] * 10 + BASH_REMATCH[2] < 75 )) && pre_turing=1
  if (( drv_major >= 12 && pre_turing )); then
    TORCH_INDEX=https://download.pytorch.org/whl/cu126
    say "the $GPU_NAME (cc $GPU_CC) predates the sm_75 floor of torch's CUDA 12.8+ builds: torch from $TORCH_INDEX"
  elif (( drv_major >= 13 )); then
    # DGX Spark (aarch64): PyTorch's CUDA 13 (cu130) aarch64 wheels (DESIGN.md pitfall 4); x86-64: PyPI
    [[ "$ARCH" == aarch64 ]] && TORCH_INDEX=https://download.pytorch.org/whl/cu130
  elif (( drv_major == 12 && drv_minor >= 8 )); then TORCH_INDEX=https://download.pytorch.org/whl/cu128
  elif (( drv_major == 12 )); then TORCH_INDEX=https://download.pytorch.org/whl/cu126
  else
    die "the NVIDIA driver ($DRIVER) runs CUDA up to $CUDA_DRIVER_VERSION; torch >= 2.9 needs CUDA 12 or newer: update the driver, or set TORCH_INDEX_URL to a torch wheel index this driver can run"
  fi
fi
free_gb() { df -Pk "$1" | awk 'NR==2 {printf "%d", $4/1048576}'; }
mount_of() { df -Pk "$1" | awk 'NR==2 {print $6}'; }
# at the base dir (its nearest existing part): the data and the checkpoints go there, not to the repo
FREE_DISK_GB="$(free_gb "$existing")"
MEMINFO="${SETUP_MEMINFO:-/proc/meminfo}"  # SETUP_MEMINFO: the tests' simulated GB10
MEM_AVAIL_MIB="$(awk '/MemAvailable/ {printf "%d", $2/1024}' "$MEMINFO" 2>/dev/null || echo 0)"
MEM_TOTAL_MIB="$(awk '/MemTotal/ {printf "%d", $2/1024}' "$MEMINFO" 2>/dev/null || echo 0)"
# python3 on PATH, passing over this repo's .venv (activated, as the closing lines suggest): taken
# for another interpreter, it redid the env stage's installs on every switch in and out of it
PY=""
IFS=: read -r -a path_dirs <<< "$PATH"
for d in "${path_dirs[@]}"; do
  [[ -n "$d" && -x "$d/python3" && ! "$d" -ef "$REPO/.venv/bin" ]] && { PY="$d/python3"; break; }
done
[[ -n "$PY" ]] || PY="$(command -v python3 || true)"
[[ -n "$PY" ]] || die "python3 not found: install Python >= 3.10 (e.g. 'apt-get install python3 python3-venv')"
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
  || die "Python >= 3.10 is required, found $("$PY" --version 2>&1)"
# A cgroup memory limit (docker run -m, a systemd MemoryMax, a job scheduler's): /proc/meminfo
# shows the host's memory inside it, so a 32 GB container on a 128 GB Spark was sized for 96 GB and
# OOM-killed. Its limit bounds the total and its free part the available (nanochat/memory_limits.py,
# which the stages' allocator cap reads too). SETUP_CGROUP_ROOT / SETUP_PROC_CGROUP: the tests' fakes.
# A simulated machine (SETUP_MEMINFO) has no cgroup but SETUP_CGROUP_ROOT's: the test machine's own
# limit is not the simulated one's.
HOST_MEM="the host's" CG_NOTE="" cg_limit="" cg_free="" CGROUP_FILE=""
if [[ -z "${SETUP_MEMINFO:-}" || -n "${SETUP_CGROUP_ROOT:-}" ]]; then
  read -r cg_limit cg_free CGROUP_FILE < <("$PY" -m nanochat.memory_limits "${SETUP_CGROUP_ROOT:-/sys/fs/cgroup}" \
    "${SETUP_PROC_CGROUP:-/proc/self/cgroup}" 2>/dev/null || true) || true
fi
if [[ "$cg_limit" =~ ^[0-9]+$ && "$cg_free" =~ ^[0-9]+$ ]]; then
  if (( cg_limit / 1048576 < MEM_TOTAL_MIB )); then
    MEM_TOTAL_MIB=$((cg_limit / 1048576)) HOST_MEM="the container's" CG_NOTE=" (the cgroup memory limit in $CGROUP_FILE)"
  fi
  (( cg_free / 1048576 >= MEM_AVAIL_MIB )) || MEM_AVAIL_MIB=$((cg_free / 1048576))
fi
MEM_AVAIL_GB=$(( ${MEM_AVAIL_MIB:-0} / 1024 ))

if [[ "$PRESET" == auto ]]; then
  if [[ "$GPU_CC" == 12.1 || "$GPU_NAME" == *GB10* ]]; then PRESET=spark
  elif [[ -n "$GPU_NAME" ]]; then PRESET=h100
  elif (( HIDDEN_GPUS )); then   # as a failing nvidia-smi: tiny over a GPU run's base dir retrains its tokenizer
    die "--preset auto: $(hidden_gpus); accepted: --preset tiny for the CPU demo, or CUDA_VISIBLE_DEVICES" \
      "unset or naming a GPU (an index 0..$((HIDDEN_GPUS - 1)) or a UUID) for a GPU preset"
  elif [[ -n "$SMI_ERROR" ]]; then
    die "--preset auto: nvidia-smi failed ('$SMI_ERROR'), so this machine's GPU cannot be seen: fix the" \
      "NVIDIA driver (a reboot, or reinstall it for the running kernel) and rerun, or pass --preset tiny for the CPU demo"
  else PRESET=tiny; echo "No NVIDIA GPU found: using --preset tiny (offline Shakespeare demo on the CPU)."; fi
fi

say "machine: $OS/$ARCH, GPU: ${GPU_NAME:-none}${GPU_CC:+ (cc $GPU_CC)}${DRIVER:+, driver $DRIVER, CUDA $CUDA_DRIVER_VERSION}"
# one process: the stages train on the first GPU, which a user of an 8-GPU box was not told
(( GPU_COUNT <= 1 )) || say "$GPU_COUNT GPUs: the stages below train on one of them; base training on all" \
  "$GPU_COUNT runs under torchrun, e.g. ./run_train.sh --nproc $GPU_COUNT (README: Multi-GPU)"
say "free disk ${FREE_DISK_GB} GB (base dir), available memory ${MEM_AVAIL_GB} GB, $("$PY" --version 2>&1) ($PY), preset $PRESET"
# the repo's own disk holds the .venv: a check while there is none yet (the env stage builds it)
if [[ ! -x .venv/bin/python && "$(mount_of "$REPO")" != "$(mount_of "$existing")" ]] && (( $(free_gb "$REPO") < 5 )); then
  msg="only $(free_gb "$REPO") GB free at $REPO; its .venv (torch and the project) needs about 5 GB"
  if [[ $DRY_RUN -eq 1 ]]; then warn "$msg"; else die "$msg"; fi
fi
if [[ "$PRESET" != tiny ]] && (( HIDDEN_GPUS )); then
  die "--preset $PRESET: $(hidden_gpus); accepted: CUDA_VISIBLE_DEVICES unset or naming a GPU (an index" \
    "0..$((HIDDEN_GPUS - 1)) or a UUID), or --preset tiny on the CPU"
elif (( HIDDEN_GPUS )); then say "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every GPU: the stages run on the CPU"
fi
if [[ "$PRESET" != tiny && -z "$GPU_NAME" ]]; then
  die "--preset $PRESET needs an NVIDIA GPU but nvidia-smi found none${SMI_ERROR:+ (it failed: '$SMI_ERROR')} (use --preset tiny on a CPU)"
fi

# ---------------------------------------------------------------- presets
export NANOCHAT_BASE_DIR="$BASE_DIR"
RUN_NAME="${WANDB_RUN:-dummy}"
BASE_EXTRA=()   # preset-only base_train flags (the GPU presets add none: their command, and so a
                # finished run's stage stamp, stays what it was)
case "$PRESET" in
  tiny)
    DATA_CMD=(python -m nanochat.dataset --source shakespeare)
    # SEQ 2048: Shakespeare scenes are ~1,600 tokens (p90 ~2,050), so 256 cropped 83% of the
    # tokens away (packing keeps documents BOS-aligned); 2048 drops ~6% for ~1.5x the step time.
    VOCAB=2048; DEPTH=2; SEQ=2048; DBS=2; TBS=4096; ITERS=250; PRECISION=fp32; KERNEL=current
    EVAL_TOKENS=65536; MID_ITERS=40; SFT_ITERS=40; MAX_PROBLEMS=8; COMPILE=--no-compile; SAVE_EVERY=100
    CHAT_SAVE_EVERY=20; CHAT_TBS=$((DBS * SEQ))   # tiny: one micro-batch a step, minutes on a CPU
    # recipe v1: v2 scales the LRs by sqrt(4096 / 2^19) = 0.088 at this batch, and these 250 steps
    # ended at val bpb 2.467 under v2 against 2.347 under v1 (CHANGELOG_GB10.md, session 43)
    BASE_EXTRA=(--recipe v1) ;;
  spark)
    VOCAB=32768; DEPTH=20; SEQ=2048; DBS=16; TBS=524288; ITERS=-1; PRECISION=auto; KERNEL=triton
    EVAL_TOKENS=10485760; MID_ITERS=-1; SFT_ITERS=-1; MAX_PROBLEMS=-1; COMPILE=--compile; SAVE_EVERY=200
    CHAT_SAVE_EVERY=$SAVE_EVERY; CHAT_TBS=-1 ;;   # -1: mid 524,288 tokens, SFT 32 rows a step (chat_train.py)
  h100)
    VOCAB=32768; DEPTH=20; SEQ=2048; DBS=32; TBS=524288; ITERS=-1; PRECISION=auto; KERNEL=triton
    EVAL_TOKENS=10485760; MID_ITERS=-1; SFT_ITERS=-1; MAX_PROBLEMS=-1; COMPILE=--compile; SAVE_EVERY=1000
    CHAT_SAVE_EVERY=$SAVE_EVERY; CHAT_TBS=-1 ;;
esac
# base_train saves every SAVE_EVERY steps (d20 on a GB10: ~200 x 31 s, under 2 h of work at risk; on an
# H100 ~1000 x 2.8 s), keeps the newest 2, and a rerun of an interrupted stage resumes the latest
# (--resume auto): a crash on day 5 of a Spark's week costs hours, not days. mid_train and chat_sft
# do the same every CHAT_SAVE_EVERY steps: mid's step is base's 524,288 tokens, and its epoch is
# hours on a GB10; their --resume auto continues only a run that started from the same base / mid
# weights (nanochat/chat_train.py)
[[ $DEPTH_GIVEN -eq 1 ]] && DEPTH=$((10#$DEPTH_FLAG))
MODEL_TAG="d${DEPTH}"

# Sizes that follow the depth (width 64 x depth, nanochat/gpt.py): the scaling parameters (the
# transformer's matrices + lm_head) set the training tokens (base_train: 20 per parameter), and all
# parameters (+ wte and the value-embedding tables of every other layer) the fixed memory.
WIDTH=$((64 * DEPTH))
SCALING_PARAMS=$((12 * WIDTH * WIDTH * DEPTH + VOCAB * WIDTH))
ALL_PARAMS=$((12 * WIDTH * WIDTH * DEPTH + (2 + (DEPTH + 1) / 2) * VOCAB * WIDTH))
TRAIN_TOKENS=$((20 * SCALING_PARAMS))
if [[ "$PRESET" != tiny ]]; then
  # ClimbMix: d20's 8.7B tokens were given 170 shards (~51M tokens each, with margin); other depths
  # in proportion, at least 8, so that no depth trains on repeated data
  D20_SCALING=$((12 * 1280 * 1280 * 20 + VOCAB * 1280))
  SHARDS=$(( (170 * SCALING_PARAMS + D20_SCALING - 1) / D20_SCALING )); (( SHARDS >= 8 )) || SHARDS=8
  DATA_CMD=(python -m nanochat.dataset --source climbmix -n "$SHARDS")
fi

# The disk the run fills at the base dir: the data shards (~0.12 GB each, an estimate: FineWeb-edu's
# are ~100 MB for ~55M tokens, ClimbMix's hold ~61M) and, for each of base, mid and SFT, --keep-last 2
# checkpoints plus the one saved before the oldest goes (d20 with its optimizer state ~9.2 GB each,
# other depths in proportion to their parameters), + 5 GB (eval data, tokenizer, report). What this
# pipeline already made there (a rerun after a crash) is room: it is reused or replaced, not added.
NEED_DISK=5 NEED_WHAT="the tiny preset"
if [[ "$PRESET" != tiny ]]; then
  CKPT_MB=$((9200 * ALL_PARAMS / (12 * 1280 * 1280 * 20 + 12 * VOCAB * 1280)))
  NEED_DISK=$(( (7 * CKPT_MB + 120 * SHARDS + 999) / 1000 + 5 ))
  NEED_WHAT="d$DEPTH ($SHARDS data shards and up to 7 checkpoints of ~$(( (CKPT_MB + 500) / 1000 )) GB: base, mid and SFT keep 2 each, +1 while saving)"
fi
HAVE_KB=0
for d in "$BASE_DIR/base_data" "$BASE_DIR/checkpoints"/{base,mid,sft}/"$MODEL_TAG"; do
  if [[ -d "$d" ]]; then kb="$(du -sk "$d" 2>/dev/null | awk '{print $1}')"; HAVE_KB=$((HAVE_KB + ${kb:-0})); fi
done
HAVE_GB=$((HAVE_KB / 1048576))

choose_device_batch   # DBS: the preset's fitted to this machine's memory, or --device-batch-size's
if [[ "$PRESET" == tiny ]]; then   # a fixed demo budget: ITERS steps, not 20 tokens per parameter
  say "d$DEPTH: $(awk -v p="$ALL_PARAMS" 'BEGIN {printf "%.1fM", p / 1e6}') parameters, base_train on" \
      "$(awk -v t="$((ITERS * TBS))" 'BEGIN {printf "%.1fM", t / 1e6}') tokens ($ITERS steps of $TBS, the tiny preset's fixed demo budget)"
else
  say "d$DEPTH: $(awk -v p="$ALL_PARAMS" 'BEGIN {printf "%.0fM", p / 1e6}') parameters, base_train on" \
      "$(awk -v t="$TRAIN_TOKENS" 'BEGIN {printf "%.1fB", t / 1e9}') tokens (${SHARDS} data shards); its step lines show the ETA"
  if [[ "$PRESET" == spark ]] && (( DEPTH >= 16 )); then
    say "on a GB10 this takes days: community figures (not measured here) put d20 (8.7B tokens) at ~14-17k tok/s," \
        "~6-7 days;" \
        "--depth 12 trains $(awk -v d=12 -v v="$VOCAB" 'BEGIN {printf "%.1fB", 20 * (12 * (64*d)^2 * d + v * 64 * d) / 1e9}') tokens"
  fi
fi

stage_cmd() {  # prints the command of a stage, one argument per line
  case "$1" in
    data) printf '%s\n' "${DATA_CMD[@]}" ;;
    tokenizer) printf '%s\n' python -m scripts.tok_train --vocab-size "$VOCAB" ;;
    tok_eval) printf '%s\n' python -m scripts.tok_eval ;;
    base_train) printf '%s\n' python -m scripts.base_train --depth "$DEPTH" --max-seq-len "$SEQ" \
        --device-batch-size "$DBS" --total-batch-size "$TBS" --num-iterations "$ITERS" \
        --precision "$PRECISION" --kernel "$KERNEL" "$COMPILE" --eval-tokens "$EVAL_TOKENS" \
        --save-every "$SAVE_EVERY" --keep-last 2 --resume auto --run "$RUN_NAME" --model-tag "$MODEL_TAG" \
        "${BASE_EXTRA[@]}" ;;
    base_eval) printf '%s\n' python -m scripts.base_eval --model-tag "$MODEL_TAG" --eval core,bpb,sample \
        --max-per-task "$MAX_PROBLEMS" --eval-tokens "$EVAL_TOKENS" --device-batch-size "$DBS" ;;
    # offline (tiny) there are no train splits of MMLU/ARC/GSM8K: train on the local test files minus
    # their first 100 problems, which chat_eval (--max-problems <= 100) then scores unseen
    mid_train|chat_sft) local offline=(); [[ "$PRESET" == tiny ]] && offline=(--test-holdout 100)
      local iters="$MID_ITERS"; [[ "$1" == chat_sft ]] && iters="$SFT_ITERS"
      local own=(); for f in "${CONV_FILES[@]}"; do own+=(--extra-conversations "$f"); done
      [[ $NO_IDENTITY -eq 1 ]] && own+=(--no-identity)
      [[ -n "$IDENTITY" ]] && own+=(--identity "$IDENTITY")
      printf '%s\n' python -m "scripts.$1" --model-tag "$MODEL_TAG" --num-iterations "$iters" \
        --device-batch-size "$DBS" --total-batch-size "$CHAT_TBS" --max-seq-len "$SEQ" "$COMPILE" \
        --save-every "$CHAT_SAVE_EVERY" --keep-last 2 \
        --resume auto --run "$RUN_NAME" "${offline[@]}" "${own[@]}" ;;
    chat_eval) printf '%s\n' python -m scripts.chat_eval -i sft --model-tag "$MODEL_TAG" --max-problems "$MAX_PROBLEMS" ;;
    report) printf '%s\n' python -m nanochat.report generate ;;
  esac
}

# checked for the stages that fill it (not e.g. --only env, report or an eval)
if (( FREE_DISK_GB + HAVE_GB < NEED_DISK )) \
   && { should_run data || should_run base_train || should_run mid_train || should_run chat_sft; }; then
  msg="only ${FREE_DISK_GB} GB free at $BASE_DIR (the base dir: data, checkpoints)"
  (( HAVE_GB == 0 )) || msg+=", + ${HAVE_GB} GB of this pipeline's data and checkpoints there already"
  msg+="; $NEED_WHAT needs about ${NEED_DISK} GB"
  if [[ $DRY_RUN -eq 1 ]]; then warn "$msg"; else die "$msg"; fi
fi

# One setup.sh per base dir: a second one (another terminal, a forgotten tmux window) ran the same
# stages at the same time, two base_trains saving into one checkpoint directory. The stages inherit
# the lock, so one still running after its setup.sh was killed holds it too.
if [[ $DRY_RUN -eq 0 ]] && command -v flock >/dev/null 2>&1; then
  mkdir -p "$STATE_DIR" && exec 8>>"$STATE_DIR/lock" \
    || die "$BASE_DIR_FROM: cannot write to $STATE_DIR; $BASE_DIR_OK, writable"
  # -E 75: "held by another" apart from a filesystem without locks (Lustre without flock: ENOSYS),
  # where setup.sh goes on unlocked, as the downloads do (nanochat/dataset_download.py)
  lock_rc=0; flock -n -E 75 8 || lock_rc=$?   # set -e: the status kept, not an exit
  if [[ $lock_rc -eq 75 ]]; then
    holder="$(tr -dc '0-9' < "$STATE_DIR/lock")"
    if [[ -n "$holder" ]] && kill -0 "$holder" 2>/dev/null; then
      die "another ./setup.sh (pid $holder) is running on $BASE_DIR: let it finish, or stop it (Ctrl-C in" \
        "its terminal, or kill -TERM $holder: a training stage saves first), then rerun"
    fi
    # the setup.sh that took it is gone (kill -9), a stage or a tool it started still holds it
    die "a process an earlier ./setup.sh started still holds $STATE_DIR/lock (that setup.sh, pid" \
      "${holder:-?}, is gone); find it with \`fuser -v $(printf "%q" "$STATE_DIR/lock")\`, let it finish or stop it, then rerun"
  elif [[ $lock_rc -ne 0 ]]; then
    warn "cannot lock $STATE_DIR/lock on this filesystem (flock exit $lock_rc): going on without the one-run-per-base-dir check"
  else
    printf '%s\n' "$$" > "$STATE_DIR/lock"
  fi
fi
[[ $DRY_RUN -eq 1 ]] || record_location || die "$BASE_DIR_FROM: cannot write to $STATE_DIR; $BASE_DIR_OK, writable"

# ---------------------------------------------------------------- env stage
source "$REPO/scripts/setup_env.sh"   # env_stage, env_done, rust_ready and their messages

if should_run env; then
  if [[ $DRY_RUN -eq 0 ]]; then env_stage
  elif env_done; then say "[env] done already (same config): skipping"
  elif env_only_needs_bytecode; then say "[env] would compile the venv's packages to bytecode (no reinstall)"
  else
    # (an existing .venv is reused: "would create .venv" read as if it were thrown away, its torch too)
    say "[env] would $(env_plan) ($(env_why))"
    rust_ready || [[ $INSTALL_RUST -eq 1 ]] || warn "$NO_CARGO"
    command -v cc >/dev/null 2>&1 || warn "$NO_CC"
  fi
fi
export PATH="$REPO/.venv/bin:$PATH"

# The --conversations files' rows and the --identity name, checked by mid_train / chat_sft's own
# code (the shell's check above misses e.g. a row without an assistant reply, or a zero-width
# space in the name) now, before data and base training, not days later when mid_train starts.
check_chat_inputs() {
  [[ ${#CONV_FILES[@]} -gt 0 || -n "$IDENTITY" ]] || return 0
  should_run mid_train || should_run chat_sft || return 0
  [[ $DRY_RUN -eq 0 && -x .venv/bin/python ]] || return 0   # (a stage without the venv fails anyway)
  .venv/bin/python - "$IDENTITY" "${CONV_FILES[@]}" <<'PY' || exit 2
import sys

from nanochat.tasks.conversations import ConversationFile
from nanochat.tasks.identity import check_identity_name

try:
    if sys.argv[1]:
        check_identity_name(sys.argv[1])
    for path in sys.argv[2:]:
        ConversationFile(path, flag="--conversations")
except ValueError as e:   # DataError and RequestError are ValueErrors
    sys.exit(f"setup.sh: error: {e}")
PY
}
check_chat_inputs
# NANOCHAT_DTYPE (the stages' compute dtype), which base_train's own check refused only once it
# started, after the data stage (a download of hours on a GPU preset): a typo, or a dtype the
# preset's --precision does not compute in (setup.sh has no --precision flag to change). Not
# checked once base_train has finished (a rerun that skips it must not be refused).
check_dtype_env() {
  [[ -n "${NANOCHAT_DTYPE:-}" && -x .venv/bin/python ]] && should_run base_train || return 0
  [[ $FORCE -eq 1 || ! -f "$STATE_DIR/base_train.done" ]] || return 0
  local said
  said="$(.venv/bin/python - "$PRECISION" "$PRESET" 2>&1 <<'PY'
import os
import sys

from nanochat.precision_request import PRECISION_DTYPE, runtime_dtype

precision, preset = sys.argv[1:]
try:
    runtime_dtype("auto")   # the value itself
except ValueError as e:
    sys.exit(str(e))
try:
    runtime_dtype(precision)
except ValueError:
    want = PRECISION_DTYPE[precision]
    sys.exit(f"NANOCHAT_DTYPE: got {os.environ['NANOCHAT_DTYPE']!r}, but the {preset} preset's base_train runs "
             f"--precision {precision}, which computes in {want}; accepted: NANOCHAT_DTYPE unset, auto or {want}")
PY
)" && return 0
  if [[ $DRY_RUN -eq 1 ]]; then warn "$said"; else die "$said"; fi
}
check_dtype_env; check_chat_data   # (setup_env.sh) mid / SFT's data there, before the data stage and base training
if [[ $DRY_RUN -eq 0 && ! -x .venv/bin/python ]]; then   # (--only / --from without the env stage)
  for s in "${STAGES[@]:1}"; do
    should_run "$s" && die "stage '$s' runs in $REPO/.venv, which does not exist (or has no python): build it" \
      "first with ./setup.sh --only env (with the rest of your flags), then rerun this"
  done
fi
# WANDB_RUN: the env stage installs wandb; without it (--only / --from) a venv that lacks it would
# fail at the first training stage, after the stages before it (data, tokenizer) had run
if [[ -n "${WANDB_RUN:-}" ]] && ! should_run env && [[ -x .venv/bin/python ]] \
   && ! .venv/bin/python -c 'import wandb' >/dev/null 2>&1; then
  for s in base_train mid_train chat_sft; do
    should_run "$s" || continue
    msg="WANDB_RUN=$WANDB_RUN: the wandb package is not in $REPO/.venv, which stage '$s' logs to; install it"
    msg+=" with WANDB_RUN=$WANDB_RUN ./setup.sh --only env, or unset WANDB_RUN"
    if [[ $DRY_RUN -eq 1 ]]; then warn "$msg"; else die "$msg"; fi
    break
  done
fi

# A fresh pipeline (no stage after env has finished) starts its report: the machine and the start
# time, which report.md's header and total time read (without it: "no report reset started this run")
fresh=1
for s in "${STAGES[@]:1}"; do [[ -f "$STATE_DIR/$s.done" ]] && fresh=0; done
if (( fresh )) && should_run data && [[ $DRY_RUN -eq 0 ]]; then
  .venv/bin/python -m nanochat.report reset || die "python -m nanochat.report reset failed (see above)"
fi

for stage in "${STAGES[@]:1}"; do
  should_run "$stage" || continue
  mapfile -t cmd < <(stage_cmd "$stage")
  run_stage "$stage" "${cmd[@]}"
done

if should_run report && [[ $DRY_RUN -eq 0 ]]; then
  CHAT_SOURCE=""   # the most finished phase that has a checkpoint (sft > mid > base): one whose
  # latest.json records a step. A stage makes its directory as it starts (.writer.lock), so one that
  # stopped before its first save left a directory the chat would fail on; a bare directory only counts
  # when no phase records a step.
  for phase in sft mid base; do
    if [[ -f "$BASE_DIR/checkpoints/$phase/$MODEL_TAG/latest.json" ]]; then CHAT_SOURCE=$phase; break; fi
  done
  for phase in sft mid base; do
    if [[ -z "$CHAT_SOURCE" && -d "$BASE_DIR/checkpoints/$phase/$MODEL_TAG" ]]; then CHAT_SOURCE=$phase; fi
  done
  unfinished=()   # e.g. after --only report: say which stages have not finished, not "All stages done"
  for s in "${STAGES[@]:1}"; do [[ -f "$STATE_DIR/$s.done" ]] || unfinished+=("$s"); done
  echo
  if [[ ${#unfinished[@]} -eq 0 ]]; then echo "All stages done. Artefacts are in $BASE_DIR (report: $BASE_DIR/report/report.md)."
  else echo "Report written to $BASE_DIR/report/report.md; stages not finished in $BASE_DIR: ${unfinished[*]}."; fi
  if [[ -n "$CHAT_SOURCE" ]]; then
    cat <<EOF
Chat with your model ($CHAT_SOURCE checkpoint, tag $MODEL_TAG):
  source $(printf '%q' "$REPO/.venv/bin/activate")
  export NANOCHAT_BASE_DIR=$(printf '%q' "$BASE_DIR")
  python -m scripts.chat_web -i $CHAT_SOURCE --model-tag $MODEL_TAG    # then open http://127.0.0.1:8000
  python -m scripts.chat_cli -i $CHAT_SOURCE --model-tag $MODEL_TAG -p "Why is the sky blue?"
The page listens on this machine only (a Spark run headless, a cloud box): from your own computer,
  ssh -N -L 8000:127.0.0.1:8000 $(id -un)@$(hostname)
then open http://127.0.0.1:8000 there.
EOF
  fi
fi
exit
}
