# shellcheck shell=bash
# The device batch of setup.sh's training stages, sourced by it (not a script of its own): the
# preset's batch fitted to this machine's memory at the run's depth, or the --device-batch-size
# given instead, checked against the total batch (choose_device_batch). It reads setup.sh's globals
# (PRESET, DEPTH, SEQ, TBS, DBS, DBS_GIVEN, DBS_FLAG, VOCAB, ALL_PARAMS, GPU_NAME, GPU_CC, GPU_MEM_MIB,
# MEM_TOTAL_MIB, MEM_AVAIL_MIB, HOST_MEM, CG_NOTE) and its say/die helpers, and sets DBS (and DBS_FLAG).

# The device batch that fits: d20 bf16 (--kernel triton, compiled) on an H100, bench_train
# 2026-11-28: 18.5 / 22.5 / 30.4 / 46.4 GiB allocated at device batch 4 / 8 / 16 / 32, i.e. ~14.5 GiB
# (weights, gradients, optimizer state) + ~1.0 GiB per 2048-token sequence. Other depths scale the
# first part with all parameters and the second with depth x width (d12 at 32: predicted 16.1 GiB,
# measured 16.8); the rule adds 10% for the allocator's reserve and 1.5 GiB for the CUDA context and
# workspaces. In hundredths of a GiB (FIXED_CGIB, PER_SEQ_CGIB: set by choose_device_batch):
need_cgib() { echo $(( 110 * (FIXED_CGIB + PER_SEQ_CGIB * $1) / 100 + 150 )); }
fit_device_batch() {  # budget_mib cap -> the largest power-of-two batch <= cap that fits, or nothing
  local dbs
  for ((dbs = $2; dbs >= 1; dbs /= 2)); do
    if (( $(need_cgib "$dbs") * 1024 <= 100 * $1 )); then echo "$dbs"; return; fi
  done
}

# The memory a device batch is fitted to -> BUDGET_MIB (empty: none, the tiny preset) and
# BUDGET_WHERE (what it is, for the messages).
# h100 (any non-GB10 GPU): the GPU's memory (80 GB -> 32 at d20, 40-48 GB -> 16, 32 GB -> 8, 24 GB -> 4);
# spark: unified memory, so 3/4 of the host's total, the rest left to the OS, page cache, loader
# and eval (DESIGN.md pitfall 3). Total, not MemAvailable: the choice must not change between
# runs, since a changed base_train command reruns a finished stage.
# A GPU whose memory nvidia-smi does not report ("[N/A]": GB10 and other unified-memory parts) is
# budgeted as unified under either preset (h100 kept its batch of 32 there); a discrete GPU under
# --preset spark by the smaller of the two (3/4 of the host's memory sized the batch of a 24 GB card).
device_memory_budget() {
  BUDGET_MIB="" BUDGET_WHERE=""
  if [[ "$PRESET" != tiny && "$GPU_MEM_MIB" =~ ^[0-9]+$ && "$GPU_CC" != 12.1 && "$GPU_NAME" != *GB10* ]]; then
    BUDGET_MIB=$GPU_MEM_MIB BUDGET_WHERE="the $GPU_NAME's $((GPU_MEM_MIB / 1024)) GiB"
    if [[ "$PRESET" == spark ]] && (( MEM_TOTAL_MIB * 3 / 4 < GPU_MEM_MIB )); then
      BUDGET_MIB=$(( MEM_TOTAL_MIB * 3 / 4 )) BUDGET_WHERE="3/4 of $HOST_MEM $((MEM_TOTAL_MIB / 1024)) GiB$CG_NOTE"
    fi
  elif [[ "$PRESET" != tiny ]]; then
    BUDGET_MIB=$(( MEM_TOTAL_MIB * 3 / 4 )) BUDGET_WHERE="3/4 of the $((MEM_TOTAL_MIB / 1024)) GiB of unified memory$CG_NOTE"
    # each stage caps PyTorch's allocator at 90% of MemAvailable (or the cgroup's free part) at its start
    # (nanochat/platform.py): with other programs holding memory now, a batch fitted to 3/4 of the
    # total can run out at step 0
    if [[ "$MEM_AVAIL_MIB" =~ ^[0-9]+$ ]] && (( MEM_AVAIL_MIB > 0 && MEM_AVAIL_MIB * 9 / 10 < BUDGET_MIB )); then
      say "note: $((MEM_AVAIL_MIB / 1024)) GiB of the unified memory is available now; each stage caps its memory at" \
          "90% of what is available when it starts: close other programs first, or add --device-batch-size N" \
          "if a stage runs out of memory (NANOCHAT_GPU_MEMORY_CAP=<GB>|off overrides the cap)"
    fi
  fi
}

# DBS: the user's --device-batch-size (not fitted, but it must split the total batch into rows), else
# the preset's fitted to the budget; said when it differs from the preset's. Dies when none fits.
choose_device_batch() {
  local d20_all=$((12 * 1280 * 1280 * 20 + 12 * VOCAB * 1280)) fitted preset_dbs
  FIXED_CGIB=$((1450 * ALL_PARAMS / d20_all)) PER_SEQ_CGIB=$((DEPTH * DEPTH / 4))
  device_memory_budget
  if [[ $DBS_GIVEN -eq 1 ]]; then
    DBS_FLAG=$((10#$DBS_FLAG))
    (( TBS % (DBS_FLAG * SEQ) == 0 )) || die "--device-batch-size: got $DBS_FLAG; accepted: a divisor of" \
      "$((TBS / SEQ)) (the total batch of $TBS tokens is $((TBS / SEQ)) rows of $SEQ tokens)"
    # the preset's as fitted to this GPU: after an out-of-memory stop at a fitted 4, "the preset's is 32" misled
    fitted=""; [[ -z "$BUDGET_MIB" ]] || fitted="$(fit_device_batch "$BUDGET_MIB" "$DBS")"
    preset_dbs="$DBS"
    if [[ -n "$BUDGET_MIB" && -z "$fitted" ]]; then preset_dbs="$DBS; by the estimate, d$DEPTH fits $BUDGET_WHERE at none"
    elif [[ -n "$fitted" ]] && (( fitted != DBS )); then preset_dbs="$fitted for d$DEPTH in $BUDGET_WHERE"; fi
    say "device batch $DBS_FLAG (--device-batch-size; the preset's is $preset_dbs); the total batch stays $TBS tokens"
    DBS=$DBS_FLAG   # (tiny's mid / SFT step stays the preset's rows: a changed total could not resume)
  elif [[ -n "$BUDGET_MIB" ]]; then
    fitted="$(fit_device_batch "$BUDGET_MIB" "$DBS")"
    [[ -n "$fitted" ]] || die "d$DEPTH needs about $(( $(need_cgib 1) / 100 )) GiB at a device batch of 1; $BUDGET_WHERE is not" \
      "enough: rerun with a smaller --depth (e.g. $(( DEPTH * 3 / 5 > 0 ? DEPTH * 3 / 5 : 1 )))"
    if (( fitted != DBS )); then
      say "device batch $fitted (not $DBS) for d$DEPTH in $BUDGET_WHERE; the total batch stays $TBS tokens"
      DBS=$fitted
    fi
  fi
}
