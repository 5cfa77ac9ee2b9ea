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
# Every argument is passed to train.py (python3 train.py --help lists its options).
# The job is validated once before torchrun starts (python3 train.py ... --job.validate_only, for
# NNODES x NPROC_PER_NODE ranks): a bad config is one sentence and exit 2, and no rank is started.
# TITANLIKE_VALIDATED=1 skips that step (scripts/slurm_train.sbatch validated the job already).
for arg in "$@"; do  # -h / --help: print the comment block at the top of this file
    case $arg in -h | --help) awk 'NR > 1 { if (!/^#( |$)/) exit; sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
done
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
if [[ "${TITANLIKE_VALIDATED:-0}" != 1 ]]; then
    # Every check the ranks would make before their process group, made once here: a refusal is one
    # sentence instead of one per rank under torchrun's ChildFailedError report.
    WORLD_SIZE=$((NNODES * NPROC_PER_NODE)) LOCAL_WORLD_SIZE=$NPROC_PER_NODE RANK=0 \
        python3 train.py "$@" --job.validate_only
fi
for arg in "$@"; do  # the caller asked for validation only
    case $arg in --job.validate_only | --job.validate_only=true | --job.validate_only=True) exit 0 ;; esac
done
# Stopping early (titanlike/train/faults.py): on SIGTERM or SIGUSR1 every rank finishes its step,
# saves a full checkpoint and exits 0; relaunching the same command resumes from it.
# - SIGTERM sent to torchrun (Kubernetes, scancel) is forwarded by torchrun to the ranks, which it
#   SIGKILLs after its shutdown timeout: TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torch >= 2.12; older
#   versions always wait 30 s) must cover one step plus one full save. torchrun then exits 1 even
#   though the ranks saved and exited 0.
# - SIGUSR1 is ignored by this shell and by torchrun (an ignored signal stays ignored across exec and
#   in the ranks until they install their handler), so a SIGUSR1 sent to every process of the job
#   (scripts/slurm_train.sbatch) is acted on by the ranks alone, and torchrun exits 0 after them.
# - If torchrun itself dies (even SIGKILL), its ranks get SIGTERM from the kernel (PR_SET_PDEATHSIG).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-100}
trap '' USR1
exec python3 -m torch.distributed.run \
    --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "$JOB_ID" \
    train.py "$@"
