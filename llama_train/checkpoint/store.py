"""Storing checkpoints: the layout, the `latest` marker, the integrity manifest, publishing, and what a
checkpoint records about its run (run_meta, its form).

    <output_dir>/checkpoints/step_00000100/   one complete checkpoint (DeepSpeed's or ours)
        trainer_state.json                    step, data position, run shape (written last)
        rng_state.pt                          every rank's RNG states
    <output_dir>/checkpoints/latest           the name of the newest complete checkpoint

Both trainers write a checkpoint into `step_N.tmp/` and rename it to `step_N/` once complete
(fresh_dir, publish), so a checkpoint directory never mixes two runs' files. `latest` moves only
after that (the trainers barrier first) and is replaced atomically (temp file + rename), so a crash
mid-save leaves the previous checkpoint as the one `--resume auto` finds.

Whether and how a run resumes is decided in resuming.py.
"""

import hashlib
import json
import os
import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from llama_train.distributed.dist import all_gather_object, barrier
from llama_train.distributed.strategies import Strategy
from llama_train.errors import CheckpointError
from llama_train.fileio import atomic_write, fsync_path, fsync_tree

STATE_FILE = "trainer_state.json"
TMP_SUFFIX = ".tmp"  # a checkpoint being written (fresh_dir); renamed when complete (publish)
OLD_SUFFIX = ".old"  # an older save of the step being published, until the new one is in place
RNG_FILE = "rng_state.pt"


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def saved_states(output_dir: str) -> dict[str, dict]:
    """tag -> trainer state of every complete checkpoint of a run (for tools: read, not verified)."""
    root, out = checkpoint_root(output_dir), {}
    if os.path.isdir(root):
        for tag in sorted(os.listdir(root)):
            path = os.path.join(root, tag, STATE_FILE)
            if re.fullmatch(r"step_\d+", tag) and os.path.isfile(path):
                with open(path) as f:
                    out[tag] = json.load(f)
    return out


def read_latest(root: str) -> str | None:
    path = os.path.join(root, "latest")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        tag = f.read().strip() or None
    if tag and not os.path.exists(os.path.join(root, tag)):  # publish killed mid-replace: the older save
        try:
            os.replace(os.path.join(root, tag + OLD_SUFFIX), os.path.join(root, tag))
        except FileNotFoundError:  # nothing aside (or another rank restored it first)
            pass
    return tag


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
    names = all_gather_object(listing(ckpt_dir) if rank == 0 else None)[
        0
    ]  # once every rank's files are written
    parts = all_gather_object(file_entries(ckpt_dir, names[rank::world], hashes))
    if rank != 0:
        return None
    entries = {k: v for part in parts for k, v in part.items()}
    return {n: entries[n] for n in names}


def listing(ckpt_dir: str) -> list[str]:
    """Every file under `ckpt_dir` but the trainer state, relative to it, sorted: what the manifest lists."""
    names = (os.path.relpath(os.path.join(d, f), ckpt_dir) for d, _, fs in os.walk(ckpt_dir) for f in fs)
    return sorted(n for n in names if n != STATE_FILE)


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
        write_state(ckpt_dir, state, files, time.perf_counter() - start, hashes)


def write_state(ckpt_dir: str, state: dict, files: dict, hash_s: float, hashes: bool):
    """Rank 0, the last write of a checkpoint: `trainer_state.json` with the manifest `files`."""
    size = sum(f["bytes"] for f in files.values()) / 1e9
    what = f"hashed in {hash_s:.1f} s" if hashes else "not hashed (--no-hash_checkpoints)"
    print(f"checkpoint {os.path.basename(ckpt_dir)}: {len(files)} files, {size:.2f} GB, {what}", flush=True)
    atomic_write(os.path.join(ckpt_dir, STATE_FILE), json.dumps({**state, "files": files}, indent=2))


def file_entries(ckpt_dir: str, names: list[str], hashes: bool) -> dict:
    """The manifest entries of `names` (relative to `ckpt_dir`): size, and sha256 with `hashes`."""
    paths = [os.path.join(ckpt_dir, n) for n in names]
    digests = _sha256_many(paths) if hashes else [None] * len(paths)
    return {
        n: {"bytes": os.path.getsize(p), **({"sha256": d} if hashes else {})}
        for n, p, d in zip(names, paths, digests)
    }


def _injected_delay(step, hook: str = "LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP"):
    """Tests kill a run mid-save at a known point: shards written, checkpoint not yet complete (`hook`
    = the step, or steps comma-separated), or publish between replacing the old save of a step and the
    new one (= the tag)."""
    if str(step) in os.environ.get(hook, "").split(","):
        print(f"test hook: sleeping mid-save at step {step}", flush=True)
        time.sleep(float(os.environ.get("LLAMA_TRAIN_TEST_SAVE_DELAY_S", "600")))


def run_shape(args, layout) -> dict:
    """What decides which sequences each step sees, and how the model is split over the ranks
    (`model_parallel`: llama_train.distributed.parallel.Layout.name, None without); a resume must keep all of it."""
    keys = ("batch_size", "accumulation_steps", "max_seq_len", "seed", "data_split")
    return {"world_size": layout.world, "model_parallel": layout.name, **{k: getattr(args, k) for k in keys}}


