#!/usr/bin/env bash
# The one prepared GPU check, for the GPU image as it is (Python 3.12, torch 2.11,
# Triton 3.6, numpy 2.5, pytest-xdist; no network, nothing installed). At most about 9
# minutes on one H100/H200 class GPU (GPU_CHECK_ONLY="probe tests" runs the steps named):
#   0. L2 and HBM read bandwidth (scripts/gpu_l2_bandwidth.py): the figure the prefill model
#      assumes, for `kernel_static_check.py --prefill --l2 X` back here;
#   0b. probe: host time per eager call (nn.Linear, the module, the op, the launch) with a
#      cProfile and the kept handle's launch with pointers as ints or tensors, and prefill paths
#      side by side (prefill kernel, unpack + cuBLAS, cuSPARSELt with its kernels' own time,
#      Triton's own dense GEMM on the prefill kernel's tile);
#   1. tests: the kernels and modules on CUDA against the fp64 reference (scripts/gpu_tests), first of
#      all that the sparse tensor cores read the INT8 / INT4 operands as the CPU emulation does;
#   2. autotune: the decode ends (M = 1 and 16; M = 2..8 take the nearest entry) for the standard
#      shapes, fp16 and INT8 weights, in the decode layout the modules hold there (72 / 36 decode
#      configs a key), the keys this GPU's file holds already skipped (the first H200 run tuned 6 of
#      24 in its 100 s, the two M = 4096 prefill keys among them; prefill with 16-bit x now takes
#      the unpack route from 256 rows unless a tuned key past 16 rows, which records both, says
#      the prefill kernel is faster), into
#      autotune_configs/<GPU>/sparse24_matmul.json (merged after every key), and every
#      candidate's time into results/<GPU>/autotune-timings.csv (what the untuned defaults are fitted to);
#   3. bench: the throughput sweep (CSV + PNG) into results/<GPU>/, with the tuned configs (a sweep its
#      time limit stops leaves the rows so far in bench.partial.csv);
#   4. user view: eager wall time per call of a layer at M = 1 and tokens/s of an 8-block
#      Llama-7B-shaped MLP stack under torch.compile(mode="reduce-overhead"), dense vs 2:4
#      (fp16 and INT8), with the graph-break count (scripts/gpu_user_view.py);
#   5. both phases of one Llama-7B-shaped block (q, k, v, o, gate, up, down): decode tokens/s at
#      batch 1 and 8, prefill of 2048 tokens, dense vs 2:4 vs 2:4 INT8, eager and compiled, with
#      CUDA kernels per call from torch.profiler (scripts/gpu_block.py: block.csv, block.md).
# Each step has its own time limit, cut to what is left of GPU_CHECK_BUDGET (570 s from the
# script's start: a device call may run 600; a step left under 20 s is skipped and counts as
# failed; the preamble, ~5 Python start-ups importing torch for the layout and CUDA checks, env.txt
# and the prebuilt cache's relocation, runs first inside it: ~15-20 s, its time appended to env.txt);
# a failing step does not stop the next ones, and the script exits non-zero if any failed. Every
# step's outputs are archived to $OUT/gpu_check.tgz (when OUT is set) as soon as the step ends, so
# a run cut short keeps what it measured. The planned calls of a GPU session
# are scripts/gpu_plan.sh N (one line each, so nothing is lost to a wrapped paste).
# GPU_CHECK_DRY=1 prints each step's name and limit without a GPU and runs nothing, as if the
# preamble took GPU_CHECK_PREAMBLE_S (20 s) and every step its whole limit (what
# tests/tools/test_gpu_plan.py checks the budget with).
#
#   bash scripts/gpu_check.sh            # PYTHON=python3 by default
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
# tuned: the decode ends (2-8 take the nearest bucket's entry)
M_TUNE=${M_TUNE:-1,16}
DTYPE_TUNE=${DTYPE_TUNE:-float16,int8-float16}   # e.g. M_TUNE=32,64 DTYPE_TUNE=float16,bfloat16: the 17-64-row buckets
M_BENCH=${M_BENCH:-1,4,16,64,256,1024,4096}
# the sweep's providers: dense, what a layer runs by default, torch's cuSPARSELt (all ten timed 100
# times each ran past 60 s on the H200 before writing a row)
PROVIDERS=dense,sparse24-auto,torch-semi-structured
T_TESTS=${T_TESTS:-120}         # seconds per step (the first H200 runs took: tests ~115 with 14 workers,
T_TUNE=${T_TUNE:-90}            # autotune 6 of 24 keys in 100, user_view 25, block 69, l2 6, probe 46)
T_BENCH=${T_BENCH:-90}
T_USER=${T_USER:-40}
T_BLOCK=${T_BLOCK:-90}
T_L2=${T_L2:-30}
T_PROBE=${T_PROBE:-80}          # (a plain run, no plan: with the ~20 s preamble and 10 s of grace a step these
                                # overrun the 570 s budget and the last steps are cut: block to 25 s; run the
                                # calls of scripts/gpu_plan.sh, whose limits fit: GPU_CHECK_DRY=1 shows them)
