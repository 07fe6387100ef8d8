"""Saving and reading checkpoints: the store (manifest, publish, latest), weights readers, moves between strategies, async saves, run identity."""
