"""Checkpoint layout, the `latest` marker, resume state, and the DDP trainer's checkpoints.

    <output_dir>/checkpoints/step_00000100/   one complete checkpoint (DeepSpeed's or ours)
        trainer_state.json                    step, data position, run shape (written last)
        rng_state.pt                          every rank's RNG states
    <output_dir>/checkpoints/latest           the name of the newest complete checkpoint

`latest` moves only after every rank has finished writing (the trainers barrier first) and is
replaced atomically (temp file + rename), so a crash mid-save leaves the previous checkpoint
as the one `--resume auto` finds.
"""

import hashlib
import json
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

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


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (incomplete, truncated, corrupted, or for another run shape)."""


def find_resume(resume: str, output_dir: str) -> str | None:
    """The checkpoint directory to resume from, or None. `auto` = `latest` under output_dir
    (none yet is fine: a fresh start); a PATH must be a checkpoint directory."""
    if resume == "none":
        return None
    if resume == "auto":
        root = checkpoint_root(output_dir)
        tag = read_latest(root)
        return os.path.join(root, tag) if tag else None
    if not os.path.isfile(os.path.join(resume, STATE_FILE)):
        raise CheckpointError(f"--resume {resume}: not a complete checkpoint (no {STATE_FILE} in it)")
    return os.path.normpath(resume)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _sha256_many(paths: list[str]) -> list[str]:
    """sha256 of each file, in parallel threads (file reads and hashlib release the GIL);
    LLAMA_TRAIN_HASH_THREADS sets how many (default: the CPUs, at most 8)."""
    threads = int(os.environ.get("LLAMA_TRAIN_HASH_THREADS") or min(8, os.cpu_count() or 1))
    if len(paths) <= 1 or threads <= 1:
        return [_sha256(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(threads, len(paths))) as pool:
        return list(pool.map(_sha256, paths))


def _file_manifest(ckpt_dir: str, rank: int, world: int, hashes: bool) -> dict | None:
    """Collective. Size (and sha256 with `hashes`) of every file but the trainer state, so a resume
    detects truncation or corruption; on rank 0, None elsewhere. Rank r hashes every world-th file,
    so at scale the hashing is spread over all ranks (and their threads) instead of rank 0 alone."""
    names = None
    if rank == 0:
        names = sorted(
            os.path.relpath(os.path.join(d, f), ckpt_dir) for d, _, fs in os.walk(ckpt_dir) for f in fs
        )
        names = [n for n in names if n != STATE_FILE]
    names = all_gather_object(names)[0]  # rank 0's listing, once every rank's files are written
    mine = names[rank::world] if hashes else []
    digests = dict(zip(mine, _sha256_many([os.path.join(ckpt_dir, n) for n in mine])))
    digests = {k: v for part in all_gather_object(digests) for k, v in part.items()}
    if rank != 0:
        return None
    return {
        n: {"bytes": os.path.getsize(os.path.join(ckpt_dir, n)), **({"sha256": digests[n]} if hashes else {})}
        for n in names
    }


def save_train_state(ckpt_dir: str, state: dict, rank: int, hashes: bool = True):
    """Collective, after every rank wrote its part: rank 0 adds all ranks' RNG states and then
    `trainer_state.json` with a manifest of every file. Written last, it marks the checkpoint
    complete. (Assumes the checkpoint directory is on a filesystem every node shares.)"""
    _injected_delay(state["step"])
    rngs = all_gather_object(rng_state())  # also the point where every rank has finished writing
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        torch.save(rngs, os.path.join(ckpt_dir, RNG_FILE))
    start = time.perf_counter()
    files = _file_manifest(ckpt_dir, rank, len(rngs), hashes)
    if rank == 0:
        size = sum(f["bytes"] for f in files.values()) / 1e9
        what = (
            f"hashed in {time.perf_counter() - start:.1f} s"
            if hashes
            else "not hashed (--no-hash_checkpoints)"
        )
        print(
            f"checkpoint {os.path.basename(ckpt_dir)}: {len(files)} files, {size:.2f} GB, {what}", flush=True
        )
        _atomic_write(os.path.join(ckpt_dir, STATE_FILE), json.dumps({**state, "files": files}, indent=2))


def _injected_delay(step: int):
    """Tests kill a run mid-save at a known point: shards written, checkpoint not yet complete."""
    if os.environ.get("LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP") == str(step):
        print(f"test hook: sleeping mid-save at step {step}", flush=True)
        time.sleep(float(os.environ.get("LLAMA_TRAIN_TEST_SAVE_DELAY_S", "600")))


def run_shape(args, world_size: int, layout=None) -> dict:
    """What decides which sequences each step sees, and how the model is split over the ranks
    (`model_parallel`: llama_train.parallel.Layout.name, None without); a resume must keep all of it."""
    keys = ("batch_size", "accumulation_steps", "max_seq_len", "seed", "data_split")
    split = None if layout is None else layout.name
    return {"world_size": world_size, "model_parallel": split, **{k: getattr(args, k) for k in keys}}


def verify_checkpoint(
    ckpt_dir: str, expect: dict | None = None, rank: int = 0, world: int = 1, hashes: bool = True
) -> dict:
    """The trainer state of a complete, intact checkpoint; a clear CheckpointError naming the
    file otherwise. Collective when `world` > 1: each file is checked once, by one rank (every
    world-th file each, hashes in threads), and every rank raises the same first problem. Sizes are
    always checked, sha256 with `hashes`. With `expect` (run_shape), also refuses a run that would
    see other data."""
    state_path = os.path.join(ckpt_dir, STATE_FILE)
    try:
        with open(state_path) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {ckpt_dir} is incomplete or damaged: cannot read {state_path}: {e}"
        ) from None
    files = list(enumerate(state.get("files", {}).items()))[rank::world]
    found = _file_problem(ckpt_dir, files, hashes)
    problems = [p for p in (all_gather_object(found) if world > 1 else [found]) if p]
    if problems:
        raise CheckpointError(min(problems)[1])
    diffs = [
        f"{k}: checkpoint {state.get(k)!r}, now {v!r}" for k, v in (expect or {}).items() if state.get(k) != v
    ]
    if diffs:
        raise CheckpointError(
            f"cannot resume from {ckpt_dir}: the data order depends on these and they changed:\n  - "
            + "\n  - ".join(diffs)
            + "\nresume with the original settings (e.g. the same number of ranks), or use a new --output_dir"
        )
    return state


def _file_problem(ckpt_dir: str, files: list, hashes: bool) -> tuple[int, str] | None:
    """(manifest index, message) of the first bad file among `files` [(index, (name, entry))]."""
    for i, (rel, want) in files:
        path = os.path.join(ckpt_dir, rel)
        size = os.path.getsize(path) if os.path.exists(path) else None
        if size != want["bytes"]:
            return i, f"checkpoint file {path} is truncated or missing ({size} of {want['bytes']} bytes)"
    hashed = [(i, rel, want["sha256"]) for i, (rel, want) in files if hashes and "sha256" in want]
    digests = _sha256_many([os.path.join(ckpt_dir, rel) for _, rel, _ in hashed])
    for (i, rel, want), got in zip(hashed, digests):
        if got != want:
            path = os.path.join(ckpt_dir, rel)
            return i, f"checkpoint file {path} is corrupted (sha256 differs from when it was saved)"
    return None


def restore_rng(ckpt_dir: str, rank: int):
    """This rank's RNG states as they were when the checkpoint was written."""
    states = torch.load(os.path.join(ckpt_dir, RNG_FILE), weights_only=True)
    state = states[rank]
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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


