"""What the checkpoint code reads of the flags, typed: one CheckpointSettings, built once from the
parsed flags (train/checkpointing.checkpoint_settings) and passed down, so a function's signature says which
settings it depends on instead of taking the whole argparse namespace."""

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointSettings:
    output_dir: str  # checkpoints go under <output_dir>/checkpoints/
    resume: str = "none"  # --resume: none | auto | PATH (resuming.find_resume)
    start_over: bool = False  # --start_over: an earlier run in output_dir is moved aside (rundir.py)
    hashes: bool = True  # --hash_checkpoints: sha256 of every file, written on save and checked on resume
    keep_last: int = 3  # --keep_last: complete checkpoints kept (the newest is never deleted)
    async_save: bool = False  # --async_save: written in a background thread (async_save.Saver)
    timeout_s: float = 1800.0  # how long rank 0 waits for the others' files: a collective's timeout
