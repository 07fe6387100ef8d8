#!/usr/bin/env bash
# The reference DeepSpeed launch. Override any knob through the environment, add flags after:
#   NUM_GPUS=2 DS_CONFIG=ds_configs/zero3.json scripts/run_deepspeed.sh --max_steps 100
#   HOSTFILE=hostfile scripts/run_deepspeed.sh            # multi-node (see hostfile)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DS_CONFIG=${DS_CONFIG:-ds_configs/zero2.json}
if [ -n "${HOSTFILE:-}" ]; then LAUNCH=(--hostfile "$HOSTFILE"); else LAUNCH=(--num_gpus "${NUM_GPUS:-1}"); fi
exec "$(dirname "$PY")/deepspeed" "${LAUNCH[@]}" train_deepspeed.py \
  --deepspeed_config "$DS_CONFIG" \
  --epochs "${EPOCHS:-3}" --batch_size "${BATCH_SIZE:-24}" --learning_rate "${LR:-2e-4}" \
  --dtype "${DTYPE:-bfloat16}" --accumulation_steps "${ACCUMULATION:-32}" --grad_clip "${GRAD_CLIP:-1.0}" \
  --log_interval "${LOG_INTERVAL:-100}" --save_interval "${SAVE_INTERVAL:-10000}" \
  --dim "${DIM:-1024}" --n_layers "${N_LAYERS:-32}" --max_seq_len "${MAX_SEQ_LEN:-1024}" \
  --use_flash_attn --profile --profile_interval "${PROFILE_INTERVAL:-10}" \
  --output_dir "${OUTPUT_DIR:-outputs/deepspeed}" \
  "$@"
