"""Deciding a resume, once, before the data cache is built or an engine is made (resume_point): which
checkpoint, every refusal (check_resumable) and whether it continues with the engine's own loader or
through the neutral form (continues_natively); and the native parts of continuing one: RNG states
(restore_rng, or reseed on another world size) and the DDP trainer's own files (load_ddp_objects).
Storing checkpoints (tmp dir, manifest, publish, `latest`) is store.py's.
"""

import hashlib
import os
import random
import re
from dataclasses import dataclass

import torch

from llama_train.checkpoint.formats import safe_load
from llama_train.checkpoint.rundir import claim_output_dir
from llama_train.checkpoint.settings import CheckpointSettings
from llama_train.checkpoint.store import (
    RNG_FILE,
    STATE_FILE,
    checkpoint_root,
    describe,
    form_of,
    read_latest,
    resolve_checkpoint,
    verify_checkpoint,
)
from llama_train.distributed.strategies import kind_of
from llama_train.errors import CheckpointError
from llama_train.optim.registry import optimizer_spec
from llama_train.steps import DataPosition


def find_resume(resume: str, output_dir: str) -> str | None:
    """The checkpoint directory to resume from, or None. `auto` = `latest` under output_dir
    (none yet is fine: a fresh start); a PATH is a checkpoint directory or a run's output_dir
    (its `latest`)."""
    if resume == "none":
        return None
    if resume == "auto":
        root = checkpoint_root(output_dir)
        tag = read_latest(root)
        return os.path.join(root, tag) if tag else None
    try:
        return os.path.normpath(resolve_checkpoint(resume))
    except CheckpointError:
        raise CheckpointError(
            f"--resume {resume}: not a complete checkpoint (no {STATE_FILE} in it: half-written, or not a "
            "checkpoint) nor a run's output_dir with checkpoints/latest"
        ) from None


