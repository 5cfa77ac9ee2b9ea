#!/usr/bin/env bash
# Install titanlike (editable) and its dependencies. `--dev` adds the test tools.
# An existing torch is kept (GPU boxes ship their own CUDA build); otherwise the
# CPU build is installed, pinned so pip never pulls several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".${extras}"
