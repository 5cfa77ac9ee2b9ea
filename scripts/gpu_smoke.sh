#!/usr/bin/env bash
# The first minutes on a lent GPU (issue: the single-GPU table): does everything run on CUDA?
#   bash scripts/gpu_smoke.sh [TOKENIZER] 2>&1 | tee smoke.log
#
# 1. the debug model, bf16, 20 steps, eager and compiled;
# 2. every family's and objective's debug preset (distill needs a teacher checkpoint), bf16, 3 steps, eager
#    (and compiled with SMOKE_COMPILE=1), and GRPO with its decode step as a CUDA graph;
# these run side by side (tiny models; only pass/fail and the losses matter here), then
# 3. one row of scripts/bench.py alone: Llama 3.2 1B, seq 4096, compile, bf16 (TOKENIZER: the
#    Llama 3 tokenizer.model; without it the debug tokenizer).
# Every run prints its command, its last lines and PASS/FAIL.
for arg in "$@"; do  # -h / --help: print the comment block at the top of this file
    case $arg in -h | --help) awk 'NR > 1 { if (!/^#( |$)/) exit; sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
done
set -uo pipefail
cd "$(dirname "$0")/.."
TOKENIZER=${1:-}
logs=$(mktemp -d)
common=(--checkpoint.no_enable --metrics.no_enable_tensorboard --training.mixed_precision_param bfloat16
        --metrics.log_freq 1)
launch() {  # name, then train.py arguments; runs in the background
    local name=$1; shift
    echo "### $name: python train.py $*" > "$logs/$name.log"
    (timeout 180 python train.py "$@" --job.dump_folder "$logs/$name.out" "${common[@]}" >> "$logs/$name.log" 2>&1
     echo "rc $?" >> "$logs/$name.log") &
}
launch debug_eager --job.config_file train_configs/debug_model.toml --training.steps 20 --compile.no_enable
launch debug_compile --job.config_file train_configs/debug_model.toml --training.steps 20 --compile.enable
# GRPO's engine in bf16 (a bf16 copy of the linear layers under autocast) with its decode step as a CUDA graph
launch grpo_cuda_graphs --job.config_file train_configs/grpo_debug.toml --training.steps 3 --compile.no_enable \
    --grpo.compile_generation
for preset in gpt2_debug qwen3_debug_moe mixtral_debug deepseek_v3_debug hybrid_debug bert_debug t5_debug \
              gpt_oss_debug gemma3_debug qwen3_next_debug grpo_debug sft_debug lora_debug dpo_debug reward_debug; do
    launch "${preset}_eager" --job.config_file "train_configs/$preset.toml" --training.steps 3 --compile.no_enable
    if [ "${SMOKE_COMPILE:-0}" = 1 ]; then
        launch "${preset}_compile" --job.config_file "train_configs/$preset.toml" --training.steps 3 --compile.enable
    fi
done
wait
for f in "$logs"/*.log; do
    head -1 "$f"; grep -v '^###' "$f" | grep -E "step|Error|error|Traceback" | tail -6
    if grep -q '^rc 0$' "$f"; then echo "PASS"; else tail -25 "$f"; echo "FAIL"; fi
done
echo "### bench 1B seq 4096 compile"
python scripts/bench.py --job.config_file train_configs/llama3_1b.toml --model.tokenizer_path "$TOKENIZER" \
    --training.seq_len 4096 --bench-warmup 3 --bench-steps 10 --bench-rounds 2 2>&1 | tail -8
