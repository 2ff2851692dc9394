# setup.sh's stage bookkeeping, sourced by it (not a script of its own): which stages this run
# selected (should_run), the done-markers and what they record (marker_text, stage_inputs,
# forget_later), running a stage's command as a child that a Ctrl-C / SIGHUP / SIGTERM stops
# cleanly (run_child, on_stop_signal, stopped), and the rerun command printed on a stop (rerun_cmd).
# They read setup.sh's globals (STAGES, ONLY/FROM, PRESET, BASE_DIR, STATE_DIR, ...).

should_run() {  # stage -> 0 if selected by --only/--from
  local s="$1"
  if [[ -n "$ONLY" ]]; then local o; for o in "${ONLY_LIST[@]}"; do [[ "$o" == "$s" ]] && return 0; done; return 1; fi
  if [[ -n "$FROM" ]]; then
    local seen=0 x; for x in "${STAGES[@]}"; do [[ "$x" == "$FROM" ]] && seen=1; [[ "$x" == "$s" ]] && return $((1 - seen)); done
  fi
  return 0
}
marker_text() { echo "preset=$PRESET"; echo "base_dir=$BASE_DIR"; printf "%s\n" "$@"; }
stage_inputs() {  # stage -> marker lines for inputs its command names only by path: the content of
                  # the --conversations files, so that an edited file retrains mid / SFT
  [[ ${#CONV_FILES[@]} -gt 0 && ( "$1" == mid_train || "$1" == chat_sft ) ]] || return 0
  local f   # moved or deleted during the hours before this stage: a bare sha256sum error ended setup.sh
  for f in "${CONV_FILES[@]}"; do
    [[ -f "$f" ]] || die "--conversations: '$f' is gone since setup.sh started (stage '$1' trains on it);" \
      "accepted: an existing JSONL file of conversations: put it back, or rerun without it"
  done
  sha256sum "${CONV_FILES[@]}"
}
# The stages after the tokenizer use what an earlier one made: once a stage that makes a tokenizer
# or a model runs (its config changed, --force, or it had not finished), every later stage runs too,
# even when its own command is unchanged, since a skipped one would keep results of what was
# replaced. That costs little when nothing changed: the training stages' --resume auto finds their
# last step done. The report also follows any stage that ran before it (an eval's new results).
MODEL_MAKERS=" tokenizer base_train mid_train chat_sft "
MODEL_RAN="" ANY_RAN=""
# ... and across runs: a stage that starts for real removes the done-markers of the stages that use
# what it makes (after a model maker, every later one; after any stage, the report's), so that a
# run cut short after it (Ctrl-C, a failure) or limited by --only leaves them to rerun next time,
# not "done already" on results of what was replaced.
forget_later() {  # stage
  local s later=0
  for s in "${STAGES[@]}"; do
    if (( later )) && [[ "$MODEL_MAKERS" == *" $1 "* || "$s" == report ]]; then rm -f "$STATE_DIR/$s.done"; fi
    [[ "$s" != "$1" ]] || later=1
  done
}

# Ctrl-C reaches the stage too (one process group): a training stage finishes its step and saves
# a checkpoint, then exits 130, which bash takes as handled and would carry on after; the trap and
# run_stage's exit-code check stop here instead, saying so, once the stage has ended.
# A hangup (SIGHUP: the ssh connection or terminal closed) does the same, exit 129. The stage may
# not have had it (the kernel signals only the session's leader, e.g. setup.sh run by `ssh -t`; a
# login shell passes it on to its jobs), so the trap passes it on; and since bash runs traps only
# once a foreground command ends, stages run as a child that setup.sh waits for (run_child). The
# terminal is gone, so from then on setup.sh's output (unless it goes to a file) is appended to
# $BASE_DIR/hangup.log, where a training stage's own output goes too (nanochat/loop.py).
CURRENT_STAGE="" STAGE_PID="" STOP_CODE=0 HUNG_UP=0
stopped() {  # exit code (129: SIGHUP, 130: Ctrl-C, 143: SIGTERM) -> one line on how to continue, exit with it
  local how="Ctrl-C"
  case "$1" in 129) how="SIGHUP (the terminal hung up)" ;; 130) ;; *) how="SIGTERM" ;; esac
  echo "setup.sh: stopped by $how${CURRENT_STAGE:+ in stage '$CURRENT_STAGE'} (exit $1). Rerun $(rerun_cmd) to" \
       "continue: finished stages are skipped and training resumes from its last checkpoint." >&2
  exit "$1"
}
kept_output() { [[ -f "$1" || "$1" -ef /dev/null ]]; }   # a file or /dev/null outlives the terminal
hangup_output() {  # the terminal is gone: writes to it fail (and would end setup.sh under set -e), so
                   # stdout and stderr, where not a file or /dev/null, go to $BASE_DIR/hangup.log
  local log="$BASE_DIR/hangup.log"
  kept_output /dev/fd/1 && kept_output /dev/fd/2 && return 0
  mkdir -p "$BASE_DIR" 2>/dev/null && : 2>/dev/null >>"$log" || log=/dev/null
  kept_output /dev/fd/2 || exec 2>>"$log"
  kept_output /dev/fd/1 || exec >>"$log"
  echo "==> $(date '+%F %T') setup.sh (pid $$): the terminal hung up (SIGHUP); its output continues here" >>"$log"
}
on_stop_signal() {  # 129 (SIGHUP) | 130 (Ctrl-C) | 143 (SIGTERM): stop now, or once the running stage has ended
  if (( $1 == 129 )); then
    (( HUNG_UP )) || hangup_output
    HUNG_UP=1
    [[ -z "$STAGE_PID" ]] || kill -HUP "$STAGE_PID" 2>/dev/null || true
  elif (( $1 == 143 )); then   # sent to setup.sh alone (a scheduler, `timeout`, kill PID): the stage saves too
    [[ -z "$STAGE_PID" ]] || kill -TERM "$STAGE_PID" 2>/dev/null || true
  fi
  (( STOP_CODE != 0 )) || STOP_CODE=$1
  [[ -n "$STAGE_PID" ]] || stopped "$STOP_CODE"
}
trap 'on_stop_signal 130' INT
trap 'on_stop_signal 129' HUP
trap 'on_stop_signal 143' TERM
run_child() {  # command... -> its exit code. A trapped signal ends `wait` early (128 + its number)
               # while the stage runs on: wait again. In the child, Ctrl-C and SIGQUIT act as in a
               # foreground command (a background one would ignore them) and it keeps stdin.
  # NANOCHAT_SETUP_STAGE: the stage knows setup.sh runs it (a stopped training run says "or rerun ./setup.sh")
  ( trap - INT QUIT HUP TERM; export NANOCHAT_SETUP_STAGE="${CURRENT_STAGE:-setup}"; exec "$@" ) <&0 &
  STAGE_PID=$!
  local rc
  while :; do
    rc=0; wait "$STAGE_PID" || rc=$?
    (( rc > 128 )) && kill -0 "$STAGE_PID" 2>/dev/null || break
  done
  STAGE_PID=""
  return "$rc"
}

