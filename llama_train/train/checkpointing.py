"""Saving and resuming, the same for every engine: what both trainers call, over the Engine protocol
(engines/engine.py). Each engine writes and reads its own files (Engine.files, Engine.load) and
loads the neutral form itself (Engine.load_neutral); whether a resume is native or converted was
decided before any work (checkpoint/resuming.resume_point)."""

import os

import torch

from llama_train.checkpoint import portable, resuming
from llama_train.checkpoint import store as ckpt
from llama_train.checkpoint.async_save import Saver
from llama_train.checkpoint.formats import open_checkpoint
from llama_train.checkpoint.identity import data_changes
from llama_train.checkpoint.settings import CheckpointSettings
from llama_train.distributed.dist import print0
from llama_train.optim.registry import optimizer_spec
from llama_train.telemetry.metrics import MetricsWriter
from llama_train.train.engines.engine import Engine


def checkpoint_settings(args) -> CheckpointSettings:
    """The checkpoint flags, typed (checkpoint/settings.py): read once, passed to what saves and resumes;
    the writer waits for the other ranks' files as long as a collective would (--dist_timeout_minutes)."""
    return CheckpointSettings(
        output_dir=args.output_dir,
        resume=args.resume,
        start_over=args.start_over,
        hashes=args.hash_checkpoints,
        keep_last=args.keep_last,
        async_save=args.async_save,
        timeout_s=args.dist_timeout_minutes * 60,
    )


def save(engine: Engine, settings: CheckpointSettings, step: int, meta: dict, rank: int, saver: Saver):
    """Collective: every rank's files of the engine (DeepSpeed: its ZeRO shards; DDP: rank 0's, FSDP2's
    gathered), with the trainer state; `latest` moves only once all ranks' are complete."""
    dump_state(engine, f"saved_{step}", rank)  # $LLAMA_TRAIN_DUMP_STATE: to compare runs
    root, tag = ckpt.checkpoint_root(settings.output_dir), ckpt.tag_for(step)
    state = {**meta, "step": step, "skipped_steps": engine.skipped_steps}  # goes on after any resume
    saver.save(root, tag, engine.files(rank), state)


def resume(engine: Engine, start, settings: CheckpointSettings, meta: dict, plan, rank: int) -> int:
    """Continue `start` (a verified resuming.Resume; None: a fresh start, step 0) with the engine's own
    loader where it fits (start.native), else through the neutral form. Returns the step reached."""
    if start is None:
        return 0
    if start.native:
        engine.load(start.path)
    else:
        engine.load_neutral(open_checkpoint(start.path, start.state), start.step)
    return resumed(engine, start, settings, meta, plan, rank)


def resumed(engine: Engine, start, settings: CheckpointSettings, meta: dict, plan, rank: int) -> int:
    """After loading `start` into `engine`: the skipped-step count, this run's LR schedule, RNG (restored
    rank by rank, or reseeded when the world size changed), one log line saying what moved how, a
    `resume` metrics record. Returns the step."""
    was, now, as_saved = start.form, meta["layout"], start.native
    engine.skipped_steps = start.state.get("skipped_steps", engine.skipped_steps)  # native or converted
    portable.reapply_schedule(
        engine.lr_scheduler
    )  # this run's schedule (e.g. a WSD branch's decay) from here
    if was.get("world_size") == now["world_size"]:
        resuming.restore_rng(start.path, rank)
        rng = "RNG restored rank by rank"
    else:
        resuming.reseed(meta["seed"], start.step, rank)
        rng = "RNG reseeded from (seed, step, rank) for the new world size"
    how = (
        "as saved"
        if as_saved
        else f"converted: fp32 weights, {optimizer_spec(meta['optimizer']).carries} and step, LR schedule"
    )
    if scaler := engine.loss_scale():  # fp16: the scale it goes on with, the checkpoint's
        how += f"; fp16 loss scale {scaler['scale']:g}"
    moved = f"{ckpt.describe(was)} -> {ckpt.describe(now)}, {how}" if was != now else how
    print0(
        f"resumed from {start.path} at step {start.step} ({moved}); {data_line(start, meta, plan)}; {rng}",
        rank=rank,
    )
    if rank == 0:
        record = {"step": start.step, "checkpoint": start.path, "from": was, "to": now, "native": as_saved}
        MetricsWriter(settings.output_dir, rank).write("resume", **record)
    dump_state(engine, f"resumed_{start.step}", rank)
    return start.step


def data_line(start, meta: dict, plan) -> str:
    """Where the data continues, for the resume's log line: the position, a changed global batch, changed data."""
    data = f"data at epoch {plan.start.epoch}, sample {plan.start.consumed} of {plan.num_samples}"
    before = start.state.get("global_batch", plan.global_batch)
    if before != plan.global_batch:
        data += f" (global batch {before} -> {plan.global_batch}; the LR schedule stays in optimizer steps)"
    if changed := data_changes(start.state.get("data"), meta["data"]):  # --allow_data_change
        data += f"; data changed ({'; '.join(changed)}): its new order from that sample count on"
    return data


def dump_state(engine: Engine, label: str, rank: int):
    """$LLAMA_TRAIN_DUMP_STATE=DIR: write the engine's gathered state (Engine.gathered_state) to
    DIR/<label>.pt, for comparing the engine before a save with the engine after a resume. Collective."""
    where = os.environ.get("LLAMA_TRAIN_DUMP_STATE")
    if not where:
        return
    state = engine.gathered_state()
    if rank == 0:
        os.makedirs(where, exist_ok=True)
        torch.save(state, os.path.join(where, f"{label}.pt"))
