#!/usr/bin/env bash
# The reference DeepSpeed launch. Override any knob through the environment, add flags after:
#   NUM_GPUS=2 DS_CONFIG=ds_configs/zero3.json scripts/run_deepspeed.sh --max_steps 100
#   HOSTFILE=hostfile scripts/run_deepspeed.sh            # multi-node (see hostfile)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/reference_flags.sh
PY=${PY:-.venv/bin/python}
DS_CONFIG=${DS_CONFIG:-ds_configs/zero2.json}
if [ -n "${HOSTFILE:-}" ]; then
  "$PY" scripts/check_hostfile.py "$HOSTFILE"  # file:line errors before pdsh/ssh get involved
  LAUNCH=(--hostfile "$HOSTFILE")
else
  LAUNCH=(--num_gpus "${NUM_GPUS:-1}")
fi
exec "$(dirname "$PY")/deepspeed" "${LAUNCH[@]}" train_deepspeed.py \
  --deepspeed_config "$DS_CONFIG" \
  "${REFERENCE_FLAGS[@]}" \
  --output_dir "${OUTPUT_DIR:-outputs/deepspeed}" \
  "$@"
