#!/usr/bin/env bash
# GPU-box check: carried wheels, preflight, `pytest -m cuda`, benchmarks, short real runs.
# Usage (repo root):  bash scripts/gpu_check.sh SECTION[,SECTION...]
#   quick      preflight, pytest -m cuda (platform/kernels/precision), GEMM (square, d20 training-Linear
#              passes with the bf16 layout variants, the relu^2-epilogue MLP GEMMs), loss-kernel and
#              fp8-cast and QK-norm + RoPE backward benchmarks
#   tests      pytest -m cuda over tests/ (carry .whl/ with rustbpe, liger-kernel, cudnn-frontend, and
#              .devdata/shared/pretrain/tiny for the tiny-corpus fixtures); TEST_PATHS narrows it to some files,
#              TEST_HALF=1 / 2 runs half of the files each (the whole set is ~620 s, over one device call);
#              TEST_HALF=par both halves at once, one per GPU (2+ GPUs)
#   train      bench_train: d12 and d20, bf16, kernels current and triton (dbs 32, seq 2048, base_train's batch)
#   kernels    benchmark_kernels at d20 dbs 32: current/liger/triton x bf16/fp8
#   alttests   pytest -m cuda over tests/ with the Triton carried by scripts/alt_triton.sh (.altta, then .alttb
#              on the next call): the kernels on the Triton a fresh install gets, next to the box's torch
#   infer      bench_sampler (the Engine's sampler per call); bench_inference: d20 prefill, decode (graphs)
#              at batch 1/8/32, TTFT, bandwidth utilisation;
#              the same at a 1800-token prompt (bucket 2048: the window layers' KV reads matter), Triton
#              vs SDPA decode attention; the decode kernels (triton, triton_fused, sdpa) at batch 1/8;
#              eager/compile at batch 1 for comparison; graphs with q/k/v fused vs three matmuls; the
#              persistent batch-1 decode kernel vs the compiled graph
#   aot        the ahead-of-time compile check (nanochat/triton_aot.py) on this box's Triton: its CUDA test (the
#              prediction for this GPU = the real compile), scripts.triton_aot for h100-sxm and gb10, and the
#              persistent decode kernel's CUDA tests after its launch refactor
#   tiles      the persistent GEMMs' two tile sets (triton_mlp.tile_set): every tile of each set launched on its own
#              against torch (the small, GB10 set too: its arithmetic, on this GPU), and the CPU-side compile check of
#              both sets for the H100 and GB10 with this box's Triton
#   pdecode    the persistent batch-1 decode kernel: its CUDA tests, a tile sweep (bench_decode_kernel),
#              and end to end against the compiled CUDA-graph step
#   ring       the shared-memory weight ring probe (bench_gemv_ring) and its CUDA test
#   floor      the d20 bf16 micro-batch's matmuls + attention alone at the power cap (bench_train_floor), then
#              bench_train d20 triton bf16 at base_train's batch on the same machine (#4's 185k tok/s)
#   serving    continuous batching (nanochat/batching.py): its CUDA tests (per-row decode attention, batched
#              graphs = lone runs) and bench_serving d20: one request at a time vs 8 / 16 batch slots
#   pdepth     batch-1 decode vs model size: the persistent kernel alone at d20/d26/d32, d32 end to end
#   sync       does a weight stream slow the barriers of SMs that do not stream? (bench_sync_under_stream:
#              flag barrier vs LL tagged data); d20's GEMV chain on SMs in two roles (bench_two_role_chain:
#              CUDA via NVRTC, clusters, distributed shared memory); their CUDA tests
#   sampler    the Triton sampler: its CUDA tests with the engine's, bench_sampler, and decode end to end
#              with the Triton vs the torch sampler (batch 1: persistent and compiled steps; batch 8, 32)
#   model      model-level kernel x precision benchmark at d12, profile, roofline
#   scale      (2+ GPUs) NCCL busbw self-test, bench_scaling losses + FSDP2 + d20 throughput scaling,
#              and a torchrun resume check (20 steps vs 10 + resume 10: per-step losses compared)
#   fp8cmp     d20 base_train, 200 steps x 65,536 tokens, bf16 vs fp8 (native): tok/s and val bpb compared
#              (FP8CMP=fp8 runs only the fp8 half, FP8CMP=bf16 only the bf16 half)
#   fp8ab      bench_train d20 triton: bf16 vs fp8 vs fp8lean vs fp8plain (precision.set_fp8_wgrad_mode)
#              vs fp8mlp0 (fp8 without the fused fp8 MLP), then fp8 with relu^2's gradient cast as a pass (--unfuse ghcast)
#   attn       bench_attention: SDPA vs flex at d20 shapes and the flex kernel_options sweep (two halves)
#   fa4ab      --attn-backend cudnn_fa4 (cuDNN forward + FlashAttention-4 backward): its CUDA tests, bench_attention
#              rows, and bench_train d20 triton against cudnn (FA4AB_BACKENDS, FA4AB_PRECISION, FA4AB_BATCH;
#              needs .fa4a then .fa4b carried: scripts/fa4_install.sh)
#   te         Transformer Engine: install from .te/ (scripts/te_install.sh: the core wheel in parts, the torch
#              extension built against the box's torch), preflight, tests/test_te.py, d20 fp8 TE vs native
#   qkab       the q/k/v projections with QK-norm + RoPE in the GEMM's epilogue (nanochat/triton_qk.py): their CUDA
#              tests, bench_gemm --qk and --mlp (the shared GEMM core), then bench_train d20 triton bf16 at
#              QKAB_BATCH (default 262144) with it and with --unfuse qkgemm, alternating (QKAB_ORDER)
#   wcache     the once-per-step cast copies of the master weights (nanochat/weight_cache.py): their CUDA test, then
#              bench_train d20 triton bf16 at WCACHE_BATCH (default 524288) with and without (--unfuse
#              WCACHE_UNFUSE: default wcache; gsink = the gradient sinks only), in the order WCACHE_ORDER
#              (default "on off on")
#   mixab      each block's output summed inside the next fused mix-norm and x0's gradient summed inside its backward
#              (nanochat/fused_norm.py): its CUDA tests, then bench_train d20 triton bf16 at MIXAB_BATCH (default
#              524288) with and without (--unfuse MIXAB_UNFUSE, default mixadd,x0acc), in the order MIXAB_ORDER
#              (default "on off on")
#   refab      this tree vs REF_TREE (a copy of an earlier commit): REFAB_TESTS (pytest -m cuda paths), then
#              bench_train d20 triton bf16 at REFAB_BATCH (default 2^20) in the order REFAB_ORDER ("new ref new")
#   optab      the optimizer step alone (bench_optim d20): this tree vs REF_TREE alternating in OPTAB_ORDER (default
#              "new ref new ref"; the first run of each lists its top kernels; OPTAB_WD: Muon's weight decay, default 0),
#              then pytest -m cuda tests/test_optim.py tests/test_training.py
#   ckpt       checkpoint save / load of d20 with its optimizer state on the GPU (bench_checkpoint: plain
#              torch.save / load vs save_checkpoint / load_checkpoint, whose sums are hashed alongside the IO),
#              then tests/test_checkpoint.py
#   profaccum  profile_training d20 with PROF_ACCUM (default 4) micro-batches per optimizer step: phases and top
#              kernels of an accumulating step, as base_train runs it
#   prof20     profile_training at d20 dbs 32 --kernel triton: phase split and the top 40 kernels
#              (PROF_PRECISION=fp8 profiles the fp8 step; PROF_ATTN="cudnn cudnn_fa4" one per attention backend)
#   stop2      (2+ GPUs) a graceful stop under torchrun on NCCL: run_train.sh --nproc 2, --stop, both ranks
#              save at the agreed step (tests/test_run_train.py's CUDA case); whether this torch's torchrun
#              has --shutdown-timeout
#   rcost      what the default recipe's optimizer costs a d20 step: bench_optim d20 with NorMuon + cautious weight
#              decay (v2) vs neither (v1), then bench_train d20 triton bf16 at 2^20 under --recipe v1 and v2; with 2+
#              GPUs the bench_train pairs run at once, GPU 0 in the order v1 v2, GPU 1 v2 v1 (RCOST_BATCH)
#   int8       --quantize int8 (nanochat/quantize.py, triton_int8.py): its CUDA tests, bench_int8 (the kernel vs
#              bf16 cuBLAS per d20 matrix at 1/8/32 rows, with a tile sweep), bench_inference d20 graphs bf16
#              (compiled and persistent steps) vs int8 (compiled) at batch 1/8/32, and d32 at batch 1; with 2+ GPUs
#              the d32 half runs on GPU 1 at the same time
#   pint8      the persistent batch-1 step over int8 weights: CUDA tests (test_triton_decode's persistent ones,
#              test_quantize, test_gpu_timing), bench_decode_kernel d20 none vs int8 over PINT8_CONFIGS, then
#              bench_inference d20 batch 1 (persistent none/int8, compiled int8) and d32 batch 1 persistent
#              none/int8; with 2+ GPUs the kernel sweep and d32 run on GPU 1 at the same time
#   recipes    base_train under each --recipe on the docs corpus, final val bpb per run and seed
#              (compare_recipes; RECIPE_RUNS "v1;v2" entries split on ';', RECIPE_SEEDS "1", RECIPE_DEPTH 4,
#              RECIPE_RATIO 12 tokens per scaling parameter)
#   q8eval     --quantize int8's quality cost: a short d12 base_train on the docs corpus (Q8_ITERS, default 150
#              steps), then base_eval's validation bpb of that checkpoint with bf16 and with int8 matrices
#   d12run     a ~5-minute d12 base_train on the docs corpus (val bpb curve), base_eval, mid, SFT,
#              chat_eval and report.md (run it in the background and poll: see the README)
# Data for real runs: NANOCHAT_BASE_DIR (default .devdata, holding base_data/ + tokenizer/);
# offline test data: NANOCHAT_SHARED_DATA (default .devdata/shared). Both are carried by the
# device tool (they are git-ignored). Logs go to $OUT (device tool) or ./out/gpu_check; a summary
# table is printed last.
set -uo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then   # the comment above, before any install
  sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
