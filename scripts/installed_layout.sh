# Sourced (from the repository root) by scripts/gpu_check.sh and scripts/prebuild_sm90.sh: import
# this tree without installing it. kernels/ and autotune_configs/ are sub-packages of sparse24 only
# once installed (pyproject's package-dir), and Triton keys a compiled kernel by its module's name
# (sparse24.kernels.*), so build that layout from symlinks (writes still land in this tree).
# Needs ROOT and PY; sets SITE (removed on exit), PYTHONPATH and PYTHONSAFEPATH, and exits 1 when
# $PY does not import the tree so.
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
mkdir "$SITE/sparse24"
for f in "$ROOT"/sparse24/*; do ln -s "$f" "$SITE/sparse24/"; done
ln -s "$ROOT/kernels" "$SITE/sparse24/kernels"
ln -s "$ROOT/autotune_configs" "$SITE/sparse24/autotune_configs"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# `python -m` and `-c` put the working directory first on sys.path, where this tree's own
# sparse24/ (without kernels/) would shadow the layout above: the first GPU run failed so.
export PYTHONSAFEPATH=1
if ! "$PY" -c "import os, sparse24.kernels, sparse24.autotune_configs as a
assert os.path.dirname(a.__file__).startswith('$SITE'), a.__file__"; then
    echo "$(basename "$0"): this tree does not import as the installed layout (sparse24.kernels)" >&2
    exit 1
fi
