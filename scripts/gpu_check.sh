#!/usr/bin/env bash
# GPU-box check for the platform layer: carried wheels, preflight, `pytest -m cuda`, benchmarks.
# Usage (repo root):  bash scripts/gpu_check.sh [quick|model|full]
#   quick: preflight, pytest -m cuda, GEMM and loss-kernel benchmarks (~4 min on an H100)
#   model: model-level kernel x precision benchmark, profile, roofline (~6 min)
# Logs go to $OUT (device tool) or ./out/gpu_check; the summary table is printed last.
set -uo pipefail
MODE=${1:-quick}
LOG=${OUT:-out/gpu_check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

# 1. wheels carried in .whl/ (liger-kernel, ...): installed into /tmp/site, never over the image
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || { echo "wheel install failed"; exit 1; }
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

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$LOG/nvidia_smi.log"
if [ "$MODE" != model ]; then
  step preflight 120 $PY -m nanochat.platform --kernel triton
  step pytest_cuda 200 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_platform.py tests/test_kernels.py tests/test_precision.py
  step bench_gemm 120 $PY -m scripts.bench_gemm --reps 7
  step bench_loss 150 $PY -m scripts.benchmark_kernels --mode loss --rows 16384 --n-embd 1280 --vocab 65536 \
       --kernels current,liger,triton,triton@8192,triton@16384
fi
if [ "$MODE" != quick ]; then
  step bench_model 300 $PY -m scripts.benchmark_kernels --mode model --depth 12 --device-batch-size 16 \
       --kernels current,triton,liger --precisions bf16,fp8
  step profile 120 $PY -m scripts.profile_training --depth 12 --device-batch-size 16 --kernel triton
  step roofline 150 $PY -m scripts.analyze_bandwidth --depth 12 --device-batch-size 16 --kernel triton --predict gb10
fi

echo; echo "=== summary"; printf '%s\n' "${status[@]}"
grep -h -A40 "^dtype " "$LOG/bench_gemm.log" 2>/dev/null | head -30
grep -h -A12 "^mode " "$LOG/bench_loss.log" "$LOG/bench_model.log" 2>/dev/null
