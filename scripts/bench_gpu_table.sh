#!/usr/bin/env bash
# The single-GPU benchmark table of docs/performance.md: Llama 3.2 1B and 3B at seq 4096 and
# 8192, eager vs compile vs compile + float8 (tensorwise, rowwise) vs activation-checkpointing modes
# (op, full), bf16: 24 rows, about 12 minutes on an H200 (each row a process: start, compile, 23 steps).
#
#   bash scripts/bench_gpu_table.sh [TOKENIZER] > bench_table.log
#
# TOKENIZER: the Llama 3 tokenizer.model (tiktoken format, vocab 128256), for example the copy
# inside the llama-models wheel (carry it to a GPU box without internet); without it the
# 2048-token debug tokenizer is used and the table says so. Every row prints its command.
#
# BENCH_STEPS  timed steps per round of each row (default: 10)
for arg in "$@"; do  # -h / --help: print the comment block at the top of this file
    case $arg in -h | --help) awk 'NR > 1 { if (!/^#( |$)/) exit; sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
done
set -uo pipefail
cd "$(dirname "$0")/.."
TOKENIZER=${1:-}
STEPS=${BENCH_STEPS:-10}
for flavor in 1b 3b; do
  for seq in 4096 8192; do
    for mode in eager compile compile_float8 compile_float8_rowwise compile_ac_op compile_ac_full; do
      args=(--job.config_file "train_configs/llama3_${flavor}.toml" --model.tokenizer_path "$TOKENIZER"
            --training.seq_len "$seq" --bench-warmup 3 --bench-steps "$STEPS" --bench-rounds 2)
      case $mode in
        eager) args+=(--compile.no_enable) ;;
        compile) ;;
        compile_float8) args+=(--model.converters float8) ;;
        compile_float8_rowwise) args+=(--model.converters float8 --float8.recipe_name rowwise) ;;
        compile_ac_op) args+=(--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op) ;;
        compile_ac_full) args+=(--activation_checkpoint.mode full) ;;
      esac
      echo "### ${flavor} seq ${seq} ${mode}: python scripts/bench.py ${args[*]}"
      python scripts/bench.py "${args[@]}" 2>&1 | grep -E "config:|ms/step|peak|error" || echo "FAILED"
    done
  done
done
