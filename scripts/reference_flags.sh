# The reference launch's flags, shared by run_deepspeed.sh and run_ddp.sh (sourced, not run).
# Every value can be overridden through the environment.
REFERENCE_FLAGS=(
  --epochs "${EPOCHS:-3}" --batch_size "${BATCH_SIZE:-24}" --learning_rate "${LR:-2e-4}"
  --dtype "${DTYPE:-bfloat16}" --accumulation_steps "${ACCUMULATION:-32}" --grad_clip "${GRAD_CLIP:-1.0}"
  --log_interval "${LOG_INTERVAL:-100}" --save_interval "${SAVE_INTERVAL:-10000}"
  --dim "${DIM:-1024}" --n_layers "${N_LAYERS:-32}" --max_seq_len "${MAX_SEQ_LEN:-1024}"
  --use_flash_attn --profile --profile_interval "${PROFILE_INTERVAL:-10}"
)