shell_words() {  # args -> one line a shell reads back as them (a path with a space stays one argument)
  local a out=()
  for a in "$@"; do
    if [[ "$a" =~ ^[A-Za-z0-9_./:,=@+%^-]+$ ]]; then out+=("$a"); else out+=("$(printf '%q' "$a")"); fi
  done
  echo "${out[*]}"
}
VALUE_FLAGS=" --preset --depth --device-batch-size --only --from --conversations --identity --base-dir "
rerun_cmd() {  # [stage] -> the command line this run was started with, as a shell reads it back, less
               # --force (the stages this run finished have fresh markers; --force would redo them);
               # with a stage, its --from is that stage (the way on after a --from refused)
  local self="$0" a args=() envs=() keep=0 skip=0 from="${1:-}"
  [[ "$self" == */* ]] || self="./$self"   # `bash setup.sh`: as a command it needs the ./
  for a in "${ORIG_ARGS[@]}"; do
    if (( keep )); then keep=0; args+=("$a"); continue; fi   # a flag's value as is (--identity --force names a model)
    if (( skip )); then skip=0; continue; fi                  # the --from value replaced
    [[ "$a" == --force ]] && continue
    if [[ -n "$from" && ( "$a" == --from || "$a" == --from=* ) ]]; then
      args+=(--from "$from"); [[ "$a" == --from ]] && skip=1; continue
    fi
    [[ "$VALUE_FLAGS" == *" $a "* ]] && keep=1
    args+=("$a")
  done
  # and the settings it took from the environment: typed in a new shell (the terminal hung up) without
  # an inline `NANOCHAT_BASE_DIR=/data/nc ./setup.sh`'s, it started over in ~/.cache/nanochat
  [[ $BASE_DIR_GIVEN -eq 1 || -z "$ENV_BASE_DIR" ]] || envs+=("NANOCHAT_BASE_DIR=$BASE_DIR")
  [[ -z "${WANDB_RUN:-}" ]] || envs+=("WANDB_RUN=$WANDB_RUN")
  [[ -z "${TORCH_INDEX_URL:-}" ]] || envs+=("TORCH_INDEX_URL=$TORCH_INDEX_URL")
  shell_words "${envs[@]}" "$self" "${args[@]}"
}
run_stage() {  # stage: run its command unless its done-marker holds the same config
  local stage="$1"; shift
  local marker="$STATE_DIR/$stage.done" want
  want="$(marker_text "$@"; stage_inputs "$stage")"
  local upstream="$MODEL_RAN"; [[ "$stage" == report ]] && upstream="$ANY_RAN"
  if [[ -f "$marker" && "$(cat "$marker")" == "$want" ]]; then
    if [[ $FORCE -eq 0 && -z "$upstream" ]]; then say "[$stage] done already (same config): skipping"; return 0; fi
    if [[ -n "$upstream" ]]; then say "[$stage] rerunning: $upstream ran before it"; fi
  elif [[ -f "$marker" ]]; then say "[$stage] config changed since last run: rerunning"; fi
  ANY_RAN="$stage"; [[ "$MODEL_MAKERS" == *" $stage "* ]] && MODEL_RAN="$stage"
  say "[$stage] $(shell_words "$@")"
  [[ $DRY_RUN -eq 1 ]] && return 0
  local t0=$SECONDS rc=0
  # the marker says the stage's latest run finished: a rerun (--force, a config change, or an
  # upstream stage that ran) that is interrupted must not leave the old one saying "done"
  rm -f "$marker"
  forget_later "$stage"
  CURRENT_STAGE="$stage"
  run_child "$@" || rc=$?
  (( STOP_CODE == 0 )) || stopped "$STOP_CODE"   # Ctrl-C or a hangup while the stage ran
  if (( rc == 129 || rc == 130 || rc == 143 )); then   # a stage stopped by SIGHUP / Ctrl-C / SIGTERM (training saves first)
    stopped "$rc"
  elif (( rc != 0 )); then
    echo "setup.sh: stage '$stage' failed (exit $rc). Fix the problem and rerun $(rerun_cmd): finished stages are skipped." >&2; exit 1
  fi
  CURRENT_STAGE=""
  mkdir -p "$STATE_DIR"
  printf '%s\n' "$want" > "$marker.tmp" && mv -f "$marker.tmp" "$marker"
  say "[$stage] finished in $((SECONDS - t0)) s"
}
