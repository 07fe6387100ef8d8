"""The training run both trainers share: start-up, guards, the engines, saving and resuming, evaluation."""
