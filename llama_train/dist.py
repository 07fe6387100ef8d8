"""Process-group setup and rank helpers. Rank and world size are passed around explicitly."""

import datetime
import glob
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

DTYPE_OF = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", max(local_rank, 0))
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> str:
    """`auto`: bf16 on GPUs that support it, fp16 on older GPUs, fp32 on CPU (CPU bf16 is ~400x slower)."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def init_distributed(local_rank: int) -> tuple[int, int]:
    """torch.distributed for the DDP trainer: nccl on GPU, gloo on CPU. Returns (rank, world)."""
    if "WORLD_SIZE" not in os.environ:  # plain `python train_ddp.py`: one process, no group
        return 0, 1
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    # long timeout: rank 0 may spend minutes building the data cache while others wait on files
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=60))
    return dist.get_rank(), dist.get_world_size()


def set_cpu_threads(local_world_size: int):
    """Share the cores among local ranks unless the user chose (2 ranks on 2 cores: 1 each)."""
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world_size)))


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier():
    if is_dist():
        dist.barrier()


def all_reduce_mean(values: list[float], device: torch.device) -> list[float]:
    """Mean of each value over ranks (one collective for the whole list)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if is_dist():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t.tolist()


def all_gather_object(obj) -> list:
    if not is_dist():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def print0(*args, rank: int = 0, **kwargs):
    if rank == 0:
        print(*args, **kwargs, flush=True)


def free_port() -> int:
    """A TCP port nobody listens on now, for a local rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_launcher_env():
    """Without a launcher, behave as a 1-process job (rank 0 of 1) on a free local port."""
    if "WORLD_SIZE" in os.environ:
        return
    port = free_port()
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


# DeepSpeed's CPU shared-memory allreduce (op deepspeed_shm_comm, used when all ranks share a host)
SHM_BUFFER = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def release_deepspeed_shm(rank: int, world: int):
    """DeepSpeed creates one ~69 MB shared-memory file per rank and never unlinks it: every CPU run
    left ranks x 69 MB of RAM in /dev/shm, and a later run on the same port mapped stale buffers.
    Every rank maps all buffers inside deepspeed.init_distributed(); after a barrier each unlinks
    its own, so the memory lives exactly as long as the processes, however they end."""
    if world > 1:
        barrier()
    path = SHM_BUFFER.format(
        uid=os.getuid(),
        addr=os.environ.get("MASTER_ADDR", ""),
        port=os.environ.get("MASTER_PORT", ""),
        rank=rank,
    )
    try:
        os.unlink(path)
    except FileNotFoundError:  # multi-host jobs (no shm), or a build of DeepSpeed without the op
        pass


def warn_stale_build_locks(older_than_s: float = 600.0) -> list[str]:
    """A JIT build of a DeepSpeed op (cpu_adam, deepspeed_shm_comm) killed midway leaves a `lock`
    file behind, and every later launch waits on it forever without a word. Name such locks
    before DeepSpeed loads its ops; returns the paths found."""
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
