#!/usr/bin/env bash
# torchtitan's launcher (its run_train.sh, v0.2.2) for titanlike: the same environment variables, one node.
# It lives in scripts/ (titanlike's top level is fixed): run it from anywhere.
#
#   CONFIG_FILE=train_configs/llama3_8b.toml NGPU=8 ./scripts/run_train.sh [--section.key value ...]
#   NGPU=4 LOG_RANK=0,1 CONFIG_FILE=train_configs/debug_model.toml ./scripts/run_train.sh --training.steps 50
#   NGPU=32 COMM_MODE=fake_backend CONFIG_FILE=train_configs/llama3_70b.toml ./scripts/run_train.sh
#
# NGPU         processes to start, one per GPU (default: the GPU count, else 1; torchtitan's default is 8);
#              on CPU the ranks talk over gloo
# CONFIG_FILE  the TOML file (default: train_configs/debug_model.toml of this checkout)
# LOG_RANK     ranks whose output is shown, comma-separated (default 0): torchrun's --local-ranks-filter
# TRAIN_FILE   the module torchrun runs (default titanlike.train)
# COMM_MODE    fake_backend: validate the job for NGPU ranks (plan, memory check) and exit 0 without
#              starting a rank, as torchtitan's dry run; local_tensor is not implemented (exit 2)
# Every argument is passed to the trainer (python3 -m titanlike.train --help lists its options).
# The job is validated once for NGPU ranks (--job.validate_only) before torchrun starts: a bad config
# is one sentence and exit 2, and no rank starts.
for arg in "$@"; do  # -h / --help: print the comment block at the top of this file
    case $arg in -h | --help) awk 'NR > 1 { if (!/^#( |$)/) exit; sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
done
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # a checkout that was not pip-installed
if [[ -z "${NGPU:-}" ]]; then
    NGPU=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
export LOG_RANK=${LOG_RANK:-0}
CONFIG_FILE=${CONFIG_FILE:-"$ROOT/train_configs/debug_model.toml"}
TRAIN_FILE=${TRAIN_FILE:-"titanlike.train"}
COMM_MODE=${COMM_MODE:-""}

case "$COMM_MODE" in
    "" | fake_backend) ;;
    *) echo "run_train.sh: COMM_MODE=$COMM_MODE is not implemented in titanlike (fake_backend validates the job" \
            "without starting ranks)" >&2; exit 2 ;;
esac

# Validate once, for the world size torchrun will start (the memory check counts NGPU local ranks).
WORLD_SIZE=$NGPU LOCAL_WORLD_SIZE=$NGPU python3 -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@" \
    --job.validate_only
if [[ -n "$COMM_MODE" ]]; then
    exit 0
fi
for arg in "$@"; do  # the caller asked for validation only
    case $arg in --job.validate_only | --job.validate_only=true | --job.validate_only=True) exit 0 ;; esac
done

PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-"expandable_segments:True"}
export PYTORCH_ALLOC_CONF
# The ranks neither repeat the checks nor print the config notes again (titanlike/cli/train.py).
export TITANLIKE_LAUNCHER_VALIDATED=1
set -x
exec python3 -m torch.distributed.run --nproc_per_node="$NGPU" --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m "$TRAIN_FILE" --job.config_file "$CONFIG_FILE" "$@"
