#!/usr/bin/env bash
# `make demo`: built-in corpus -> our own sentencepiece tokenizer -> a small LLaMA pretrained
# with ZeRO-2 on every local device (2 CPU ranks on a 2-core machine), watched in TensorBoard and a
# CSV -> eval perplexity -> HF export -> the export scored on the run's held-out split ->
# a few generated sentences through transformers -> a summary.
# Override with the environment: DEMO_STEPS=600 DEMO_PRESET=debug OUT=outputs/demo VERBOSE=1 ...
# DEMO_TRAINER=ddp trains with the DDP twin (torchrun train_ddp.py, same model and flags) instead of
# DeepSpeed ZeRO-2: the default on macOS, where DeepSpeed's CPU ops are not built or tested.
# Portable to macOS's bash 3.2 (no mapfile, no nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_BIN=.venv/bin
OUT=${OUT:-outputs/demo}
TRAINER=${DEMO_TRAINER:-$([ "$(uname -s)" = Darwin ] && echo ddp || echo deepspeed)}
CORES=$(getconf _NPROCESSORS_ONLN 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 1)
NDEV=$("$VENV_BIN/python" -m llama_train.gpu count) # GPUs torch may use here (CUDA_VISIBLE_DEVICES applied)
if [ "$NDEV" = 0 ]; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} # no GPU: say so, else each DeepSpeed process warns it found none
  NDEV=${DEMO_RANKS:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES / NDEV > 0 ? CORES / NDEV : 1 ))}
fi
if [ "$TRAINER" = ddp ]; then
  echo "demo: training with the DDP twin (torchrun train_ddp.py)$([ "$(uname -s)" = Darwin ] && echo ': macOS, where DeepSpeed is untested')"
  LAUNCH=("$VENV_BIN/python" -m torch.distributed.run --nproc_per_node "$NDEV" train_ddp.py) # = torchrun
else
  LAUNCH=()
  while IFS= read -r word; do LAUNCH+=("$word"); done < <("$VENV_BIN/python" -m llama_train.gpu deepspeed "$NDEV")
  # the launcher's own INFO lines (and its "no hostfile" warning) only with VERBOSE=1, as the trainer's --verbose
  LAUNCH+=(--log_level "$([ -n "${VERBOSE:-}" ] && echo info || echo error)" train_deepspeed.py
    --deepspeed_config ds_configs/zero2.json)
fi
rm -rf "$OUT"
start=$(date +%s)
"${LAUNCH[@]}" \
  --preset "${DEMO_PRESET:-tiny}" --max_seq_len "${DEMO_SEQ:-128}" \
  --batch_size "${DEMO_BATCH:-16}" --accumulation_steps 1 --learning_rate 2e-3 --warmup_steps 30 \
  --max_steps "${DEMO_STEPS:-400}" --log_interval 25 --eval_interval 100 --eval_batches 20 --eval_tasks builtin \
  --report_to tensorboard,csv ${VERBOSE:+--verbose} --output_dir "$OUT" "$@"
"$VENV_BIN/python" scripts/eval_ppl.py --model "$OUT/hf" | tee "$OUT/eval_ppl.txt" # = the trainer's final eval
"$VENV_BIN/python" scripts/generate.py --model "$OUT/hf" --max_new_tokens 30 --temperature 0.7 \
  --prompt "The module" "Return the" "If the file" | tee "$OUT/samples.txt"
"$VENV_BIN/python" scripts/summarize_run.py "$OUT" --elapsed $(( $(date +%s) - start ))
