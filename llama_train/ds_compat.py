"""DeepSpeed workarounds, in one place, so the trainer uses only DeepSpeed's public API.

Each names the DeepSpeed behaviour it targets (seen in DeepSpeed 0.19.8 with torch 2.13, CPU
accelerator over gloo) and how we notice when it is no longer needed:
tests/test_ds_compat.py runs tests/helpers/ds_probe.py against the installed DeepSpeed and fails,
naming the workaround to drop, once the behaviour is gone.
"""

import glob
import os
import sys
import time

import torch
from deepspeed.runtime.utils import clip_grad_norm_

# DeepSpeed's CPU shared-memory allreduce (op deepspeed_shm_comm, used when all ranks share a host)
SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def shm_buffer_path(rank: int) -> str:
    return SHM_BUFFER.format(
        uid=os.getuid(),
        addr=os.environ.get("MASTER_ADDR", ""),
        port=os.environ.get("MASTER_PORT", ""),
        rank=rank,
    )


def release_deepspeed_shm(rank: int, world: int):
    """DeepSpeed creates one ~69 MB shared-memory file per rank (world > 1, one host) and never
    unlinks it: every CPU run left ranks x 69 MB of RAM in /dev/shm, and a later run on the same
    port mapped stale buffers. Every rank maps all buffers inside deepspeed.init_distributed();
    after a barrier each unlinks its own, so the memory lives exactly as long as the processes."""
    if world > 1:
        torch.distributed.barrier()
    try:
        os.unlink(shm_buffer_path(rank))
    except FileNotFoundError:  # multi-host jobs (no shm), or a build of DeepSpeed without the op
        pass


def warn_stale_build_locks(older_than_s: float = 600.0) -> list[str]:
    """A JIT build of a DeepSpeed op (cpu_adam, deepspeed_shm_comm) killed midway leaves a `lock`
    file behind (torch's FileBaton), and every later launch waits on it forever without a word.
    Name such locks before DeepSpeed loads its ops; returns the paths found."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    stale = []
    for lock in sorted(glob.glob(f"{root}/*/lock") + glob.glob(f"{root}/*/*/lock")):
        age = time.time() - os.path.getmtime(lock)
        if age > older_than_s:
            stale.append(lock)
            print(
                f"warning: {lock} is {age / 60:.0f} min old: an interrupted build of a DeepSpeed op left it, "
                f"and loading that op waits for it forever. If no build is running, remove it: rm {lock}",
                file=sys.stderr,
                flush=True,
            )
    return stale


def keep_fp32_grad_norm(engine):
    """fp32 without ZeRO: the engine clips in `clip_fp32_gradients` but drops the norm, so
    `get_global_grad_norm()` is None. Clip the same way and keep the norm for the log line
    (a pipeline's norm over all of its stages: `StageNorms`)."""
    mpu = StageNorms(engine.mpu) if hasattr(engine, "grid") else engine.mpu

    def clip_and_record():
        norm = clip_grad_norm_(engine.module.parameters(), engine.gradient_clipping(), mpu=mpu)
        engine._global_grad_norm = float(norm)

    engine.clip_fp32_gradients = clip_and_record


class StageNorms:
    """A pipeline's grid as `clip_grad_norm_` should read it. DeepSpeed 0.19.8's clip_grad_norm_
    (runtime/utils.py) counts a parameter only on model-parallel rank 0 unless it is marked tensor
    parallel, and the pipeline grid's model-parallel rank is the stage: every stage but the first
    adds nothing, so fp32 ZeRO-0 pipelines clip with the first stage's norm (each stage by another
    factor) and their losses drift from every other strategy's. The other norms in that file filter
    on the tensor-parallel rank (bwc_tensor_model_parallel_rank); so does this view."""

    def __init__(self, grid):
        self.grid = grid

    def get_model_parallel_rank(self):
        return self.grid.get_slice_parallel_rank()  # the tensor-parallel rank within a stage

    def get_model_parallel_group(self):
        return self.grid.get_model_parallel_group()  # all stages (x tensor ranks) of one replica


def skip_identity_allreduce(engine):
    """One process without ZeRO: the gradient all-reduce is an identity that still flattens and
    copies back every gradient; ZeRO optimizers and bf16 need the call for their own work."""
    engine.enable_backward_allreduce = False


def zero0_fp32_master(engine) -> dict[int, torch.Tensor]:
    """ZeRO-0 with bf16/fp16: the fp32 master weights live in DeepSpeed's FP16_UnfusedOptimizer
    (`fp32_groups`, one tensor per parameter, for torch's AdamW) or FP16_Optimizer (`fp32_groups_flat`,
    for DeepSpeed's FusedAdam), where deepspeed.utils.safe_get_full_fp32_param does not look: it
    returns None for these parameters. {id(module parameter): its fp32 master}; {} elsewhere."""
    opt = engine.optimizer
    low = getattr(opt, "fp16_groups", None)
    if engine.zero_optimization_stage() != 0 or low is None:
        return {}
    if hasattr(opt, "fp32_groups"):
        high = opt.fp32_groups
    else:
        from torch._utils import _unflatten_dense_tensors

        high = [_unflatten_dense_tensors(flat, group) for flat, group in zip(opt.fp32_groups_flat, low)]
    return {id(p): master for group, masters in zip(low, high) for p, master in zip(group, masters)}


def batch_world(layout) -> int:
    """The world size DeepSpeed's batch arithmetic wants (`train_batch_size` = micro x accumulation
    x it). DeepSpeedConfig divides the ranks into data-parallel ones by the `mpu` it is given, and
    AutoTP brings none at that point (it builds its groups later, in the engine), so 0.19.8 counts
    every tensor-parallel rank as data parallel (runtime/config.py, DeepSpeedConfig.__init__) and
    asserts train_batch_size == micro x accumulation x world. A step still sees micro x accumulation
    x dp sequences; DeepSpeed's own sample counter (unused here) runs tp times too fast."""
    return layout.world if layout.tp > 1 else layout.dp


def patch_engine(engine, world: int):
    """Apply the workarounds that this engine's configuration needs."""
    mixed_or_zero = engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization()
    if not mixed_or_zero:
        keep_fp32_grad_norm(engine)
    if world == 1 and not engine.zero_optimization() and not engine.bfloat16_enabled():
        skip_identity_allreduce(engine)
