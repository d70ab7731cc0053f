#!/usr/bin/env bash
# The one prepared GPU check (about 8 minutes on one H100/H200 class GPU):
#   1. the kernel tests on CUDA against the fp64 reference (scripts/gpu_tests),
#   2. tuning for the standard shapes (fp16 and INT8 weights), written to
#      autotune_configs/<GPU>/sparse24_matmul.json (merged after every key),
#   3. the benchmark sweep (CSV + PNG) into results/<GPU>/.
# Installs nothing (the GPU machine has torch + triton and no network).
# Each step has its own time limit; a failing step does not stop the next
# ones, and the script exits non-zero if any failed. Logs and outputs are
# copied to $OUT when it is set.
#
#   bash scripts/gpu_check.sh            # PYTHON=python3 by default
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
M_LIST=1,2,4,8,16,32,64,128,256,512,1024,2048,4096
T_TESTS=${T_TESTS:-100}        # seconds per step; 100 + 250 + 120 leaves margin under 8 minutes
T_TUNE=${T_TUNE:-250}
T_BENCH=${T_BENCH:-120}

# Import this tree without installing it: kernels/ and autotune_configs/ are
# sub-packages of sparse24 only once installed (pyproject's package-dir), so
# build that layout from symlinks (writes still land in this tree).
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
mkdir "$SITE/sparse24"
for f in "$ROOT"/sparse24/*; do ln -s "$f" "$SITE/sparse24/"; done
ln -s "$ROOT/kernels" "$SITE/sparse24/kernels"
ln -s "$ROOT/autotune_configs" "$SITE/sparse24/autotune_configs"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); nothing to check" >&2
    exit 1
fi
GPU=$("$PY" -c "import torch; from sparse24.tuning import gpu_file_name; print(gpu_file_name(torch.cuda.get_device_name()))")
RES="results/$GPU"
mkdir -p "$RES"
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
    "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| triton', triton.__version__, '| cuda', torch.version.cuda, '| SMs',
torch.cuda.get_device_properties(0).multi_processor_count)"
    git rev-parse --short HEAD 2>/dev/null || true
} | tee "$RES/env.txt"

FAILED=()
step() {  # step NAME LIMIT_S CMD...: run with a time limit, log to $RES/NAME.log, record failure
    local name=$1 limit=$2 rc=0 t0=$SECONDS
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RES/$name.log" || rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    if [ "$rc" -ne 0 ]; then FAILED+=("$name(exit $rc)"); fi
}

# 1. kernel tests on CUDA (parallel across processes when pytest-xdist is there:
#    the time goes into compiling kernel variants, one per process at a time)
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi
step tests "$T_TESTS" "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" scripts/gpu_tests

# 2. tuning (entries are merged into the file one by one, so a run cut short keeps its measurements)
step autotune "$T_TUNE" "$PY" -m sparse24 autotune --shapes standard --m "$M_LIST" \
    --dtype float16,int8-float16 --out-dir autotune_configs --warmup-ms 5 --rep-ms 15 --jobs 12

# 3. benchmark sweep with the tuned configs (CSV + PNG)
step bench "$T_BENCH" "$PY" -m sparse24 bench --device cuda --shapes standard --m "$M_LIST" --out "$RES/"

if [ -n "${OUT:-}" ]; then
    cp "$RES"/*.log "$RES/env.txt" "$OUT/" 2>/dev/null || true
    tar czf "$OUT/results.tgz" "$RES" "autotune_configs/$GPU" 2>/dev/null || tar czf "$OUT/results.tgz" "$RES"
fi
if [ "${#FAILED[@]}" -ne 0 ]; then
    echo "gpu_check: FAILED steps: ${FAILED[*]}"
    exit 1
fi
echo "gpu_check: all steps passed; outputs in $RES and autotune_configs/$GPU"