T_SPARSE_MM=${T_SPARSE_MM:-100}  # (added after the 2026-12-04 H200 runs: runs only where GPU_CHECK_ONLY names it)
T_KSWEEP=${T_KSWEEP:-100}       # (added 2026-12-05: runs only where GPU_CHECK_ONLY names it)
BUDGET=${GPU_CHECK_BUDGET:-570}
DRY=${GPU_CHECK_DRY:-}
PREAMBLE_S=${GPU_CHECK_PREAMBLE_S:-20}   # the dry run's charge for the preamble (a real run's is measured)
PROBE_ARGS=${PROBE_ARGS:-}      # e.g. "--only prefill --weights int8,int4 --ms 32,64"
TUNE_SKIP=${TUNE_SKIP:---skip-tuned}  # TUNE_SKIP=--no-skip-tuned re-times the keys this GPU's file holds

keep() {  # what the run has so far, as one archive in $OUT (the device tool returns 8 files at most)
    if [ -n "${OUT:-}" ]; then
        tar -czf "$OUT/gpu_check.tgz.tmp" "$RES" $(ls -d autotune_configs/"$GPU" 2>/dev/null) 2>/dev/null &&
            mv "$OUT/gpu_check.tgz.tmp" "$OUT/gpu_check.tgz"
    fi
    return 0
}

FAILED=()
ONLY=" ${GPU_CHECK_ONLY:-} "   # e.g. GPU_CHECK_ONLY="probe tests": those steps alone (a follow-up call)
step() {  # step NAME LIMIT_S CMD...: run with a time limit, log to $RES/NAME.log, record failure
    local name=$1 limit=$2 rc=0 t0=$SECONDS left
    shift 2
    if [ "$ONLY" != "  " ] && [[ "$ONLY" != *" $name "* ]]; then return 0; fi
    left=$((BUDGET - SECONDS - 15))   # (timeout's 10 s grace and the archive)
    if [ "$left" -lt 20 ]; then
        echo "=== $name: skipped, ${left} s left of the ${BUDGET} s budget"
        FAILED+=("$name(no time left)")
        return 0
    fi
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    if [ -n "$DRY" ]; then   # as if the step ran to its limit and past timeout's grace
        echo "step $name $limit"
        SECONDS=$((SECONDS + limit + 10))
        return 0
    fi
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$RES/$name.log" || rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$RES/$name.log"
    if [ "$rc" -ne 0 ]; then FAILED+=("$name(exit $rc)"); fi
    keep
}

if [ -n "$DRY" ]; then
    GPU=DRY RES=results/DRY
    echo "preamble $PREAMBLE_S"
    SECONDS=$PREAMBLE_S
else
. scripts/installed_layout.sh   # SITE: this tree as installed (sparse24.kernels), first on PYTHONPATH

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is False); nothing to check" >&2
    exit 1
fi
GPU=$("$PY" -c "import torch; from sparse24.ops.config_store import gpu_file_name; print(gpu_file_name(torch.cuda.get_device_name()))")
RES="results/$GPU"
mkdir -p "$RES"
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
    "$PY" -c "import sys, torch, triton, numpy; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| triton', triton.__version__, '| numpy', numpy.__version__, '| cuda', torch.version.cuda, '| SMs',
torch.cuda.get_device_properties(0).multi_processor_count)"
    git rev-parse --short HEAD 2>/dev/null || true
} | tee "$RES/env.txt"

# Every kernel variant the JIT is asked for, by every process, recorded (scripts/jit_record/): what
# scripts/triton_prebuild.py build compiles into the cache a later session carries here.
ln -s "$ROOT/scripts/jit_record/sitecustomize.py" "$SITE/sitecustomize.py"
mkdir -p "$RES/jit-specs"
export SPARSE24_JIT_SPECS="$ROOT/$RES/jit-specs"

