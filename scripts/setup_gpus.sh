# Sourced by setup.sh: which GPU the stages will run on, as CUDA_VISIBLE_DEVICES names it (setup.sh
# sizes the batch and picks the preset for that one, not nvidia-smi's first). Uses setup.sh's
# GPU_COUNT, HIDDEN_GPUS, warn and die.

# nvidia-smi's row (1-based) of the GPU CUDA calls device 0: CUDA_VISIBLE_DEVICES' first entry, an
# index or a (prefix of a) GPU- UUID, as CUDA reads it; nothing when it hides every GPU ("", "-1").
# An entry naming no GPU stops here: CUDA would see none and a GPU preset would train on the CPU.
# (An index is nvidia-smi's, i.e. CUDA's under CUDA_DEVICE_ORDER=PCI_BUS_ID.)
visible_gpu_row() {
  [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]] || { echo 1; return; }
  local first="${CUDA_VISIBLE_DEVICES%%,*}" row
  first="${first//[[:space:]]/}"
  [[ -n "$first" && "$first" != -* ]] || return 0
  if [[ "$first" =~ ^[0-9]+$ ]] && (( 10#$first < GPU_COUNT )); then echo $((10#$first + 1)); return; fi
  if [[ "$first" == GPU-* ]]; then
    row="$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null | awk -v p="$first" 'index($1, p) == 1 {print NR; exit}')"
    [[ -z "$row" ]] || { echo "$row"; return; }
  fi
  [[ "$first" == MIG-* ]] && { warn "CUDA_VISIBLE_DEVICES=$first: a MIG slice; sizing for the first GPU's memory (add --device-batch-size N to fit the slice)"; echo 1; return; }
  die "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES': its first entry '$first' names no GPU here; accepted: an index 0..$((GPU_COUNT - 1)) or a GPU UUID (nvidia-smi -L lists them), '' or -1 for none"
}
# The GPUs CUDA_VISIBLE_DEVICES shows, at most the GPUs there are. CUDA reads the list up to its first
# invalid entry (-1, an empty one, an index past the last GPU) and hides the rest, as torch's own
# parser does: "0,-1,1" is one GPU, and the "2 GPUs ... --nproc 2" advice it got before started a
# second rank that found no device. A repeated entry ("0,0", "1,0,1") shows none at all (torch's
# _parse_visible_devices: "Repeated ordinal results in empty set").
visible_gpu_count() {
  local n=0 entry seen="," in_range=1
  while IFS= read -r entry; do   # torch parses up to the first malformed entry, refuses a repeat
    entry="${entry//[[:space:]]/}"   # among those ("0,5,0": none), then keeps those before the first
    [[ -n "$entry" && "$entry" != -* ]] || break   # index past the last GPU
    [[ ! "$entry" =~ ^[0-9]+$ ]] || entry=$((10#$entry))
    [[ "$seen" != *",$entry,"* ]] || { echo 0; return; }
    seen+="$entry,"
    [[ ! "$entry" =~ ^[0-9]+$ ]] || (( entry < GPU_COUNT )) || in_range=0
    (( in_range )) && n=$((n + 1))
  done < <(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES")
  echo $(( n < GPU_COUNT ? n : GPU_COUNT ))
}
hidden_gpus() { echo "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides the $HIDDEN_GPUS GPU$( ((HIDDEN_GPUS == 1)) || echo s) nvidia-smi lists"; }
