#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 + the CuTe DSL) for the offline GPU box, in two carried halves.
#   bash scripts/fa4_install.sh pack      here (network): download the pinned wheels for the box
#                                         (CPython 3.12, x86_64, CUDA 13) into .fa4a/ and .fa4b/
#   bash scripts/fa4_install.sh install   on the box: unpack whichever half this call carried into
#                                         ${FA4_SITE:-/tmp/site}; a warm box keeps the other half
# Why halves: the CuTe DSL's CUDA 13 library wheel is 92 MB and one device call carries 64 MiB, so
# .fa4a holds its 193 MB MLIR module alone (xz, ~50 MB) and .fa4b the rest (~32 MB); carry .fa4a
# on one call and .fa4b (with .whl) on the next while the box is warm (it is released ~30 s idle).
# On a machine with network access none of this is needed: pip install -e '.[fa4]'.
set -euo pipefail
FA4_VERSION=4.0.0b36
DSL_VERSION=4.8.1
SITE=${FA4_SITE:-/tmp/site}
PY=${PYTHON:-python3}
IR=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so

pack() {
  local tmp; tmp=$(mktemp -d)
  local plat=(--python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64
              --platform manylinux2014_x86_64 --only-binary=:all: --no-deps -d "$tmp")
  $PY -m pip download -q "${plat[@]}" "flash-attn-4==$FA4_VERSION" "nvidia-cutlass-dsl==$DSL_VERSION" \
      "nvidia-cutlass-dsl-libs-base==$DSL_VERSION" "nvidia-cutlass-dsl-libs-core==$DSL_VERSION" \
      "nvidia-cutlass-dsl-libs-cu13==$DSL_VERSION" apache-tvm-ffi torch-c-dlpack-ext quack-kernels einops \
      cuda-bindings cuda-pathfinder
  rm -rf .fa4a .fa4b "$tmp/libs" && mkdir -p .fa4a .fa4b "$tmp/libs"
  (cd "$tmp/libs" && $PY -m zipfile -e "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl .)
  xz -T0 -9e -c "$tmp/libs/$IR" > .fa4a/ir.so.xz
  (cd "$tmp/libs" && sha256sum "$IR") > .fa4a/ir.so.sha256
  tar -C "$tmp/libs" --exclude="$(basename "$IR")" -cf - . | xz -T0 -6 > .fa4b/libs_cu13_rest.tar.xz
  mv "$tmp"/*.whl .fa4b/ && rm -f .fa4b/nvidia_cutlass_dsl_libs_cu13-*.whl
  rm -rf "$tmp"
  du -sh .fa4a .fa4b
}

install() {
  mkdir -p "$SITE"
  if [ -f .fa4a/ir.so.xz ]; then
    mkdir -p "$SITE/$(dirname "$IR")"
    xz -d -c .fa4a/ir.so.xz > "$SITE/$IR"
    (cd "$SITE" && sha256sum -c --quiet "$OLDPWD/.fa4a/ir.so.sha256") || { echo "fa4: MLIR module checksum mismatch"; exit 1; }
    echo "fa4: MLIR module unpacked into $SITE"
  fi
  if [ -f .fa4b/libs_cu13_rest.tar.xz ]; then
    # plain unzip, not pip --target: four of these wheels share the nvidia_cutlass_dsl/ folder
    for w in .fa4b/*.whl; do $PY -m zipfile -e "$w" "$SITE"; done
    tar -C "$SITE" -xJf .fa4b/libs_cu13_rest.tar.xz
    echo "fa4: wheels unpacked into $SITE"
  fi
  if [ -f "$SITE/$IR" ] && [ -d "$SITE/flash_attn" ]; then
    PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-} $PY -c \
      "import flash_attn.cute.interface as i; print('fa4: flash_attn.cute imports')"
  else
    echo "fa4: incomplete so far (carry .fa4a on one call and .fa4b on the next)"
  fi
}

case ${1:-} in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  pack) pack ;;
  install) install ;;
  *) echo "usage: bash scripts/fa4_install.sh pack|install" >&2; exit 2 ;;
esac
