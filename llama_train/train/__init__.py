"""The training run both trainers share: start-up, guards, the DDP engine, evaluation."""
