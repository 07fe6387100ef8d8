#!/usr/bin/env bash
# `make demo`: built-in corpus -> our own sentencepiece tokenizer -> a small LLaMA pretrained
# with ZeRO-2 on every local device (2 CPU ranks on a 2-core machine) -> eval perplexity ->
# HF export -> a few generated sentences through transformers -> a summary.
# Override with the environment: DEMO_STEPS=600 DEMO_PRESET=debug OUT=outputs/demo ...
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN=.venv/bin
OUT=${OUT:-outputs/demo}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  NDEV=$(nvidia-smi -L | wc -l)
else
  NDEV=${DEMO_RANKS:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NDEV > 0 ? $(nproc) / NDEV : 1 ))}
fi
rm -rf "$OUT"
start=$(date +%s)
"$VENV_BIN/deepspeed" --num_gpus "$NDEV" train_deepspeed.py \
  --deepspeed_config ds_configs/zero2.json \
  --preset "${DEMO_PRESET:-tiny}" --max_seq_len "${DEMO_SEQ:-128}" \
  --batch_size "${DEMO_BATCH:-16}" --accumulation_steps 1 --learning_rate 2e-3 --warmup_steps 30 \
  --max_steps "${DEMO_STEPS:-400}" --log_interval 25 --eval_interval 100 --eval_batches 20 \
  --output_dir "$OUT" "$@"
"$VENV_BIN/python" scripts/generate.py --model "$OUT/hf" --max_new_tokens 30 --temperature 0.7 \
  --prompt "The module" "Return the" "If the file" | tee "$OUT/samples.txt"
"$VENV_BIN/python" scripts/summarize_run.py "$OUT" --elapsed $(( $(date +%s) - start ))
