#!/usr/bin/env bash
# Install Transformer Engine on the offline GPU box from files carried in .te/ (see gpu_check.sh `te`):
#   core.whl.part*   transformer_engine_cu13's wheel split in parts (one device call carries 64 MiB;
#                    the wheel is ~276 MB), joined here and checked against core.whl.sha256
#   transformer_engine-*.whl, its pure-Python deps (pydantic, ...) as wheels
#   transformer_engine_torch-*.tar.gz   the torch extension: PyPI has only the sdist, so it is built
#                    here against the box's own torch (a C++ extension must match torch's ABI; ~2 min on
#                    16 cores), or transformer_engine_torch-*.whl built so on an earlier call
# Everything goes into ${TE_SITE:-/tmp/te-site}; prints the PYTHONPATH entry to use.
set -euo pipefail
if [[ $# -gt 0 ]]; then   # it takes no arguments: --help (or anything) prints the comment above
  sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; [[ "$1" == -h || "$1" == --help ]]; exit $?
fi
[[ -f .te/core.whl.name ]] || { echo "te_install.sh: .te/core.whl.name not found: carry .te/ (see --help)" >&2; exit 2; }
SITE=${TE_SITE:-/tmp/te-site}
PY=${PYTHON:-python3}
mkdir -p "$SITE" .te/wheels
name=$(cat .te/core.whl.name)
if compgen -G ".te/core.whl.part*" > /dev/null; then   # joined once; a later call finds the wheel
  cat .te/core.whl.part* > ".te/wheels/$name"
fi
(cd .te/wheels && echo "$(cat ../core.whl.sha256)  $name" | sha256sum -c -) || { echo "core wheel checksum mismatch"; exit 1; }
rm -f .te/core.whl.part*
$PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" ".te/wheels/$name" .te/transformer_engine-*.whl \
    $(ls .te/*.whl | grep -v '^.te/transformer_engine-') 2>&1 | grep -v "root' user" || true
export PYTHONPATH=$SITE:${PYTHONPATH:-}
# the box's CUDA toolkit has no cuDNN / NCCL headers: take them from the pip packages torch uses
inc=$($PY - <<'PYEOF'
import importlib.util, os
dirs = []
for mod in ("nvidia.cudnn", "nvidia.nccl"):
    spec = importlib.util.find_spec(mod)
    for p in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isdir(os.path.join(p, "include")):
            dirs.append(os.path.join(p, "include"))
for p in os.environ.get("PYTHONPATH", "").split(":"):
    if p and os.path.isfile(os.path.join(p, "include", "cudnn_frontend.h")):
        dirs.append(os.path.join(p, "include"))
print(":".join(dirs))
PYEOF
)
# a torch-extension wheel built on an earlier call (gpu_check copies it to $OUT) can be carried instead
cp .te/transformer_engine_torch-*.whl .te/wheels/ 2>/dev/null || true
if ! ls .te/wheels/transformer_engine_torch-*.whl >/dev/null 2>&1; then
  CPATH=$inc${CPATH:+:$CPATH} NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    $PY -m pip wheel -q --no-build-isolation --no-deps -w .te/wheels .te/transformer_engine_torch-*.tar.gz
fi
# unpacked over the core (pip --target would skip the transformer_engine/ folder the core already made)
$PY -m zipfile -e .te/wheels/transformer_engine_torch-*.whl "$SITE"
cp .te/wheels/transformer_engine_torch-*.whl "${OUT:-/tmp}/" 2>/dev/null || true
$PY -c "from nanochat.platform import prepare_te_import; prepare_te_import()
import transformer_engine.pytorch as te, transformer_engine; print('TE', transformer_engine.__version__, 'ok')"
echo "PYTHONPATH entry: $SITE"
