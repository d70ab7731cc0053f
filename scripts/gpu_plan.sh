#!/usr/bin/env bash
# The planned calls of the next GPU session (results/NVIDIA_H200/README.md says why each, in this
# order), each one `scripts/gpu_check.sh` with its settings, so the device tool's command is one
# short line: run("bash scripts/gpu_plan.sh 1", carry=[".triton-sm90"], kind="nvidia-h200").
# Each call's step limits, with gpu_check.sh's preamble before them (its dry run charges 20 s),
# add up to under the 570 s budget gpu_check.sh keeps (tests/tools/test_gpu_plan.py checks it with
# GPU_CHECK_DRY=1).
#
#   bash scripts/gpu_plan.sh 1|2|3
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in
    1)  # 16-bit prefill at 32 / 64 / 128 / 4096 rows, cuSPARSELt's layout and host cost, the tests, INT8
        #    decode keys re-timed, the block with what was tuned (gpu_check.sh's order). The limits, with
        #    the preamble (~20 s) and 10 s of grace a step, leave 20 s of the 565 s the guard allows:
        #    probe 80 (12 fp16 rows, ours prebuilt; run 4 did 15 rows and the host step in ~95 s, compiling
        #    all), sparse_mm 60 (run 5: 28 s for 16 timings a row; now 20 rows x 11 with cuSPARSELt's alg
        #    search and the layout first: ~50 s estimated), tests 165 (run 4: 279 tests in 144 s; 344 now,
        #    each passed one listed if cut), autotune 75 (8 INT8 keys, prebuilt; run 5 compiled 48 and timed 1 in 75),
        #    block 95 (run 2: 69 s, run 4: 79; last, so a longer preamble trims it first: 20 s to spare)
        export GPU_CHECK_ONLY="sparse_mm probe tests autotune block" \
            PROBE_ARGS="--only prefill --weights fp16 --ms 32,64,128,4096" \
            M_TUNE=1,16 DTYPE_TUNE=int8-float16 TUNE_SKIP=--no-skip-tuned GPU_TEST_WORKERS=16 \
            T_SPARSE_MM=60 T_PROBE=80 T_TESTS=165 T_TUNE=75 T_BLOCK=95 ;;
    2)  # the K-sweep, then 16-bit weights at 32 / 64 rows: the sparse kernel's space beside the prefill kernel's
        export GPU_CHECK_ONLY="ksweep autotune" M_TUNE=32,64 DTYPE_TUNE=float16 TUNE_SKIP=--no-skip-tuned \
            T_KSWEEP=100 T_TUNE=170 ;;
    3)  # the throughput sweep alone (rows so far in bench.partial.csv if stopped)
        export GPU_CHECK_ONLY=bench M_BENCH=1,16,64,256,4096 T_BENCH=400 ;;
    *)  echo "usage: bash scripts/gpu_plan.sh 1|2|3 (results/NVIDIA_H200/README.md)" >&2; exit 2 ;;
esac
exec bash scripts/gpu_check.sh
