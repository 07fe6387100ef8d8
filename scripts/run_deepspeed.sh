#!/usr/bin/env bash
# The reference DeepSpeed launch. Override any knob through the environment, add flags after:
#   DATA_PATH=corpus.jsonl NUM_GPUS=2 DS_CONFIG=ds_configs/zero3.json scripts/run_deepspeed.sh --max_steps 100
#   CUDA_VISIBLE_DEVICES=4,5 scripts/run_deepspeed.sh     # GPUs 4 and 5 (not 0 and 1)
#   HOSTFILE=hostfile scripts/run_deepspeed.sh            # multi-node (see hostfile)
# Through llama_train.launch: SIGTERM/SIGINT (a scheduler's preemption, Ctrl-C) to this script's
# process make every rank finish its step and save one checkpoint, then it exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/reference_flags.sh
PY=${PY:-.venv/bin/python}
DS_CONFIG=${DS_CONFIG:-ds_configs/zero2.json}
if [ -n "${HOSTFILE:-}" ]; then
  "$PY" scripts/check_hostfile.py "$HOSTFILE"  # file:line errors before pdsh/ssh get involved
  LAUNCH=(deepspeed --hostfile "$HOSTFILE") # the front starts it as $PY -m deepspeed.launcher.runner
else
  # NUM_GPUS ranks (default: every GPU this shell may use; 1 on CPU). A set CUDA_VISIBLE_DEVICES
  # becomes --include localhost:<ids>: with --num_gpus the launcher would drop it and take GPUs 0..N-1
  WORDS=$("$PY" -m llama_train.gpu deepspeed ${NUM_GPUS:+"$NUM_GPUS"})
  mapfile -t LAUNCH <<<"$WORDS"
fi
exec "$PY" -m llama_train.launch "${LAUNCH[@]}" train_deepspeed.py \
  --deepspeed_config "$DS_CONFIG" \
  "${REFERENCE_FLAGS[@]}" \
  --output_dir "${OUTPUT_DIR:-outputs/deepspeed}" \
  "$@"
