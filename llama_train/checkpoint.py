"""Checkpoint layout, the `latest` marker, resume state, and the DDP trainer's checkpoints.

    <output_dir>/checkpoints/step_00000100/   one complete checkpoint (DeepSpeed's or ours)
        trainer_state.json                    step, data position, run shape (written last)
        rng_state.pt                          every rank's RNG states
    <output_dir>/checkpoints/latest           the name of the newest complete checkpoint

`latest` moves only after every rank has finished writing (the trainers barrier first) and is
replaced atomically (temp file + rename), so a crash mid-save leaves the previous checkpoint
as the one `--resume auto` finds.
"""

import json
import os
import random
import shutil

import torch

from llama_train.dist import all_gather_object, barrier

STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state.pt"


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _atomic_write(path: str, text: str):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_latest(root: str) -> str | None:
    path = os.path.join(root, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read().strip() or None


def find_resume(resume: str, output_dir: str) -> tuple[str, str] | None:
    """(checkpoint root, tag) to resume from, or None. `auto` = `latest` under output_dir
    (none yet is fine: a fresh start); a PATH must be a checkpoint directory."""
    if resume == "none":
        return None
    if resume == "auto":
        root = checkpoint_root(output_dir)
        tag = read_latest(root)
        return (root, tag) if tag else None
    path = os.path.normpath(resume)
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise FileNotFoundError(f"--resume {resume}: not a complete checkpoint (no {STATE_FILE} in it)")
    return os.path.dirname(path), os.path.basename(path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_train_state(ckpt_dir: str, state: dict, rank: int):
    """Called on every rank (collective): rank 0 writes all ranks' RNG states and the trainer
    state. `trainer_state.json` is written last: its presence marks the checkpoint complete."""
    rngs = all_gather_object(rng_state())
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        torch.save(rngs, os.path.join(ckpt_dir, RNG_FILE))
        _atomic_write(os.path.join(ckpt_dir, STATE_FILE), json.dumps(state, indent=2))


def run_shape(args, world_size: int) -> dict:
    """What decides which sequences each step sees; a resume must keep all of it."""
    keys = ("batch_size", "accumulation_steps", "max_seq_len", "seed", "data_split")
    return {"world_size": world_size, **{k: getattr(args, k) for k in keys}}


def load_train_state(ckpt_dir: str, rank: int, world_size: int, expect: dict) -> dict:
    """Trainer state of a checkpoint; restores this rank's RNG. Refuses a run whose shape
    (world size, batch, accumulation, seq len, seed) would see different data than the saved one."""
    with open(os.path.join(ckpt_dir, STATE_FILE)) as f:
        state = json.load(f)
    diffs = [f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in expect.items() if state.get(k) != v]
    if diffs:
        raise ValueError(
            f"cannot resume from {ckpt_dir}: the data order depends on these and they changed:\n  - "
            + "\n  - ".join(diffs)
            + "\nresume with the original settings, or start a new --output_dir"
        )
    rngs = torch.load(os.path.join(ckpt_dir, RNG_FILE), weights_only=False)
    set_rng_state(rngs[rank] if len(rngs) == world_size else rngs[0])
    return state


def publish(root: str, tag: str, keep_last: int, rank: int):
    """Collective: after every rank finished writing `tag`, rank 0 points `latest` at it and
    deletes the oldest checkpoints beyond `keep_last` (never the one just published)."""
    barrier()
    if rank == 0:
        _atomic_write(os.path.join(root, "latest"), tag)
        done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
        for old in [d for d in done if d != tag][: max(0, len(done) - keep_last)]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    barrier()


# --- the DDP trainer's checkpoints (DeepSpeed writes its own through engine.save_checkpoint) ---


def save_ddp_checkpoint(root: str, tag: str, objects: dict, state: dict, rank: int):
    """Rank 0 writes `objects` (name -> state_dict) into a temp dir, renames it into place; then
    all ranks add their RNG states and trainer state; `publish` moves `latest` afterwards."""
    final = os.path.join(root, tag)
    if rank == 0:
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name, obj in objects.items():
            torch.save(obj, os.path.join(tmp, f"{name}.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    barrier()
    save_train_state(final, state, rank)


def load_ddp_objects(ckpt_dir: str, names: list[str]) -> dict:
    out = {}
    for name in names:
        path = os.path.join(ckpt_dir, f"{name}.pt")
        try:
            out[name] = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError, OSError) as e:
            raise RuntimeError(f"checkpoint file {path} is unreadable (truncated or corrupted?): {e}") from e
    return out
