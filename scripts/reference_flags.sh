# The reference launch's flags, shared by run_deepspeed.sh and run_ddp.sh (sourced, not run).
# Every value can be overridden through the environment; the data must be named (DATA_PATH or
# --data_path): a reference step takes 24 x 32 sequences of 1,024 tokens a rank, more than the
# built-in corpus holds.
if [ -z "${DATA_PATH:-}" ] && [[ " $* " != *" --data_path "* ]]; then
  cat >&2 <<MSG
error: the reference launch needs a corpus: set DATA_PATH (a file, directory, glob or mixture, as
--data_path takes it). One reference step is BATCH_SIZE x ACCUMULATION x ranks = 24 x 32 x N sequences
of 1,024 tokens, and the built-in corpus holds 582. To try the script on the built-in corpus instead:
  DATA_PATH=builtin BATCH_SIZE=4 ACCUMULATION=1 MAX_SEQ_LEN=256 DIM=256 N_LAYERS=4 DTYPE=float32 $0 --max_steps 20
MSG
  exit 2
fi
REFERENCE_FLAGS=(
  ${DATA_PATH:+--data_path $DATA_PATH}
  --epochs "${EPOCHS:-3}" --batch_size "${BATCH_SIZE:-24}" --learning_rate "${LR:-2e-4}"
  --dtype "${DTYPE:-bfloat16}" --accumulation_steps "${ACCUMULATION:-32}" --grad_clip "${GRAD_CLIP:-1.0}"
  --log_interval "${LOG_INTERVAL:-100}" --save_interval "${SAVE_INTERVAL:-auto}" --resume "${RESUME:-auto}"
  --dim "${DIM:-1024}" --n_layers "${N_LAYERS:-32}" --max_seq_len "${MAX_SEQ_LEN:-1024}"
  --use_flash_attn --profile --profile_interval "${PROFILE_INTERVAL:-10}"
)