def save_ddp_checkpoint(root: str, tag: str, objects: dict, state: dict, rank: int, hashes: bool = True):
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
    save_train_state(final, state, rank, hashes)


def load_ddp_objects(ckpt_dir: str, names: list[str]) -> dict:
    return {
        name: torch.load(os.path.join(ckpt_dir, f"{name}.pt"), map_location="cpu", weights_only=True)
        for name in names
    }


# --- reading any checkpoint back as plain weights (export, evaluation, generation) ---


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, given it or a run's output_dir (then its `latest`)."""
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    tag = read_latest(checkpoint_root(path))
    if tag is None:
        raise CheckpointError(f"{path} is neither a checkpoint nor an output_dir with checkpoints/latest")
    return os.path.join(checkpoint_root(path), tag)


def consolidated_state_dict(ckpt_dir: str) -> tuple[dict, dict]:
    """(full fp32 state dict, the run's model args as a dict) from a DDP checkpoint or a DeepSpeed
    one of any ZeRO stage -- ZeRO shards merged by DeepSpeed's own zero_to_fp32."""
    state = verify_checkpoint(ckpt_dir)
    from llama_train import parallel

    if os.path.exists(os.path.join(ckpt_dir, "model.pt")):  # ours (DDP)
        sd = torch.load(os.path.join(ckpt_dir, "model.pt"), map_location="cpu", weights_only=True)
    elif parallel.checkpoint_kind(ckpt_dir):  # tensor-parallel shards or pipeline stages, merged
        try:
            sd = parallel.merged_checkpoint_state(ckpt_dir)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    elif any(f.startswith("zero_pp_rank_") for f in os.listdir(ckpt_dir)):  # ZeRO 1/2/3 shards
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        root, tag = os.path.split(os.path.normpath(ckpt_dir))
        sd = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    else:  # DeepSpeed without ZeRO: the module is saved whole (a DeepSpeed pickle, not only tensors)
        sd = torch.load(
            os.path.join(ckpt_dir, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False
        )
        sd = {**sd["module"], **_zero0_fp32_master(sd, state["model"])}
    return {k: v.float() for k, v in sd.items()}, state["model"]


def _zero0_fp32_master(ckpt: dict, model: dict) -> dict:
    """A ZeRO-0 bf16/fp16 checkpoint's fp32 master weights by name ({} for an fp32 run): DeepSpeed
    saves them as the optimizer's `fp32_groups`, in the AdamW groups' order and without names, so
    the names come from our parameter groups, rebuilt (either --decay_all_params) and matched by shape."""
    from llama_train.model import ModelArgs, Transformer
    from llama_train.optim import param_groups

    groups = (ckpt.get("optimizer") or {}).get("fp32_groups")
    if not groups:
        return {}
    with torch.device("meta"):
        net = Transformer(ModelArgs(**model))
    names = {id(p): n for n, p in net.named_parameters()}
    shapes = [[t.shape for t in g] for g in groups]
    for decay_all in (False, True):
        ours = [g["params"] for g in param_groups(net, 0.0, decay_all) if g["params"]]
        if [[p.shape for p in g] for g in ours] == shapes:
            return {names[id(p)]: t for g, ts in zip(ours, groups) for p, t in zip(g, ts)}
    raise CheckpointError(
        "cannot match the ZeRO-0 checkpoint's fp32 master weights to the model's parameters"
    )
