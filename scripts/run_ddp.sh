#!/usr/bin/env bash
# The torchrun twin of run_deepspeed.sh: same flags, DDP instead of the DeepSpeed engine.
#   NPROC=2 scripts/run_ddp.sh --max_steps 100
#   NNODES=2 NODE_RANK=0 RDZV=host0:29500 scripts/run_ddp.sh   # on every node, NODE_RANK 0..N-1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LAUNCH=(--nproc_per_node "${NPROC:-1}")
if [ -n "${RDZV:-}" ]; then
  LAUNCH+=(--nnodes "${NNODES:-2}" --node_rank "${NODE_RANK:-0}" --rdzv_backend c10d --rdzv_endpoint "$RDZV")
fi
exec "$(dirname "$PY")/torchrun" "${LAUNCH[@]}" train_ddp.py \
  --epochs "${EPOCHS:-3}" --batch_size "${BATCH_SIZE:-24}" --learning_rate "${LR:-2e-4}" \
  --dtype "${DTYPE:-bfloat16}" --accumulation_steps "${ACCUMULATION:-32}" --grad_clip "${GRAD_CLIP:-1.0}" \
  --log_interval "${LOG_INTERVAL:-100}" --save_interval "${SAVE_INTERVAL:-10000}" \
  --dim "${DIM:-1024}" --n_layers "${N_LAYERS:-32}" --max_seq_len "${MAX_SEQ_LEN:-1024}" \
  --use_flash_attn --profile --profile_interval "${PROFILE_INTERVAL:-10}" \
  --output_dir "${OUTPUT_DIR:-outputs/ddp}" \
  "$@"
