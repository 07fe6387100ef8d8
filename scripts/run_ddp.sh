#!/usr/bin/env bash
# The torchrun twin of run_deepspeed.sh: same flags, DDP instead of the DeepSpeed engine.
#   DATA_PATH=corpus.jsonl NUM_GPUS=2 scripts/run_ddp.sh --max_steps 100
#   NNODES=2 NODE_RANK=0 RDZV=host0:29500 scripts/run_ddp.sh   # on every node, NODE_RANK 0..N-1
# Ranks per node: NUM_GPUS (NPROC is the old name), default every GPU this shell may use (1 on CPU),
# as run_deepspeed.sh.
# Through llama_train.launch, which starts torchrun as `$PY -m torch.distributed.run` (a venv that
# reaches a GPU image's torch through a .pth has no bin/torchrun). SIGTERM/SIGINT (a scheduler's preemption, Ctrl-C) to this script's
# process make every rank finish its step and save one checkpoint, then it exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/reference_flags.sh
PY=${PY:-.venv/bin/python}
NDEV=$("$PY" -m llama_train.gpu count)
LAUNCH=(--nproc_per_node "${NUM_GPUS:-${NPROC:-$((NDEV > 0 ? NDEV : 1))}}")
if [ -n "${RDZV:-}" ]; then
  LAUNCH+=(--nnodes "${NNODES:-2}" --node_rank "${NODE_RANK:-0}" --rdzv_backend c10d --rdzv_endpoint "$RDZV")
fi
exec "$PY" -m llama_train.launch torchrun "${LAUNCH[@]}" train_ddp.py \
  "${REFERENCE_FLAGS[@]}" \
  --output_dir "${OUTPUT_DIR:-outputs/ddp}" \
  "$@"
