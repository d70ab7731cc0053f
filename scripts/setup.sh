#!/usr/bin/env bash
# One-time set-up on a fresh machine: torch first (the CPU build; an open
# range would pull a multi-GB CUDA build), then this package with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
