#!/usr/bin/env bash
# Step 0 of a GPU session, in one command on this CPU machine: compile the Triton kernel variants
# the next GPU calls ask for (the plan in results/NVIDIA_H200/README.md) into .triton-sm90/ with
# the GPU image's Triton (3.6.0 for Python 3.12; a compiled kernel's key includes Triton's own
# files), to carry there: run(..., carry=[".triton-sm90"]). gpu_check.sh then loads them instead
# of compiling on the device's minutes, and says how many it compiled anyway (triton-cache.txt).
# A new checkout has no .triton-sm90/ (git ignores it): run this before the first GPU call.
#
#   bash scripts/prebuild_sm90.sh     # ~13 min on 2 cores (580 kernels, 34 MiB), the installs included
#
# What it compiles (each a `triton_prebuild.py collect`, merged, then one `build`):
#   - the tuner's candidates at the decode ends, M = 1 and 16, fp16 and INT8 weights (call 1's
#     autotune; the block's and the bench's decode layers);
#   - the tuner's candidates at M = 32 and 64, fp16 weights (call 2's autotune);
#   - gpu_probe.py's prefill launches at 32, 64, 128 and 4096 rows (call 1's probe) and its
#     K-sweep (call 2).
# Environments (made once, reused): V360 (Python 3.11, torch 2.13.0 CPU, Triton 3.6.0: `collect`
# runs the package under a driver that only compiles) and V312 (Python 3.12, Triton 3.6.0, numpy:
# `build`, the wheel the GPU image runs; PY312 names that Python). CACHE: where the cache goes (default
# .triton-sm90). Every run builds a fresh folder (under /tmp, then put in its place): kernels of an
# older kernels/ would stay in the folder forever and push it past what the device tool carries
# (64 MiB in all), so the whole build runs each time. The folder's size is printed, and the
# script fails if it exceeds MAX_MIB (60).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
V360=${V360:-/tmp/v360}
V312=${V312:-/tmp/v312}
CACHE=${CACHE:-$ROOT/.triton-sm90}
MAX_MIB=${MAX_MIB:-60}
T0=$SECONDS

if ! "$V360/bin/python" -c "import torch, triton, numpy, tqdm, matplotlib; assert triton.__version__ == '3.6.0'" 2>/dev/null; then
    python3.11 -m venv "$V360"
    "$V360/bin/pip" install -q "torch==2.13.0"          # first: an open range would pull a CUDA build
    "$V360/bin/pip" install -q "triton==3.6.0" numpy matplotlib "tqdm>=4.66"
fi
if ! "$V312/bin/python" -c "import triton, numpy; assert triton.__version__ == '3.6.0'" 2>/dev/null; then
    PY312=${PY312:-python3.12}   # (pyenv's shim refuses a version it does not have selected: take its own)
    "$PY312" -c "" 2>/dev/null || PY312=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 | tail -1)
    "$PY312" -m venv "$V312"
    "$V312/bin/pip" install -q "triton==3.6.0" numpy
fi
echo "prebuild_sm90: environments ready ($((SECONDS - T0)) s)"

SPECS=$(mktemp -d)
(
    PY="$V360/bin/python"
    . scripts/installed_layout.sh
    "$PY" scripts/triton_prebuild.py collect --m 1,16 --dtype float16,int8-float16 --out "$SPECS/decode.jsonl"
    "$PY" scripts/triton_prebuild.py collect --m 32,64 --dtype float16 --out "$SPECS/rows32-64.jsonl"
    "$PY" scripts/triton_prebuild.py collect --no-tuning --probe-ms 32,64,128,4096 --ksweep --out "$SPECS/probe.jsonl"
)
sort -u "$SPECS"/*.jsonl > "$SPECS/all.jsonl"
echo "prebuild_sm90: $(wc -l < "$SPECS/all.jsonl") distinct variants to compile"
# build needs no torch: the tree's kernels/ is imported under the installed names by triton_prebuild
NEW=$(mktemp -d)   # (outside the tree: git ignores only .triton-sm90/ itself)
chmod 755 "$NEW"
"$V312/bin/python" scripts/triton_prebuild.py build "$SPECS/all.jsonl" --cache "$NEW"
rm -rf "$SPECS" "$CACHE"
mv "$NEW" "$CACHE"
MIB=$(( ($(du -sb "$CACHE" | cut -f1) + 1048575) / 1048576 ))
echo "prebuild_sm90: $CACHE holds $(find "$CACHE" -mindepth 1 -maxdepth 1 -type d | wc -l) kernels, $MIB MiB"
if [ "$MIB" -gt "$MAX_MIB" ]; then
    echo "prebuild_sm90: $CACHE is $MIB MiB, over the $MAX_MIB MiB limit (the device tool carries 64 MiB in all):" \
         "collect fewer variants" >&2
    exit 1
fi
echo "prebuild_sm90: done in $((SECONDS - T0)) s; carry it: run(..., carry=[\".triton-sm90\"])"
