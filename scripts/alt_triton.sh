#!/usr/bin/env bash
# Another Triton for the offline GPU box (e.g. the one a fresh install gets), carried in parts.
#   bash scripts/alt_triton.sh pack [VERSION]   here (network): download Triton VERSION (default 3.9.0)
#                                               for CPython 3.12 x86_64, keep what an NVIDIA GPU needs,
#                                               and split it into .altta/, .alttb/, ... (< 64 MiB each)
#   bash scripts/alt_triton.sh install          on the box: keep the parts this call carried in
#                                               /tmp/alt-triton-parts; once all are there, unpack into
#                                               /tmp/alt-triton (gpu_check.sh puts it first on PYTHONPATH)
# Why: the box has torch 2.11 + Triton 3.6, while `./setup.sh` installs today's torch (2.15) + Triton
# (3.9); the wheels are far over one call's 64 MiB. Triton alone is 272 MB; without the AMD backend,
# CUPTI and proton it is ~105 MB zstd-compressed, in two parts, and its CUDA 13 ptxas-blackwell (which
# Triton 3.9 runs for sm_90 too; an older ptxas there gave NaNs in the fp8 kernels) is a third: carry
# .altta, .alttb and .alttc on successive calls while the box is warm (released ~30 s idle). Our
# kernels are plain @triton.jit launches, so they run on it next to torch 2.11; inductor may not.
set -euo pipefail
PY=${PYTHON:-python3}
PARTS=/tmp/alt-triton-parts
DEST=/tmp/alt-triton
PART_BYTES=$((52 * 1024 * 1024))

pack() {
  local version=${1:-3.9.0} tmp; tmp=$(mktemp -d)
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$tmp" \
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 "triton==$version"
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$tmp" \
      --platform manylinux_2_17_x86_64 zstandard
  mkdir "$tmp/t" && $PY -m zipfile -e "$tmp"/triton-*.whl "$tmp/t"
  (cd "$tmp/t/triton" && rm -rf backends/amd backends/nvidia/lib/cupti backends/nvidia/lib/cupti-blackwell \
      _C/libproton.so instrumentation/*.so)
  mv "$tmp/t/triton/backends/nvidia/bin/ptxas-blackwell" "$tmp/ptxas-blackwell"
  tar -C "$tmp/t" -cf - . | zstd -19 -T0 --long=27 -q -o "$tmp/triton.tar.zst"
  rm -rf .altt? && split -b "$PART_BYTES" -d -a 2 "$tmp/triton.tar.zst" "$tmp/part"
  local n=0 letters=(a b c d e f g h) p
  for p in "$tmp"/part??; do
    mkdir -p ".altt${letters[$n]}" && mv "$p" ".altt${letters[$n]}/"; n=$((n + 1))
  done
  mv "$tmp"/zstandard-*.whl .altta/
  mkdir -p ".altt${letters[$n]}" && zstd -19 -q -o ".altt${letters[$n]}/ptxas-blackwell.zst" "$tmp/ptxas-blackwell"
  printf 'version=%s\nparts=%s\nsha256=%s\n' "$version" "$n" "$(sha256sum "$tmp/triton.tar.zst" | cut -d' ' -f1)" \
      > .altta/MANIFEST
  rm -rf "$tmp"
  du -sh .altt?
}

ptxas_blackwell() {  # Triton 3.9 compiles sm_90 with it too: carried compressed on its own (.alttc)
  local bin="$DEST/triton/backends/nvidia/bin/ptxas-blackwell"
  if [ -f "$PARTS/ptxas-blackwell.zst" ] && [ -d "$DEST/triton" ] && [ ! -x "$bin" ]; then
    PYTHONPATH="$PARTS/zstd" $PY -c "import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(open(sys.argv[1], 'rb'), open(sys.argv[2], 'wb'))" \
      "$PARTS/ptxas-blackwell.zst" "$bin" && chmod +x "$bin" && "$bin" --version | tail -1
  fi
}

install() {
  mkdir -p "$PARTS"
  local d
  for d in .altt?; do [ -d "$d" ] && cp "$d"/* "$PARTS/"; done
  [ -f "$PARTS/MANIFEST" ] || { echo "alt-triton: no MANIFEST yet (carry .altta)"; return 0; }
  local want have sha
  want=$(sed -n 's/^parts=//p' "$PARTS/MANIFEST"); have=$(ls "$PARTS"/part?? 2>/dev/null | wc -l)
  if [ "$have" -lt "$want" ]; then echo "alt-triton: $have of $want parts so far"; return 0; fi
  [ -d "$DEST/triton" ] && { echo "alt-triton: already unpacked in $DEST"; ptxas_blackwell; return 0; }
  cat "$PARTS"/part?? > "$PARTS/triton.tar.zst"
  sha=$(sed -n 's/^sha256=//p' "$PARTS/MANIFEST")
  echo "$sha  $PARTS/triton.tar.zst" | sha256sum -c --quiet || { echo "alt-triton: checksum mismatch"; exit 1; }
  mkdir -p "$PARTS/zstd" "$DEST" && $PY -m zipfile -e "$PARTS"/zstandard-*.whl "$PARTS/zstd"
  PYTHONPATH="$PARTS/zstd" $PY - "$PARTS/triton.tar.zst" "$DEST" <<'EOF'
import sys, tarfile, zstandard
with open(sys.argv[1], "rb") as f:
    reader = zstandard.ZstdDecompressor(max_window_size=2**27).stream_reader(f)
    with tarfile.open(fileobj=reader, mode="r|") as tar:
        tar.extractall(sys.argv[2], filter="tar")
EOF
  # zipfile drops the tools' exec bits; the AMD backend was left out, so is its entry point
  chmod +x "$DEST"/triton/backends/nvidia/bin/*
  sed -i '/amd/d' "$DEST"/triton-*.dist-info/entry_points.txt
  PYTHONPATH=$DEST $PY -c "import triton; print('alt-triton: triton', triton.__version__, 'in', triton.__file__)"
  ptxas_blackwell
}

case ${1:-} in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
  pack) shift; pack "$@" ;;
  install) install ;;
  *) echo "usage: bash scripts/alt_triton.sh pack [VERSION] | install" >&2; exit 2 ;;
esac
