#!/usr/bin/env bash
# mamba_ssm's Triton kernels for a lent GPU box, which has no package registry and no wheel of
# mamba-ssm (the registry the kit is built from has none either: it builds CUDA extensions at install).
#
#   bash scripts/gpu_kit_mamba.sh MAMBA_SOURCE     (from the project root, after make-kit.sh)
#
# MAMBA_SOURCE: a checkout of github.com/state-spaces/mamba. The hybrid's scan uses one function of
# the package, mamba_chunk_scan_combined (mamba_ssm/ops/triton/ssd_combined.py), whose modules are
# pure Python and Triton; they are copied as they are into .gpu-kit/mamba/mamba_ssm. The package's
# own __init__ imports its compiled selective-scan extension, so the kit's __init__ sets the version
# only. einops (which the kernels import) and pytest come as wheels (pip download --no-deps
# --only-binary=:all:, into .gpu-kit/whl). On the GPU box, after activate.sh:
#
#   export PYTHONPATH=$PWD/.gpu-kit/mamba:$PYTHONPATH
#   python -m pytest -q tests/unit/test_mamba2.py -k gpu   # the kernels against the PyTorch scan
for arg in "$@"; do  # -h / --help: print the comment block at the top of this file
    case $arg in -h | --help) awk 'NR > 1 { if (!/^#( |$)/) exit; sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
done
set -euo pipefail
src=${1:?give a checkout of github.com/state-spaces/mamba}
kit=.gpu-kit/mamba/mamba_ssm
[ -f "$src/mamba_ssm/ops/triton/ssd_combined.py" ] || { echo "$src holds no mamba_ssm/ops/triton/ssd_combined.py"; exit 1; }
rm -rf .gpu-kit/mamba && mkdir -p "$kit/ops/triton" "$kit/utils" .gpu-kit/whl
for module in ssd_combined ssd_bmm ssd_chunk_scan ssd_chunk_state ssd_state_passing layernorm_gated k_activations \
              softplus; do
    cp "$src/mamba_ssm/ops/triton/$module.py" "$kit/ops/triton/"
done
cp "$src/mamba_ssm/utils/torch.py" "$src/mamba_ssm/utils/determinism.py" "$kit/utils/"
touch "$kit/ops/__init__.py" "$kit/ops/triton/__init__.py" "$kit/utils/__init__.py"
version=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "$src/mamba_ssm/__init__.py")
printf '__version__ = "%s"  # the Triton kernels only (scripts/gpu_kit_mamba.sh)\n' "$version" > "$kit/__init__.py"
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu-kit/whl einops pytest pluggy iniconfig pygments packaging
echo "mamba_ssm $version kernels in .gpu-kit/mamba; wheels:"; ls .gpu-kit/whl
