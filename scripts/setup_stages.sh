# setup.sh's stage bookkeeping, sourced by it (not a script of its own): which stages this run
# selected (should_run), the done-markers and what they record (marker_text, stage_inputs,
# stage_outputs, read_marker, forget_later), a base dir moved since the last run (say_if_moved),
# running a stage's command as a child that a Ctrl-C / SIGHUP / SIGTERM stops cleanly (run_child,
# on_stop_signal, stopped), and the rerun command printed on a stop (rerun_cmd).
# They read setup.sh's globals (STAGES, ONLY/FROM, PRESET, BASE_DIR, STATE_DIR, ...).

should_run() {  # stage -> 0 if selected by --only/--from
  local s="$1"
  if [[ -n "$ONLY" ]]; then local o; for o in "${ONLY_LIST[@]}"; do [[ "$o" == "$s" ]] && return 0; done; return 1; fi
  if [[ -n "$FROM" ]]; then
    local seen=0 x; for x in "${STAGES[@]}"; do [[ "$x" == "$FROM" ]] && seen=1; [[ "$x" == "$s" ]] && return $((1 - seen)); done
  fi
  return 0
}
# The done-markers live in the base dir and name nothing by its absolute path, so a base dir moved
# or copied (to a bigger disk; `mv` then a symlink; another NANOCHAT_BASE_DIR) keeps its finished
# stages: before, each held base_dir=<absolute path>, and a moved one reran every stage (the data
# and tokenizer again, base / mid / SFT resumed at their last step, both evals in full). A marker
# holds MARKER_HEAD, the preset, the stage's command and its inputs' digests (a path under the base
# dir written "<base dir>/..."), then one "output SIZE SHA256 PATH" line per file the stage left
# (stage_outputs; PATH relative to the base dir, SHA256 "-" over OUTPUT_HASH_MAX bytes, where the
# size stands for it): a stage whose settings differ, or one of whose outputs is gone or changed
# since, runs again.
MARKER_HEAD="done-marker v2 (paths relative to the base dir)"
OUTPUT_HASH_MAX=$((16 * 1024 * 1024))   # the tokenizer, latest.json, sums, results: hashed; shards, weights: sized
marker_text() {  # command... -> the marker's settings lines
  echo "$MARKER_HEAD"; echo "preset=$PRESET"; printf "%s\n" "$@"
}
under_base() { printf '%s' "${2//"$1/"/<base dir>/}"; }   # dir text -> text, dir/... written <base dir>/...
ckpt_outputs() {  # phase -> the files of its latest checkpoint (the step latest.json names)
  local dir="checkpoints/$1/$MODEL_TAG" step f
  echo "$dir/latest.json"
  step="$(sed -n 's/.*"dir": *"\([^"/]*\)".*/\1/p' "$BASE_DIR/$dir/latest.json" 2>/dev/null | head -n 1)"
  [[ -n "$step" ]] || return 0
  echo "$dir/$step/meta.json"; echo "$dir/$step/model.pt"
  for f in "$BASE_DIR/$dir/$step"/sums_rank*.json; do [[ -f "$f" ]] && echo "$dir/$step/${f##*/}"; done
}
latest_step() {  # phase -> its latest checkpoint's step, 6 digits (as the evals name their results)
  local n
  n="$(sed -n 's/.*"step": *\([0-9]*\).*/\1/p' "$BASE_DIR/checkpoints/$1/$MODEL_TAG/latest.json" 2>/dev/null | head -n 1)"
  printf '%06d' "$((10#${n:-0}))"
}
stage_outputs() {  # stage -> the files it leaves (relative to the base dir), one a line, there or not
  case "$1" in
    data) (cd "$BASE_DIR" 2>/dev/null && printf '%s\n' base_data/*.parquet) || echo "base_data/*.parquet" ;;
    tokenizer) printf '%s\n' tokenizer/tokenizer.pkl tokenizer/token_bytes.pt ;;
    base_train) ckpt_outputs base ;;
    base_eval) echo "eval/base_${MODEL_TAG}_step$(latest_step base).json" ;;
    mid_train) ckpt_outputs mid ;;
    chat_sft) ckpt_outputs sft ;;
    chat_eval) echo "chat_eval/sft_${MODEL_TAG}_step$(latest_step sft).json" ;;
    report) echo report/report.md ;;
  esac   # tok_eval: a report section only
}
output_lines() {  # stage -> the "output SIZE SHA256 PATH" lines of the files it left
  local rel f size sha
  while IFS= read -r rel; do
    f="$BASE_DIR/$rel"
    [[ -n "$rel" && -f "$f" ]] || continue
    size="$(stat -c %s -- "$f")" sha=-
    (( size > OUTPUT_HASH_MAX )) || sha="$(sha256sum < "$f" | cut -d ' ' -f 1)"
    echo "output $size $sha $rel"
  done < <(stage_outputs "$1")
}
outputs_differ() {  # a marker's output lines -> what is gone or changed (nothing: all as recorded)
  local tag size sha rel f
  while read -r tag size sha rel; do
    [[ -n "$rel" ]] || continue
    f="$BASE_DIR/$rel"
    [[ -f "$f" ]] || { echo "its output $rel is gone"; return; }
    if [[ "$(stat -c %s -- "$f")" != "$size" ]] \
       || [[ "$sha" != - && "$(sha256sum < "$f" | cut -d ' ' -f 1)" != "$sha" ]]; then
      echo "its output $rel has changed since it finished"; return
    fi
  done <<< "$1"
}
older_marker() {  # text of an older setup.sh's marker (preset=, base_dir=<absolute>, command, inputs)
                  # -> its settings as this one writes them; nothing if it is not one
  local preset="${1%%$'\n'*}" rest="${1#*$'\n'}" was
  [[ "$preset" == preset=* && "$rest" == base_dir=* ]] || return 0
  was="${rest%%$'\n'*}"; was="${was#base_dir=}"
  [[ "$rest" == *$'\n'* ]] && rest="${rest#*$'\n'}" || rest=""
  printf '%s\n%s\n%s' "$MARKER_HEAD" "$preset" "$(under_base "$was" "$rest")"
}
read_marker() {  # stage marker want -> MARKER_STATE: none | same | older (an older setup.sh's marker,
                 # same settings, the outputs expected there) | changed (settings) | outputs (MARKER_WHY)
  local text outs
  MARKER_STATE=none MARKER_WHY=""
  [[ -f "$2" ]] || return 0
  text="$(cat "$2")"
  if [[ "$text" == "$3" ]]; then outs=""
  elif [[ "$text" == "$3"$'\n'output\ * ]]; then
    outs="${text#"$3"$'\n'}"
    grep -qvE '^output [0-9]+ ([0-9a-f]{64}|-) .' <<< "$outs" && { MARKER_STATE=changed; return 0; }
  elif [[ -n "$text" && "$(older_marker "$text")" == "$3" ]]; then
    MARKER_STATE=older   # it recorded no outputs: the ones expected now must be there
    local rel
    while IFS= read -r rel; do
      [[ -z "$rel" || -f "$BASE_DIR/$rel" ]] || { MARKER_STATE=outputs MARKER_WHY="its output $rel is gone"; return 0; }
    done < <(stage_outputs "$1")
    return 0
  else MARKER_STATE=changed; return 0; fi
  MARKER_WHY="$(outputs_differ "$outs")"
  if [[ -z "$MARKER_WHY" ]]; then MARKER_STATE=same
  elif ckpt_moved_on "$1" "$outs"; then   # trained on after setup's run (run_train.sh, --keep-last): kept
    MARKER_STATE=same MARKER_WHY="its checkpoints moved on since setup.sh's run (a later step is there): kept; --force redoes it"
  else MARKER_STATE=outputs; fi
}
ckpt_moved_on() {  # stage, its marker's output lines -> whether it is a training stage whose latest
                   # checkpoint is whole (its latest.json names a step whose meta.json and model.pt are
                   # there) and another step than setup's run left: a run trained further leaves other
                   # files than setup's, and rerunning the stage would resume past setup's step count and
                   # fail, after forgetting every later stage. The step setup's run left, with files
                   # changed in place, is damaged (or retrained by hand), not moved on: it runs again
                   # (resume_point), and so do the stages that build on it.
  local phase
  case "$1" in base_train) phase=base ;; mid_train) phase=mid ;; chat_sft) phase=sft ;; *) return 1 ;; esac
  local rel files=()
  while IFS= read -r rel; do [[ -n "$rel" ]] && files+=("$rel"); done < <(ckpt_outputs "$phase")
  (( ${#files[@]} >= 3 )) || return 1   # latest.json, meta.json, model.pt
  for rel in "${files[@]}"; do [[ -f "$BASE_DIR/$rel" ]] || return 1; done
  ! grep -qxE "output [0-9]+ ([0-9a-f]{64}|-) ${files[2]//./\\.}" <<< "$2"   # not setup's step: moved on
}
write_marker() {  # stage marker want: the settings and the outputs there now
  mkdir -p "$STATE_DIR"
  { printf '%s\n' "$3"; output_lines "$1"; } > "$2.tmp" && mv -f "$2.tmp" "$2"
}
# Where setup.sh last ran on this base dir (setup_state/location; before it was kept, an older
# marker's base_dir= line): another path, not the same directory by another name (a symlink), is a
# base dir moved or copied there, said once at start-up.
previous_location() {
  local f
  if [[ -f "$STATE_DIR/location" ]]; then head -n 1 "$STATE_DIR/location"; return 0; fi
  for f in "$STATE_DIR"/*.done; do
    [[ -f "$f" ]] && sed -n '2s/^base_dir=//p' "$f" | grep . && return 0
  done
  return 0
}
say_if_moved() {
  local was; was="$(previous_location)"
  [[ -n "$was" && "$was" != "$BASE_DIR" ]] || return 0
  [[ -e "$was" && "$was" -ef "$BASE_DIR" ]] && return 0
  say "base dir $BASE_DIR was $was when setup.sh last ran on it (moved or copied):" \
      "its finished stages stay done where their outputs are here"
}
record_location() { mkdir -p "$STATE_DIR" && printf '%s\n' "$BASE_DIR" > "$STATE_DIR/location"; }
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
# A training stage's latest checkpoint that cannot be resumed (a file of it deleted, or no longer the
# size or sha256 its sums_rank*.json recorded: damaged on disk; latest.json unreadable) stopped the
# stage's --resume auto at every rerun ("file missing from the checkpoint; use another step ([20])"),
# a step setup.sh's command line cannot name: "finished before, but its output ... is gone:
# rerunning" then failed the same way forever. The stage resumes the newest whole earlier step instead
# (--resume N: the damaged step moves to earlier_runs/<N>/ in the tag at its first save, kept), or
# starts afresh (--overwrite, the earlier run moved there too) when there is none, or when (mid / SFT)
# that step's run started from other weights than its source's latest now: nanochat/resume_point.py
# decides, with the checkpoint code's own checks. The marker keeps the --resume auto command. The check
# reads the latest checkpoint once (its sha256s; d20's optimizer state: seconds) and only before a
# training stage runs; a whole one leaves --resume auto as it is. It runs under the venv's python, the
# stages' own interpreter ($PY, the system python3, may be one nanochat does not support), importing
# no torch (a fraction of a second): before the env stage has made one (a --dry-run), or if the check
# fails, the command is left as it is (the stage's own resume says what is wrong).
resume_point() {  # stage command... -> STAGE_CMD: the command, --resume auto replaced as above if need be
  local stage="$1" phase src=""; shift
  STAGE_CMD=("$@")
  case "$stage" in base_train) phase=base ;; mid_train) phase=mid src=base ;; chat_sft) phase=sft src=mid ;; *) return 0 ;; esac
  [[ -f "$BASE_DIR/checkpoints/$phase/$MODEL_TAG/latest.json" ]] || return 0
  local verdict=()   # how (keep | resume | fresh), step, which checkpoint, why, (fresh) why not an earlier one
  mapfile -t verdict < <(.venv/bin/python -m nanochat.resume_point "$BASE_DIR/checkpoints/$phase/$MODEL_TAG" \
    ${src:+"$BASE_DIR/checkpoints/$src/$MODEL_TAG"} 2>/dev/null || true)
  [[ "${verdict[0]:-}" == resume || "${verdict[0]:-}" == fresh ]] || return 0
  local i
  for i in "${!STAGE_CMD[@]}"; do
    [[ "${STAGE_CMD[$i]}" == --resume && "${STAGE_CMD[$((i + 1))]:-}" == auto ]] || continue
    if [[ "${verdict[0]}" == resume ]]; then STAGE_CMD[$((i + 1))]="${verdict[1]}"
    else STAGE_CMD=("${STAGE_CMD[@]:0:i}" --overwrite "${STAGE_CMD[@]:i+2}"); fi
    break
  done
  local what="its latest checkpoint (${verdict[2]}) cannot be resumed: ${verdict[3]}"
  if [[ "${verdict[0]}" == resume ]]; then
    say "[$stage] $what; resuming step ${verdict[1]}, the newest whole one before it (the later steps move to" \
        "checkpoints/$phase/$MODEL_TAG/earlier_runs/ at its first save)"
  else
    say "[$stage] $what; ${verdict[4]}: starting afresh (--overwrite; the earlier run moves to" \
        "checkpoints/$phase/$MODEL_TAG/earlier_runs/ at its first save)"
  fi
}
run_stage() {  # stage: run its command unless its done-marker holds the same config and its outputs are here
  local stage="$1"; shift
  local marker="$STATE_DIR/$stage.done" want
  want="$(marker_text "$@"; stage_inputs "$stage")"   # (its own line: stage_inputs' die ends setup.sh)
  # paths under the base dir as <base dir>/..., by its name and by its real path (a --conversations
  # file under a symlinked base dir is named by the latter)
  want="$(under_base "$BASE_DIR" "$want")"
  want="$(under_base "$(realpath -m -- "$BASE_DIR" 2>/dev/null || printf '%s' "$BASE_DIR")" "$want")"
  local upstream="$MODEL_RAN"; [[ "$stage" == report ]] && upstream="$ANY_RAN"
  read_marker "$stage" "$marker" "$want"
  case "$MARKER_STATE" in
    same|older)
      if [[ $FORCE -eq 0 && -z "$upstream" ]]; then
        if [[ "$MARKER_STATE" == same ]]; then
          say "[$stage] done already (same config${MARKER_WHY:+; $MARKER_WHY}): skipping"; return 0
        fi
        say "[$stage] done already (same config, by an older setup.sh's marker$( ((DRY_RUN)) \
            || echo ", now rewritten with the outputs found")): skipping"
        (( DRY_RUN )) || write_marker "$stage" "$marker" "$want"
        return 0
      fi
      if [[ -n "$upstream" ]]; then say "[$stage] rerunning: $upstream ran before it"; fi ;;
    changed) say "[$stage] config changed since last run: rerunning" ;;
    outputs) say "[$stage] finished before, but $MARKER_WHY: rerunning" ;;
  esac
  ANY_RAN="$stage"; [[ "$MODEL_MAKERS" == *" $stage "* ]] && MODEL_RAN="$stage"
  resume_point "$stage" "$@"   # STAGE_CMD: the command run (the marker records "$@")
  say "[$stage] $(shell_words "${STAGE_CMD[@]}")"
  [[ $DRY_RUN -eq 1 ]] && return 0
  local t0=$SECONDS rc=0
  # the marker says the stage's latest run finished: a rerun (--force, a config change, or an
  # upstream stage that ran) that is interrupted must not leave the old one saying "done"
  rm -f "$marker"
  forget_later "$stage"
  CURRENT_STAGE="$stage"
  run_child "${STAGE_CMD[@]}" || rc=$?
  (( STOP_CODE == 0 )) || stopped "$STOP_CODE"   # Ctrl-C or a hangup while the stage ran
  if (( rc == 129 || rc == 130 || rc == 143 )); then   # a stage stopped by SIGHUP / Ctrl-C / SIGTERM (training saves first)
    stopped "$rc"
  elif (( rc != 0 )); then
    echo "setup.sh: stage '$stage' failed (exit $rc). Fix the problem and rerun $(rerun_cmd): finished stages are skipped." >&2; exit 1
  fi
  CURRENT_STAGE=""
  write_marker "$stage" "$marker" "$want"
  say "[$stage] finished in $((SECONDS - t0)) s"
}