SECTIONS=${1:-quick}
# every section this script runs (each is tested by `has NAME` below): a misspelt one ran nothing
KNOWN_SECTIONS=$(grep -o '\bhas [a-z0-9_]\+' "$0" | awk '{print $2}' | sort -u | tr '\n' ' ')
for section in ${SECTIONS//,/ }; do
  [[ " $KNOWN_SECTIONS" == *" $section "* ]] \
    || { echo "gpu_check.sh: unknown section '$section'; accepted: $KNOWN_SECTIONS(--help)" >&2; exit 2; }
done
LOG=${OUT:-out/gpu_check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
export NANOCHAT_BASE_DIR=${NANOCHAT_BASE_DIR:-$PWD/.devdata}
export NANOCHAT_SHARED_DATA=${NANOCHAT_SHARED_DATA:-$PWD/.devdata/shared}

# 1. wheels carried in .whl/ (liger-kernel, rustbpe, ...): installed into /tmp/site, never over the image
if compgen -G ".whl/*.whl" > /dev/null; then
  # under a lock: two gpu_check.sh runs at once (one per GPU) must not write /tmp/site together
  ( flock 9 && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl ) 9>/tmp/site.lock && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || { echo "wheel install failed"; exit 1; }
fi
# FlashAttention-4 for --attn-backend cudnn_fa4, carried in two halves (.fa4a, then .fa4b on the next
# call while the box is warm: scripts/fa4_install.sh); unpacked into /tmp/site too
if [ -d .fa4a ] || [ -d .fa4b ]; then
  FA4_SITE=/tmp/site bash scripts/fa4_install.sh install || { echo "fa4 install failed"; exit 1; }
fi
# another Triton (e.g. the one a fresh install gets), carried in parts .altta, .alttb, ... on successive
# calls (scripts/alt_triton.sh pack); once all parts are on the box it comes first on PYTHONPATH
if compgen -G ".altt?" > /dev/null; then
  bash scripts/alt_triton.sh install || { echo "alt-triton install failed"; exit 1; }
fi
if [ -d /tmp/alt-triton/triton ]; then
  export PYTHONPATH=/tmp/alt-triton:${PYTHONPATH:-}
  $PY -c "import torch, triton; print('alt-triton in use: torch', torch.__version__, 'triton', triton.__version__)"
fi
if [ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ]; then  # what the package's .pth file would add
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

status=()
step() {  # step NAME TIMEOUT CMD...: run, tee the log, remember pass/fail
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$LOG/$name.log"
  local rc=${PIPESTATUS[0]}
  status+=("$(printf '%-22s rc=%-4s %4ss' "$name" "$rc" "$((SECONDS - t0))")")
}
has() { [[ ",$SECTIONS," == *",$1,"* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$LOG/nvidia_smi.log"
if has quick; then
  step preflight 120 $PY -m nanochat.platform --kernel triton
  step pytest_cuda 200 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_platform.py tests/test_kernels.py tests/test_precision.py
  step bench_gemm 120 $PY -m scripts.bench_gemm --reps 7
  step bench_gemm_linears 200 $PY -m scripts.bench_gemm --reps 7 --dtypes bf16,fp8 --layouts \
       --linears 65536:1280x1280,65536:1280x5120,65536:5120x1280,65536:1280x32768
  step bench_gemm_mlp 120 $PY -m scripts.bench_gemm --reps 7 --mlp 65536:1280
  step bench_loss 150 $PY -m scripts.benchmark_kernels --mode loss --rows 16384 --n-embd 1280 --vocab 65536 \
       --kernels current,liger,triton,triton@8192,triton@16384
  step bench_cast 120 $PY -m scripts.benchmark_kernels --mode cast --rows 65536 --reps 30
  step bench_rope 120 $PY -m scripts.benchmark_kernels --mode rope --device-batch-size 32 --reps 30
fi
if has stop2; then
  step torchrun_grace 60 $PY -c "import dataclasses, torch; from torch.distributed.launcher.api import LaunchConfig as L
print('torch', torch.__version__, 'torchrun --shutdown-timeout:', 'shutdown_timeout' in {f.name for f in dataclasses.fields(L)})"
  step pytest_stop2 400 $PY -m pytest -q -m cuda -p no:cacheprovider -rs tests/test_run_train.py
fi
if has tests; then
  # every CUDA test in tests/ (a module whose optional dependency is missing skips with its install hint).
  # The whole set takes ~620 s on an H200 (2026-11-28), more than one device call may run: TEST_HALF=1
  # and then TEST_HALF=2 run the test files holding CUDA tests in two halves (alphabetical order);
  # TEST_HALF=par runs both halves at once, one per GPU (2+ GPUs; tests needing two GPUs skip there)
  paths=${TEST_PATHS:-tests/}
  if [[ -n "${TEST_HALF:-}" ]]; then
    mapfile -t cuda_files < <(grep -l "mark.cuda\|pytestmark = .*cuda" tests/test_*.py | sort)
    half=$(( (${#cuda_files[@]} + 1) / 2 ))
    case "$TEST_HALF" in
      1) paths="${cuda_files[*]:0:$half}" ;;
      2|par) paths="${cuda_files[*]:$half}" ;;
      *) echo "TEST_HALF: got '$TEST_HALF'; accepted: 1, 2 or par"; exit 2 ;;
    esac
  fi
  if [[ "${TEST_HALF:-}" == par ]]; then
    ngpu=$(nvidia-smi -L | wc -l)
    (( ngpu >= 2 )) || { echo "TEST_HALF=par needs 2 GPUs; this box has $ngpu"; exit 2; }
    t0=$SECONDS
    CUDA_VISIBLE_DEVICES=0 timeout 590 $PY -m pytest -q -m cuda -p no:cacheprovider -rs ${cuda_files[*]:0:$half} \
      > "$LOG/pytest_cuda_half1.log" 2>&1 & pid1=$!
    CUDA_VISIBLE_DEVICES=1 timeout 590 $PY -m pytest -q -m cuda -p no:cacheprovider -rs $paths \
      > "$LOG/pytest_cuda_half2.log" 2>&1 & pid2=$!
    wait $pid1; rc1=$?; wait $pid2; rc2=$?
    for h in 1 2; do echo "=== pytest_cuda_half$h (GPU $((h - 1)))"; tail -n 40 "$LOG/pytest_cuda_half$h.log"; done
    status+=("$(printf '%-22s rc=%-4s %4ss' pytest_cuda_half1 "$rc1" "$((SECONDS - t0))")")
    status+=("$(printf '%-22s rc=%-4s %4ss' pytest_cuda_half2 "$rc2" "$((SECONDS - t0))")")
  else
    step pytest_cuda_all 590 $PY -m pytest -q -m cuda -p no:cacheprovider -rs $paths
  fi
fi
if has alttests; then
  # with scripts/alt_triton.sh's Triton: the CUDA tests of the files holding our Triton kernels (ALT_TESTS);
  # a test that goes through torch.compile also runs the box's inductor on that Triton, which may not work
  ALT_TESTS=${ALT_TESTS:-"tests/test_kernels.py tests/test_precision.py tests/test_fused_norm.py tests/test_triton_mlp.py tests/test_triton_qk.py
    tests/test_fp8_qk.py tests/test_triton_decode.py tests/test_sampling.py tests/test_attention.py tests/test_triton_aot.py"}
  step pytest_cuda_alt 560 $PY -m pytest -q -m cuda -p no:cacheprovider -rfEs $ALT_TESTS
fi
if has infer; then
  # graphs (the CUDA default) at batch 1/8/32 with a kernel profile of one batch-1 step, then the
  # dynamic-shape modes it replaces at batch 1 for comparison (compile at batch 32 takes minutes)
  step bench_infer 420 $PY -m scripts.bench_inference --depth 20 --batch-sizes 1,8,32 --decode graphs --profile \
       --ttft-lengths 512,1000,40,777,1500
  step bench_sampler 120 $PY -m scripts.bench_sampler --vocab-size 32768 --batch 1
  step bench_infer_cmp 300 $PY -m scripts.bench_inference --depth 20 --batch-sizes 1 --decode eager,compile --repeats 2
  step bench_infer_long 500 $PY -m scripts.bench_inference --depth 20 --batch-sizes 1,8,32 --decode graphs --prompt-len 1800 \
       --decode-kernel triton_fused,sdpa
  step bench_infer_kernels 450 $PY -m scripts.bench_inference --depth 20 --batch-sizes 1,8 --decode graphs \
       --decode-kernel triton,triton_fused,sdpa
  step bench_infer_qkv 300 $PY -m scripts.bench_inference --depth 20 --batch-sizes 1,8 --decode graphs --fused-qkv on,off
  step bench_infer_persistent 300 $PY -m scripts.bench_inference --depth 20 --batch-sizes 1 --decode graphs \
       --graph-step persistent,compiled
fi
if has aot; then
  step pytest_aot 400 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_triton_aot.py tests/test_triton_decode.py \
       tests/test_triton_mlp.py tests/test_triton_qk.py tests/test_engine.py tests/test_engine_static.py
  step triton_aot 400 $PY -m scripts.triton_aot --targets h100-sxm,gb10
fi
if has tiles; then
  step pytest_tiles 500 $PY -m pytest -q -p no:cacheprovider -rs tests/test_triton_mlp.py tests/test_triton_qk.py \
       tests/test_triton_aot.py -k "every_tile or tile_sets or every_kernel or prediction or matches_plain"
fi
if has pdecode; then
  # the persistent batch-1 kernel: its CUDA tests, a tile sweep of the kernel alone
  # (PDECODE_CONFIGS overrides the list), then end to end against the compiled graph step
  step pytest_pdecode 240 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_triton_decode.py tests/test_engine.py tests/test_engine_static.py \
       -k "persistent or auto or trace"
  step bench_pdecode 300 $PY -m scripts.bench_decode_kernel --depth 20 \
       --trace --configs "${PDECODE_CONFIGS:-16x256x512,16x256x512p0,16x256x1024,16x256x512u6,16x256x512f32,16x512x512}"
  step bench_infer_persistent 300 $PY -m scripts.bench_inference --depth 20 --batch-sizes 1 --decode graphs \
       --graph-step persistent,compiled
fi
if has pdepth; then
  # batch-1 decode against model size: the persistent kernel alone at d20 / d26 / d32 (layers of 39 / 66 / 101 MB),
  # then d32 end to end against the compiled graph step (CHANGELOG_GB10.md, session 25)
  for d in 20 26 32; do
    step bench_pdecode_d$d 300 $PY -m scripts.bench_decode_kernel --depth $d --configs 16x256x512,16x256x1024
  done
  step bench_infer_d32 400 $PY -m scripts.bench_inference --depth 32 --batch-sizes 1 --decode graphs \
       --graph-step persistent,compiled
fi
if has serving; then
  step pytest_serving 400 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_batching.py tests/test_attention.py \
       -k "batched or per_row or static_decode"
  step bench_serving 480 $PY -m scripts.bench_serving --depth 20 --slots ${SERVING_SLOTS:-1,8,16} \
       --clients ${SERVING_CLIENTS:-16} --requests ${SERVING_REQUESTS:-48}
fi
if has floor; then
  # what a d20 bf16 micro-batch cannot go below while the board sits at its power cap
  step bench_floor 300 $PY -m scripts.bench_train_floor --depth 20 --parts all --seconds ${FLOOR_SECONDS:-20}
  step bench_train_d20 420 $PY -m scripts.bench_train --depth 20 --kernel triton --precision bf16
fi
if has qkab; then
  step pytest_qk 400 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_triton_qk.py tests/test_triton_mlp.py \
       tests/test_fp8_qk.py
  step bench_gemm_qk 150 $PY -m scripts.bench_gemm --reps 7 --qk 65536:1280
  step bench_gemm_mlp 150 $PY -m scripts.bench_gemm --reps 7 --mlp 65536:1280 --dtypes bf16
  for arm in ${QKAB_ORDER:-fused unfused}; do
    unfuse=(); [ "$arm" = unfused ] && unfuse=(--unfuse qkgemm)
    step "bench_train_qk_$arm" 420 $PY -m scripts.bench_train --depth 20 --kernel triton --precision bf16 \
         --total-batch-size "${QKAB_BATCH:-262144}" "${unfuse[@]}"
  done
fi
bench_d20() {  # bench_d20 NAME DIR BATCH [ARGS...]: bench_train d20 triton bf16 run from the tree in DIR
  local name=$1 dir=$2 batch=$3; shift 3
  step "$name" 420 env -C "$dir" PYTHONPATH="$dir:${PYTHONPATH#$PWD:}" $PY -m scripts.bench_train --depth 20 \
       --kernel triton --precision bf16 --total-batch-size "$batch" "$@"
}
ab_train() {  # ab_train TAG UNFUSE BATCH "ARMS": bench_d20 per arm, on = every fusion, off = --unfuse UNFUSE
  local tag=$1 name=$2 batch=$3 n=0 arm
  for arm in $4; do
    local unfuse=(); [ "$arm" = off ] && unfuse=(--unfuse "$name")
    n=$((n + 1))
    bench_d20 "bench_train_${tag}_${arm}_$n" "$PWD" "$batch" "${unfuse[@]}"
  done
}
if has wcache; then
  step pytest_wcache 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_weight_cache.py
  ab_train wcache "${WCACHE_UNFUSE:-wcache}" "${WCACHE_BATCH:-524288}" "${WCACHE_ORDER:-on off on}"
fi
if has mixab; then
  # each block's MLP output added inside the next block's fused mix-norm, and x0's gradient summed inside its
  # backward, vs a separate pass for each (--unfuse mixadd,x0acc; MIXAB_UNFUSE=mixadd or x0acc for one of them)
  step pytest_mixadd 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_fused_norm.py tests/test_gpt.py \
       tests/test_weight_cache.py
  ab_train mixadd "${MIXAB_UNFUSE:-mixadd,x0acc}" "${MIXAB_BATCH:-524288}" "${MIXAB_ORDER:-on off on}"
fi
if has refab; then
  # this tree against a reference copy of an earlier commit (REF_TREE, e.g. `git archive HEAD~1 | tar -x -C
  # .devjob/ref`, carried): their CUDA tests first (REFAB_TESTS), then bench_train d20 triton bf16 at
  # REFAB_BATCH (default 1048576, base_train's) alternating in REFAB_ORDER (default "new ref new")
  [ -n "${REF_TREE:-}" ] && [ -d "$REF_TREE/nanochat" ] || { echo "refab: set REF_TREE to a copy of the old tree"; exit 1; }
  [ -n "${REFAB_TESTS:-}" ] && step pytest_refab 500 $PY -m pytest -q -m cuda -p no:cacheprovider $REFAB_TESTS
  n=0
  for arm in ${REFAB_ORDER:-new ref new}; do
    n=$((n + 1))
    dir=$PWD; [ "$arm" = ref ] && dir=$REF_TREE
    bench_d20 "bench_train_refab_${arm}_$n" "$dir" "${REFAB_BATCH:-1048576}"
  done
fi
if has optab; then
  # MuonAdamW.step() of this tree against REF_TREE's on one machine (bench_optim is copied into the reference)
  [ -n "${REF_TREE:-}" ] && [ -d "$REF_TREE/nanochat" ] || { echo "optab: set REF_TREE to a copy of the old tree"; exit 1; }
  cp scripts/bench_optim.py "$REF_TREE/scripts/"
  n=0
  for arm in ${OPTAB_ORDER:-new ref new ref}; do
    n=$((n + 1))
    dir=$PWD; [ "$arm" = ref ] && dir=$REF_TREE
    top=0; [ $n -le 2 ] && top=25
    step "bench_optim_${arm}_$n" 300 env -C "$dir" PYTHONPATH="$dir:${PYTHONPATH#$PWD:}" $PY -m scripts.bench_optim \
         --depth 20 --steps 30 --top $top --weight-decay "${OPTAB_WD:-0}"
  done
  step pytest_optim 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_optim.py tests/test_training.py
fi
if has ckpt; then
  step bench_checkpoint 600 $PY -m scripts.bench_checkpoint --depth 20 --reps ${CKPT_REPS:-3}
  step pytest_checkpoint 200 $PY -m pytest -q -p no:cacheprovider tests/test_checkpoint.py
fi
if has profaccum; then
  # where an accumulating step's time goes (base_train's shape: micro-batches 2..n add into .grad)
  step profile_d20_accum 420 $PY -m scripts.profile_training --depth 20 --device-batch-size 32 --kernel triton \
    --precision "${PROF_PRECISION:-bf16}" --accum ${PROF_ACCUM:-4} --steps 4 --warmup 2 --profile-steps 1 --top ${PROF_TOP:-50}
fi
if has sync; then
  # SMs in two roles (CHANGELOG_GB10.md, session 24): the syncers' barrier + live load per round, idle vs streaming
  step pytest_sync 180 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_triton_decode.py \
    -k "sync_under_stream or two_role"
  step bench_sync 240 $PY -m scripts.bench_sync_under_stream --streamers 33,66,99,120 --placement halves,parity \
    --x live,none,ll
  step bench_sync_d2 120 $PY -m scripts.bench_sync_under_stream --streamers 66,120,126 --placement parity --depth 2 \
    --stream-mb 4096
  step bench_two_role 300 $PY -m scripts.bench_two_role_chain --cluster 2,4,8 --inflight 1,2,3 --group 1,2
fi
if has ring; then
  # the shared-memory weight ring probe (CHANGELOG_GB10.md, session 23): its CUDA test, then the chain taken apart
  step pytest_ring 120 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_triton_decode.py -k gemv_ring
  step bench_ring 240 $PY -m scripts.bench_gemv_ring --mode cpasync --depths 1,4,10 --x live,const,none
fi
if has sampler; then
  step pytest_sampler 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_sampling.py tests/test_engine.py tests/test_engine_static.py \
       tests/test_triton_decode.py
  step bench_sampler 120 $PY -m scripts.bench_sampler --vocab-size 32768 --batch 1
  step bench_sampler_b32 120 $PY -m scripts.bench_sampler --vocab-size 32768 --batch 32 --calls 100
  step bench_infer_sampler 400 $PY -m scripts.bench_inference --depth 20 --batch-sizes 1 --decode graphs \
       --graph-step persistent,compiled --sampler auto,torch
  step bench_infer_sampler_b 400 $PY -m scripts.bench_inference --depth 20 --batch-sizes 8,32 --decode graphs \
       --sampler auto,torch
fi
if has train; then
  step bench_train 1000 $PY -m scripts.bench_train --depth 12,20 --kernel current,triton --precision bf16
fi
if has kernels; then
  # d20, dbs 32, seq 2048: the three loss backends in bf16, then fp8 (native tensor-wise) with triton
  step bench_kernels_d20 330 $PY -m scripts.benchmark_kernels --mode model --depth 20 --device-batch-size 32 \
       --kernels current,liger,triton --precisions bf16 --reps 10
  step bench_fp8_d20 150 $PY -m scripts.benchmark_kernels --mode model --depth 20 --device-batch-size 32 \
       --kernels triton --precisions fp8 --reps 10
  step roofline_d20 120 $PY -m scripts.analyze_bandwidth --depth 20 --device-batch-size 32 --kernel triton --predict gb10
fi
if has model; then
  step bench_model 300 $PY -m scripts.benchmark_kernels --mode model --depth 12 --device-batch-size 16 \
       --kernels current,triton,liger --precisions bf16,fp8
  step profile 120 $PY -m scripts.profile_training --depth 12 --device-batch-size 16 --kernel triton
  step roofline 150 $PY -m scripts.analyze_bandwidth --depth 12 --device-batch-size 16 --kernel triton --predict gb10
fi
if has scale; then
  NG=$(nvidia-smi -L | wc -l)
  step nccl 120 $PY -m nanochat.platform --nccl
  step scaling_losses 900 $PY -m scripts.bench_scaling --gpus "$NG" --parts losses,fsdp
  step scaling_tput 600 $PY -m scripts.bench_scaling --gpus "$NG" --parts throughput
  RT=(--depth 12 --device-batch-size 16 --max-seq-len 2048 --total-batch-size $((NG * 16 * 2048)) --num-iterations 20
      --save-every 10 --eval-every 10 --eval-tokens 262144 --sample-every -1 --model-tag scale --wandb off)
  step resume_full 420 $PY -m torch.distributed.run --standalone --nproc_per_node="$NG" -m scripts.base_train "${RT[@]}"
  step resume_from10 420 $PY -m torch.distributed.run --standalone --nproc_per_node="$NG" -m scripts.base_train \
       "${RT[@]}" --resume 10
  step resume_compare 30 $PY -m scripts.compare_logs "$LOG/resume_full.log" "$LOG/resume_from10.log" --from-step 11
fi
if has attn; then
  step attn_fwd_sweep 420 $PY -m scripts.bench_attention --reps 30 \
       --only f128x128_w8_s2,f128x128_w8_s3,f128x64_w4_s3,f64x64_w4_s3,f64x128_w4_s3,tma,prescale_qk
  step attn_bwd_sweep 420 $PY -m scripts.bench_attention --reps 30 \
       --only b64x64_w4_s3,b32x64_w4_s3,b64x128_w8_s2,b128x128_w8_s2,bs64,bs256
fi
if has fp8ab; then
  step fp8ab 1200 $PY -m scripts.bench_train --depth 20 --kernel triton --precision bf16,fp8,fp8lean,fp8plain,fp8mlp0
  # relu^2's gradient cast in its GEMM's epilogue (triton_mlp.gh_bound_scale) vs a separate pass
  step fp8ab_ghcast 400 $PY -m scripts.bench_train --depth 20 --kernel triton --precision fp8 --unfuse ghcast
fi
if has fa4ab; then
  # cuDNN forward + FlashAttention-4 backward (--attn-backend cudnn_fa4) against cuDNN alone
  step fa4_tests 400 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_attention.py tests/test_gpt.py -k "cudnn or fa4 or cuda_compiled"
  step fa4_bench_attention 200 $PY -m scripts.bench_attention --no-sweep --reps 20
  fa4ab_backends=${FA4AB_BACKENDS:-cudnn_fa4,cudnn}
  for backend in ${fa4ab_backends//,/ }; do  # a comma list
    step "fa4ab_$backend" 560 $PY -m scripts.bench_train --depth 20 --kernel triton --precision "${FA4AB_PRECISION:-bf16}" \
         --attn-backend "$backend" --total-batch-size "${FA4AB_BATCH:-1048576}"
  done
fi
if has te; then
  # Transformer Engine from the parts carried in .te/ (scripts/te_install.sh), then its tests and the
  # d20 fp8 step through TE against native fp8 at the same batch
  step te_install 500 bash scripts/te_install.sh
  [[ "${status[-1]}" == *"rc=0 "* ]] || { printf '%s\n' "${status[@]}"; echo "te: install failed, see te_install.log"; exit 1; }
  export PYTHONPATH=${TE_SITE:-/tmp/te-site}:$PYTHONPATH
  step te_preflight 120 $PY -m nanochat.platform --kernel triton --precision fp8 --precision-backend te
  step te_pytest 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_te.py
  step te_bench 560 $PY -m scripts.bench_train --depth 20 --kernel triton --precision fp8 \
       --precision-backend te,native --total-batch-size "${TE_BATCH:-262144}"
fi
if has prof20; then
  for backend in ${PROF_ATTN:-auto}; do  # PROF_ATTN="cudnn cudnn_fa4": one profile per attention backend
    step "profile_d20_$backend" 300 $PY -m scripts.profile_training --depth 20 --device-batch-size 32 --kernel triton \
         --top 40 --precision "${PROF_PRECISION:-bf16}" --attn-backend "$backend"
  done
fi
if has d12run; then
  # the carried data, checked before any GPU work (a file once went missing in transit)
  for f in base_data tokenizer/tokenizer.pkl eval_data/arc_easy.jsonl eval_data/arc_challenge.jsonl eval_data/mmlu.jsonl \
           eval_data/gsm8k.jsonl eval_data/humaneval.jsonl eval_data/words.txt sft_data; do
    [[ -e "$NANOCHAT_BASE_DIR/$f" ]] || { echo "d12run: missing $NANOCHAT_BASE_DIR/$f (carry .devdata)"; exit 1; }
  done
  # d12 on the docs corpus (seq 2048, dbs 32, 2**19 tokens/step; ~1 s/step on an H100), then the chat
  # stages on the offline conversation/eval files (train on test files minus the first 500 problems;
  # chat_eval scores only those first problems). CORE needs the full eval folder: not carried here.
  step d12_report_reset 30 $PY -m nanochat.report reset  # this run's environment and start; no earlier sections
  step d12_base 600 $PY -m scripts.base_train --depth 12 --device-batch-size 32 --total-batch-size 524288 \
       --num-iterations ${D12_ITERS:-150} --eval-every 40 --eval-tokens 2097152 --sample-every -1 --kernel triton \
       --model-tag d12 --wandb off
  step d12_base_eval 300 $PY -m scripts.base_eval --model-tag d12 --eval bpb,sample
  step d12_mid 420 $PY -m scripts.mid_train --model-tag d12 --device-batch-size 32 --max-seq-len 2048 \
       --num-iterations ${MID_ITERS:-60} --test-holdout 500 --wandb off
  step d12_sft 300 $PY -m scripts.chat_sft --model-tag d12 --device-batch-size 16 --max-seq-len 2048 \
       --num-iterations ${SFT_ITERS:-60} --test-holdout 500 --wandb off
  step d12_chat_eval 420 $PY -m scripts.chat_eval -i sft --model-tag d12 --max-problems ${MAX_PROBLEMS:-50}
  step d12_report 60 $PY -m nanochat.report generate
  cp "$NANOCHAT_BASE_DIR/report/report.md" "$LOG/report.md" 2>/dev/null
fi

if has q8eval; then
  # what --quantize int8 costs in quality: a short d12 base_train on the docs corpus, then base_eval's
  # validation bpb of the same checkpoint with bf16 and with int8 matrices (Q8_ITERS steps, default 150)
  [[ -e "$NANOCHAT_BASE_DIR/base_data" && -e "$NANOCHAT_BASE_DIR/tokenizer/tokenizer.pkl" ]] \
    || { echo "q8eval: missing $NANOCHAT_BASE_DIR/base_data or tokenizer (carry .devdata)"; exit 1; }
  step q8_base 600 $PY -m scripts.base_train --depth 12 --device-batch-size 32 --total-batch-size 524288 \
       --num-iterations ${Q8_ITERS:-150} --eval-every -1 --sample-every -1 --kernel triton --model-tag q8d12 \
       --overwrite --wandb off
  for q in none int8; do
    step "q8_eval_$q" 300 $PY -m scripts.base_eval --model-tag q8d12 --eval bpb --quantize $q
  done
fi

if has rcost; then
  for arm in v1 v2; do
    nb=0; wd=0; [ "$arm" = v2 ] && nb=0.95 && wd=0.1
    step "bench_optim_$arm" 300 $PY -m scripts.bench_optim --depth 20 --steps 30 --top 20 --normuon-beta2 $nb \
         --weight-decay $wd
  done
  ngpu=$(nvidia-smi -L | wc -l)
  rcost_pair() {  # rcost_pair GPU "ORDER": bench_train d20 per recipe in ORDER on one GPU, logs bench_train_rcost_*
    local n=0 r
    for r in $2; do
      n=$((n + 1))
      CUDA_VISIBLE_DEVICES=$1 timeout 420 $PY -m scripts.bench_train --depth 20 --kernel triton --precision bf16 \
        --total-batch-size "${RCOST_BATCH:-1048576}" --recipe "$r" > "$LOG/bench_train_rcost_g$1_${r}_$n.log" 2>&1
    done
  }
  t0=$SECONDS
  rcost_pair 0 "v1 v2" &
  [ "$ngpu" -ge 2 ] && rcost_pair 1 "v2 v1" &
  wait
  status+=("$(printf '%-22s %4ss' rcost_bench_train "$((SECONDS - t0))")")
fi
if has int8; then
  int8_half2() {
    CUDA_VISIBLE_DEVICES=$1 timeout 300 $PY -m scripts.bench_int8 --rows ${INT8_ROWS:-1,8,32} ${INT8_SWEEP:---sweep} \
      > "$LOG/bench_int8.log" 2>&1
    CUDA_VISIBLE_DEVICES=$1 timeout 400 $PY -m scripts.bench_inference --depth 32 --batch-sizes 1 --decode graphs \
      --graph-step compiled --quantize none,int8 --decode-tokens 128 > "$LOG/bench_inference_d32_int8.log" 2>&1
  }
  ngpu=$(nvidia-smi -L | wc -l)
  if [ "$ngpu" -ge 2 ]; then int8_half2 1 & fi
  step pytest_quantize 300 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_quantize.py
  step bench_inference_int8 500 $PY -m scripts.bench_inference --depth 20 --batch-sizes ${INT8_BATCHES:-1,8,32} \
       --decode graphs --graph-step ${INT8_STEPS:-compiled,persistent} --quantize none,int8
  if [ "$ngpu" -ge 2 ]; then wait; else int8_half2 0; fi
  tail -25 "$LOG/bench_int8.log"; tail -6 "$LOG/bench_inference_d32_int8.log"
fi
if has pint8; then
  pint8_half2() {
    CUDA_VISIBLE_DEVICES=$1 timeout 400 $PY -m scripts.bench_decode_kernel --depth 20 --quantize none,int8 --configs \
      "${PINT8_CONFIGS:-16x256x512,16x256x1024,16x512x1024,32x256x1024q64f128,16x512x1024u3}" \
      > "$LOG/bench_pdecode_int8.log" 2>&1
    CUDA_VISIBLE_DEVICES=$1 timeout 400 $PY -m scripts.bench_inference --depth 32 --batch-sizes 1 --decode graphs \
      --graph-step persistent --quantize none,int8 --decode-tokens 128 > "$LOG/bench_inference_d32_pint8.log" 2>&1
  }
  ngpu=$(nvidia-smi -L | wc -l)
  if [ "$ngpu" -ge 2 ]; then pint8_half2 1 & fi
  step pytest_pint8 400 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_triton_decode.py tests/test_quantize.py \
       tests/test_gpu_timing.py -k "persistent or quantize or int8 or timing or graph"
  step bench_inference_pint8 400 $PY -m scripts.bench_inference --depth 20 --batch-sizes 1 --decode graphs \
       --graph-step persistent,compiled --quantize none,int8 --decode-tokens 128
  if [ "$ngpu" -ge 2 ]; then wait; else pint8_half2 0; fi
  tail -14 "$LOG/bench_pdecode_int8.log"; tail -6 "$LOG/bench_inference_d32_pint8.log"
fi
if has recipes; then
  # base_train under each recipe on the docs corpus, final val bpb (scripts/compare_recipes.py).
  # RECIPE_RUNS: entries separated by ';' (a recipe, then optional base_train flags)
  IFS=';' read -ra RR <<< "${RECIPE_RUNS:-v1;v2}"
  read -ra RS <<< "${RECIPE_SEEDS:-1}"
  step recipes "${RECIPE_TIMEOUT:-560}" $PY -m scripts.compare_recipes --runs "${RR[@]}" --seeds "${RS[@]}" -- \
       --depth "${RECIPE_DEPTH:-4}" --target-param-data-ratio "${RECIPE_RATIO:-12}" --max-seq-len 2048 \
       --device-batch-size 32 --eval-tokens 1048576 --kernel triton
fi

if has fp8cmp; then
  # same seed, data and schedule; only the precision differs (tok/s = the step lines' median)
  FC=(--depth 20 --device-batch-size 32 --max-seq-len 2048 --total-batch-size 65536 --num-iterations 200
      --eval-every 100 --eval-tokens 2097152 --sample-every -1 --kernel triton --wandb off)
  FP8CMP=${FP8CMP:-bf16,fp8}
  [[ ",$FP8CMP," == *",bf16,"* ]] && step d20_bf16_200 600 $PY -m scripts.base_train "${FC[@]}" --precision bf16 --model-tag d20bf16
  [[ ",$FP8CMP," == *",fp8,"* ]] && step d20_fp8_200 600 $PY -m scripts.base_train "${FC[@]}" --precision fp8 \
       --precision-backend native --model-tag d20fp8
  [[ "$FP8CMP" == "bf16,fp8" ]] && step fp8_vs_bf16 30 $PY -m scripts.compare_logs "$LOG/d20_bf16_200.log" "$LOG/d20_fp8_200.log" --from-step 100 --tol 0.05
fi

echo; echo "=== summary"; printf '%s\n' "${status[@]}"
for f in "$LOG"/bench_train_*_[0-9]*.log; do   # the A/B sections' runs, in the order run: each one's table row
  [ -f "$f" ] && printf '%-34s %s\n' "$(basename "$f" .log)" "$(grep -E '^ +20 +triton' "$f" | tail -1)"
done
grep -h -A40 "^dtype " "$LOG/bench_gemm.log" 2>/dev/null | head -30
grep -h -A12 "^mode " "$LOG/bench_loss.log" "$LOG/bench_model.log" "$LOG/bench_kernels_d20.log" 2>/dev/null
# the exit code says whether every step passed (not what the last grep above found)
for s in "${status[@]}"; do [[ "$s" =~ rc=[1-9] ]] && exit 1; done
exit 0