def run_meta(args, margs, layout, strategy: Strategy, dtype: str) -> dict:
    """What every checkpoint of this run records beside its state (trainer_state.json), known before
    any work and what a resume is checked against: the run's shape, model, strategy and form
    (Strategy.form). The trainer adds the optimizer's parameter groups once its engine exists
    (Engine.optimizer_groups)."""
    return {
        **run_shape(args, layout),
        "model": margs.to_dict(),
        "strategy": strategy.run_name,
        "optimizer": args.optimizer,
        "layout": strategy.form(layout.world, dtype),
    }


def form_of(state: dict) -> dict:
    """A checkpoint's form (Strategy.form) from its trainer state; older checkpoints: the strategy and
    world size they recorded."""
    return state.get("layout") or {k: state.get(k) for k in ("strategy", "world_size")}


def describe(form: dict) -> str:
    """'deepspeed-zero2 x2 ranks (float32, optimizer offloaded)' for log lines."""
    world = form.get("world_size")
    text = f"{form.get('strategy')} x{world} rank{'s' if world != 1 else ''}"
    extras = [form["dtype"]] if form.get("dtype") else []
    extras += [f"{what} offloaded" for what in ("optimizer", "params") if form.get(f"offload_{what}")]
    return text + (f" ({', '.join(extras)})" if extras else "")


def verify_checkpoint(ckpt_dir: str, rank: int = 0, world: int = 1, hashes: bool = True) -> dict:
    """The trainer state of a complete, intact checkpoint; a clear CheckpointError naming the
    file otherwise. Collective when `world` > 1: each file is checked once, by one rank (every
    world-th file each, hashes in threads), and every rank raises the same first problem. Sizes are
    always checked, sha256 with `hashes`."""
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


def publish(root: str, tag: str, keep_last: int, rank: int):
    """Collective: after every rank finished writing `tag` into <tag>.tmp (fresh_dir), rank 0 publishes
    it (publish_now)."""
    barrier()
    if rank == 0:
        publish_now(root, tag, keep_last)
    barrier()


def publish_now(root: str, tag: str, keep_last: int):
    """Rank 0, once <tag>.tmp is complete: fsync its files and directories (a node crash after `latest`
    moved must not leave it naming pages that never reached the disk), rename it into place (replacing
    an older save of the same step: moved aside to <tag>.old first, so a kill in between leaves it for
    read_latest), fsync the rename, point `latest` at it and delete the oldest checkpoints beyond
    `keep_last` (never the one just published) and what killed saves left."""
    final = os.path.join(root, tag)
    fsync_tree(final + TMP_SUFFIX)
    shutil.rmtree(final + OLD_SUFFIX, ignore_errors=True)
    if os.path.exists(final):  # an older save of this step: aside until the new one is in place
        os.replace(final, final + OLD_SUFFIX)
    _injected_delay(tag, "LLAMA_TRAIN_TEST_PUBLISH_DELAY_AT")  # a kill here: read_latest restores it
    os.replace(final + TMP_SUFFIX, final)
    fsync_path(root)
    shutil.rmtree(final + OLD_SUFFIX, ignore_errors=True)
    atomic_write(os.path.join(root, "latest"), tag)
    steps = [d for d in os.listdir(root) if d.startswith("step_")]
    done = sorted(d for d in steps if not d.endswith((TMP_SUFFIX, OLD_SUFFIX)))
    killed = [d for d in steps if d.endswith((TMP_SUFFIX, OLD_SUFFIX))]
    for old in [d for d in done if d != tag][: max(0, len(done) - keep_last)] + killed:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


# --- the DDP trainer's checkpoints (DeepSpeed writes its own: engines/ds_engine.py) ---


def ddp_files(objects: dict, rank: int):
    """The DDP trainer's files, for async_save.Saver.save: rank 0 writes `objects` (name -> state_dict)
    as <name>.pt (FSDP2: gathered), the other ranks nothing."""
    return lambda tmp: {os.path.join(tmp, f"{n}.pt"): obj for n, obj in objects.items()} if rank == 0 else {}


def fresh_dir(root: str, tag: str, rank: int) -> str:
    """Collective: an empty <root>/<tag>.tmp that every rank writes the checkpoint into. DeepSpeed saves
    into an existing directory without clearing it, so a killed save's files (another world size's
    shards, another dtype's prefix) would otherwise join the next save of that step."""
    tmp = os.path.join(root, tag + TMP_SUFFIX)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    return tmp


# --- finding a checkpoint to read back as plain weights (weights.py: export, evaluation, generation) ---


def run_dir(ckpt_dir: str) -> str:
    """The output_dir of the run that wrote `ckpt_dir` (<output_dir>/checkpoints/<tag>)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(ckpt_dir)))


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, given it or a run's output_dir (then its `latest`)."""
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    tag = read_latest(checkpoint_root(path))
    if tag is None:
        raise CheckpointError(f"{path} is neither a checkpoint nor an output_dir with checkpoints/latest")
    return os.path.join(checkpoint_root(path), tag)