# A Triton cache compiled without a GPU for this image's Triton (scripts/triton_prebuild.py), when
# carried here (run(carry=[".triton-sm90"])): the JIT loads those kernels instead of compiling them.
# New kernel folders at the end are the misses (a different key: then that image's Triton differs).
PREBUILT="$ROOT/.triton-sm90"
cache_kernels() { find "$PREBUILT" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l; }
# sparse24's kernels (each folder holds <kernel name>.json): a miss among them is a prebuild gap
sparse24_kernels() { find "$PREBUILT" -mindepth 2 -maxdepth 2 -name '_sparse24_*.json' 2>/dev/null | wc -l; }
if [ -d "$PREBUILT" ] && [ -z "${TRITON_CACHE_DIR:-}" ]; then
    export TRITON_CACHE_DIR="$PREBUILT"
    "$PY" scripts/triton_prebuild.py relocate "$PREBUILT" | sed 's/^/prebuilt Triton cache: /' | tee "$RES/triton-cache.txt"
    CACHE_START=$(cache_kernels) SPARSE24_START=$(sparse24_kernels)
fi

echo "gpu_check: preamble took $SECONDS s of the ${BUDGET} s budget (the dry run charges $PREAMBLE_S)" | tee -a "$RES/env.txt"
keep
fi

# 0. what the prefill model assumes of L2 (seconds)
step l2 "$T_L2" "$PY" scripts/gpu_l2_bandwidth.py --out "$RES/"

# 0b. where an eager call's host time goes; the prefill paths side by side (scripts/gpu_probe.py)
step probe "$T_PROBE" "$PY" scripts/gpu_probe.py --out "$RES/" $PROBE_ARGS

# 0c. large-M sparse GEMMs with the host left out (CUDA graphs): cuSPARSELt, CUTLASS, the unpack route;
#     then cuSPARSELt's host cost per eager call, and its compressed layout (cslt_layout.pt)
#     (never in a run that names no steps: the defaults fit 9 minutes without it)
if [ "$ONLY" != "  " ]; then
    step sparse_mm "$T_SPARSE_MM" "$PY" scripts/gpu_sparse_mm.py --out "$RES/" --layout
fi

# 0d. the 16-bit prefill kernel against Triton's own GEMM on one tile as K grows (run 4: 2.5x at
#     K = 11008; its K = 4096 rows timed another, tuned tile, so none like for like there yet;
#     scripts/gpu_probe.py ksweep): a diagnostic, so never in a run that names no steps
if [ "$ONLY" != "  " ]; then
    step ksweep "$T_KSWEEP" "$PY" scripts/gpu_probe.py --out "$RES/" --only ksweep
fi

# 1. kernel and module tests on CUDA (parallel across processes when pytest-xdist is there:
#    the time goes into compiling kernel variants, one per process at a time)
XDIST=()
if [ -z "$DRY" ] && "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "${GPU_TEST_WORKERS:-14}"); fi
step tests "$T_TESTS" env PYTHONPATH="$ROOT/scripts/gpu_tests:${PYTHONPATH:-}" GPU_TESTS_PASSED="$ROOT/$RES/tests-passed.txt" "$PY" -m pytest -q -p no:cacheprovider \
    -p no:randomly -p report_now "${XDIST[@]}" scripts/gpu_tests

# 2. tuning (entries are merged into the file one by one, so a run cut short keeps its measurements)
step autotune "$T_TUNE" "$PY" -m sparse24 autotune --shapes standard --m "$M_TUNE" \
    --dtype "$DTYPE_TUNE" --out-dir autotune_configs --warmup-ms 3 --rep-ms 10 --jobs 12 "$TUNE_SKIP" \
    --timings "$RES/autotune-timings.csv"

# 3. benchmark sweep with the tuned configs (CSV + PNG)
step bench "$T_BENCH" "$PY" -m sparse24 bench --device cuda --shapes standard --m "$M_BENCH" \
    --providers "$PROVIDERS" --repeats 20 --out "$RES/"

# 4. what a user sees: eager calls and compiled decode, dense vs 2:4
step user_view "$T_USER" "$PY" scripts/gpu_user_view.py --out "$RES/"

# 5. one Llama-7B-shaped block, decode and prefill (rows written as they are measured)
step block "$T_BLOCK" "$PY" scripts/gpu_block.py --out "$RES/"

if [ -n "${CACHE_START:-}" ]; then
    echo "prebuilt Triton cache: $CACHE_START kernels at the start ($SPARSE24_START of sparse24's), $(cache_kernels) at the end ($(sparse24_kernels) of sparse24's: the difference was compiled here; the rest are the tests' and torch.compile's own)" |
        tee -a "$RES/triton-cache.txt"
    keep
fi
if [ "${#FAILED[@]}" -ne 0 ]; then
    echo "gpu_check: FAILED steps: ${FAILED[*]}"
    exit 1
fi
echo "gpu_check: all steps passed; outputs in $RES and autotune_configs/$GPU"
