#!/usr/bin/env bash
# Install titanlike (editable) and its dependencies. `--dev` adds the test tools.
# An existing torch is kept (GPU boxes ship their own CUDA build); otherwise the
# CPU build is installed, pinned so pip never pulls several GB of CUDA packages.
#
#   bash scripts/setup.sh [--dev]
#
# PYTHON  the interpreter to install into (default: python3)
for arg in "$@"; do  # -h / --help: print the comment block at the top of this file
    case $arg in -h | --help) awk 'NR > 1 { if (!/^#( |$)/) exit; sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
done
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".${extras}"
if [[ -n "$extras" ]]; then
    # Megatron-LM's own dataset code, the reference the Megatron-format tests compare against.
    # Without its dependencies: only megatron.core.datasets is used, and it needs torch and numpy.
    "$PY" -m pip install -q --no-deps "megatron-core==0.16.1"
fi
