"""Process groups and how a model is spread over ranks: DDP/DeepSpeed setup, ds_config, FSDP2, TP/SP/PP, compile."""