@dataclass
class Resume:
    """A verified checkpoint a run continues from: its directory, trainer state, and whether it loads
    with the engine's own loader (`native`) or through the neutral form (portable.py)."""

    path: str
    state: dict
    native: bool = False

    @property
    def step(self) -> int:
        return self.state["step"]

    @property
    def form(self) -> dict:
        return form_of(self.state)

    def position(self, num_samples: int) -> DataPosition:
        """Where its next step reads; checkpoints from before the position was recorded continued
        at step x their global batch within their epoch."""
        if "position" in self.state:
            return DataPosition(**self.state["position"])
        batch = self.state["batch_size"] * self.state["accumulation_steps"] * self.state["world_size"]
        epoch, steps = divmod(self.step, num_samples // batch)
        return DataPosition(epoch, steps * batch)


def resume_point(settings: CheckpointSettings, meta: dict, rank: int, world: int) -> Resume | None:
    """Collective. The whole resume decision, before the data cache is built or an engine is made:
    the checkpoint `--resume` names, intact (every file's size and sha256 checked, each by one rank),
    none of its refusals met (check_resumable, against `meta`: what this run's checkpoints would
    record, run_meta), and whether it continues natively; None for a fresh start (said so for `auto`)."""
    path = find_resume(settings.resume, settings.output_dir)
    claim_output_dir(settings, path, rank)  # one run's history per output_dir
    if path is None:
        if settings.resume == "auto" and rank == 0:
            print(f"no checkpoint in {checkpoint_root(settings.output_dir)}, starting fresh", flush=True)
        return None
    if settings.resume == "auto":
        path, state = newest_intact(path, rank, world, settings.hashes)
    else:  # a checkpoint the user named: damaged, it is refused
        state = verify_checkpoint(path, rank=rank, world=world, hashes=settings.hashes)
    check_resumable(path, state, meta)
    return Resume(path, state, native=continues_natively(form_of(state), meta["layout"]))


def newest_intact(latest: str, rank: int, world: int, hashes: bool) -> tuple[str, dict]:
    """Collective. `latest` and its trainer state if it verifies; else the newest older checkpoint
    beside it that does (--keep_last keeps some: after a node crash the newest one may have lost pages),
    with one warning line per checkpoint skipped. None verifies: the newest one's problem is raised."""
    root, tag = os.path.split(latest)
    older = sorted((d for d in os.listdir(root) if re.fullmatch(r"step_\d{8}", d) and d < tag), reverse=True)
    skipped = []
    for path in [latest, *(os.path.join(root, d) for d in older)]:
        try:
            state = verify_checkpoint(path, rank=rank, world=world, hashes=hashes)
        except CheckpointError as e:
            skipped.append((path, e))
            continue
        for bad, why in skipped if rank == 0 else []:
            print(
                f"warning: --resume auto: skipped {bad}: {why}; resuming from {path}, the newest "
                "checkpoint that verifies",
                flush=True,
            )
        return path, state
    raise skipped[0][1]


def check_resumable(path: str, state: dict, meta: dict):
    """Every refusal of a resume, in order (a new one goes here too): what a resume cannot change.
    World size, batch, accumulation, strategy and dtype may change (portable.py converts); the model's
    parameters and numerics, what decides the data order (split, seed) and a model-parallel layout
    may not. One check waits for the data itself: the number of train sequences (check_data_size)."""
    if diffs := identity_changes(state, meta):
        raise CheckpointError(
            f"cannot resume from {path}: the model or the data order would change:\n  - "
            + "\n  - ".join(diffs)
            + "\nresume with the original flags, or start a new run from its weights with --init_from "
            "(and a new --output_dir)"
        )
    check_optimizer(path, state, meta)
    was, now = form_of(state), meta["layout"]
    was_split, now_split = state.get("model_parallel"), meta.get("model_parallel")
    if (was_split or now_split) and (was_split != now_split or was != now):
        raise CheckpointError(
            f"cannot resume from {path}: model_parallel: checkpoint {was_split!r}, now {now_split!r} "
            f"(world size {was.get('world_size')}, now {now['world_size']}): a tensor-, sequence- or "
            "pipeline-parallel run continues only in the layout and world size it was saved in; to change "
            "them, export it (scripts/export_hf.py) and start a new run from it with --init_from"
        )


def check_optimizer(path: str, state: dict, meta: dict):
    """A resume keeps its optimizer (one optimizer's state is not another's). Every optimizer moves
    across strategies and world sizes through the neutral form (portable.py: state by parameter), except
    into or out of CPU offload where its record says why not (OptimizerSpec.offload_moves)."""
    was, now = state.get("optimizer", "adamw"), meta.get("optimizer", "adamw")
    if was != now:
        raise CheckpointError(
            f"cannot resume from {path}: optimizer: checkpoint {was!r}, now {now!r} (--optimizer): its state "
            f"does not carry over; continue with --optimizer {was}, or start a new run from its weights with "
            "--init_from (fresh optimizer state, step 0)"
        )
    forms, spec = (form_of(state), meta["layout"]), optimizer_spec(now)
    offloaded = any(f.get(f"offload_{what}") for f in forms for what in ("optimizer", "params"))
    if spec.offload_moves and offloaded and not continues_natively(*forms):
        raise CheckpointError(
            f"cannot resume from {path}: a {spec.title} checkpoint ({describe(forms[0])}) moves to "
            f"{describe(forms[1])} only without CPU offload on either side ({spec.offload_moves}); resume "
            "with the original strategy, world size and dtype, or --init_from its weights"
        )


def identity_changes(state: dict, meta: dict) -> list[str]:
    """The model's identity (RUNTIME_MODEL_FIELDS aside) and what decides the data order (seed,
    split), checkpoint against now, one line per difference."""
    model = meta["model"]
    diffs = [
        f"model {k}: checkpoint {v!r}, now {model.get(k)!r}"
        for k, v in _model_identity(state.get("model", {})).items()
        if _model_identity(model).get(k) != v
    ]
    return diffs + [
        f"{k}: checkpoint {state.get(k)!r}, now {meta[k]!r}"
        for k in ("seed", "data_split")
        if k in state and state[k] != meta[k]
    ]


def check_data_size(start: Resume, num_samples: int):
    """The one refusal that waits for the data: the run's train sequences, known once its cache is
    built or opened (other data with the same flags, e.g. a changed file under --data_path)."""
    had = start.state.get("num_samples", num_samples)
    if had != num_samples:
        raise CheckpointError(
            f"cannot resume from {start.path}: its run had {had} train sequences, this one has "
            f"{num_samples} (other --data_path or data): resume with the original data"
        )


def continues_natively(was: dict, now: dict) -> bool:
    """Whether a checkpoint of form `was` loads with the engine's own loader into a run of form `now`:
    the same form always; otherwise only between engines whose checkpoints are full state dicts
    (EngineKind.full_state: DDP's and FSDP2's, gathered, at any world size). DeepSpeed's files fit only the
    same stage, world size, dtype and offload."""
    engines = [kind_of(form.get("strategy")) for form in (was, now)]
    return was == now or all(engine and engine.full_state for engine in engines)


RUNTIME_MODEL_FIELDS = (
    "use_flash_attn",
    "gradient_checkpointing",
    "checkpoint_every",
    "loss_chunk_tokens",
)  # how it runs, not what it is


def _model_identity(model: dict) -> dict:
    out = {k: v for k, v in model.items() if k not in RUNTIME_MODEL_FIELDS}
    if "n_kv_heads" in out:  # None means n_heads: compare what is used
        out["n_kv_heads"] = out["n_kv_heads"] or out.get("n_heads")
    return out


def restore_rng(ckpt_dir: str, rank: int):
    """This rank's RNG states as they were when the checkpoint was written (read by formats.safe_load)."""
    states = safe_load(os.path.join(ckpt_dir, RNG_FILE), mmap=False)
    state = states[rank]
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reseed(seed: int, step: int, rank: int) -> int:
    """RNG states of one world size cannot be handed to the ranks of another: each rank is seeded
    from (seed, step, rank) instead, the same every time. Nothing in this model draws random numbers
    while training (no dropout; the data order is seeded by (seed, epoch)), so losses do not change."""
    value = int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:8], "little")
    random.seed(value)
    torch.manual_seed(value)
    return value


DDP_OBJECTS = ("model", "optimizer", "scheduler", "scaler")  # the DDP trainer's files, name.pt each


def load_ddp_objects(ckpt_dir: str, names=DDP_OBJECTS) -> dict:
    """The DDP trainer's files of a checkpoint it continues natively, read by formats.safe_load."""
    return {name: safe_load(os.path.join(ckpt_dir, f"{name}.pt"), mmap=False) for name in names}
