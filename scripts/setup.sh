#!/usr/bin/env bash
# One-time set-up on a fresh machine, inside the virtual environment the README
# makes first: torch first (pinned: an open range would pull a multi-GB CUDA
# build), then this package with its test extra.
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu picks PyTorch's CPU build
# on a machine whose package index would otherwise serve the CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
"$PY" -m pip install -q -e ".[test]"
