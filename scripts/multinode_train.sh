#!/usr/bin/env bash
# Launch train.py on one node of a multi-node job with torchrun's c10d rendezvous.
# Run the same command on every node (scripts/slurm_train.sbatch does it through srun):
#
#   NNODES=4 NPROC_PER_NODE=8 RDZV_ENDPOINT=node001:29500 JOB_ID=llama8b \
#       bash scripts/multinode_train.sh --job.config_file train_configs/llama3_8b.toml
#
# NNODES        nodes in the job (default: SLURM_NNODES, else 1)
# NPROC_PER_NODE  processes per node, one per GPU (default: the GPU count, else 1)
# RDZV_ENDPOINT host:port of the rendezvous, reachable from every node (default: the first
#               host of SLURM_JOB_NODELIST, else localhost, port 29500)
# JOB_ID        rendezvous id shared by the nodes of one job (default: SLURM_JOB_ID, else "titanlike")
# Everything else is passed to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-${SLURM_NNODES:-1}}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
    head=localhost
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    fi
    RDZV_ENDPOINT="$head:29500"
fi
JOB_ID=${JOB_ID:-${SLURM_JOB_ID:-titanlike}}
exec python3 -m torch.distributed.run \
    --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "$JOB_ID" \
    train.py "$@"
