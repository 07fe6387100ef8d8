"""Process-group setup, device and dtype choice, rank helpers. Rank and world size are passed
around explicitly."""

import datetime
import os
import socket

import torch
import torch.distributed as dist

from llama_train import cpu
from llama_train.errors import ConfigError
from llama_train.gpu import check_cuda_usable

DTYPE_OF = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What DistributedDataParallel leaves alone (train_ddp.py sets it as _ddp_params_and_buffers_to_ignore):
# the complex64 rotary table, which NCCL cannot broadcast and nothing trains
DDP_IGNORED = {"pos_cis"}


def device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", max(local_rank, 0))
    return torch.device("cpu")


def choose_dtype(name: str, device_type: str, capability: tuple[int, int] | None = None) -> str:
    """`auto`: bf16 on GPUs with bf16 tensor cores (compute capability >= 8.0: Ampere and newer),
    fp16 + loss scaling on older GPUs (V100, T4: torch.cuda.is_bf16_supported() counts their slow
    emulation), on CPU what llama_train.cpu.auto_dtype measured to be best. An explicit bf16 on an
    older GPU is refused."""
    bf16_units = device_type == "cuda" and capability is not None and capability >= (8, 0)
    if name == "bfloat16" and device_type == "cuda" and not bf16_units:
        raise ConfigError(
            f"--dtype bfloat16 needs a GPU of compute capability >= 8.0 (Ampere or newer); this one is "
            f"{'.'.join(map(str, capability or ()))}, where bf16 is emulated and slow: use --dtype float16 or auto"
        )
    if name != "auto":
        return name
    if device_type == "cuda":
        return "bfloat16" if bf16_units else "float16"
    return cpu.auto_dtype()


def check_engine_precision(dtype: str, device_type: str, fp16_supported: bool):
    """DeepSpeed refuses fp16 where its accelerator reports none (engine._do_sanity_check, once the
    data is built). On a CPU that depends on the CPU model: torch's oneDNN has fp16 on an Intel Xeon
    with AVX512-FP16, not on an AMD EPYC (llama_train/cpu.py). Refused here first, with the way out."""
    if dtype == "float16" and not fp16_supported:
        raise ConfigError(
            f"--dtype float16: DeepSpeed's {device_type} accelerator has no fp16 on this machine"
            + (f" ({cpu.model_name()}: torch's oneDNN lacks fp16)" if device_type == "cpu" else "")
            + "; use --dtype float32 or bfloat16, or train_ddp.py, whose fp16 runs on any CPU"
        )


def resolve_dtype(name: str, device: torch.device) -> str:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return choose_dtype(name, device.type, capability)


def setup_ddp(args) -> tuple[int, int, torch.device, str]:
    """The DDP trainer's process: torch.distributed (nccl on GPU, gloo on CPU), CPU threads,
    device and dtype. Returns (rank, world, device, dtype name)."""
    check_cuda_usable()  # NVIDIA GPUs that torch cannot use: stop rather than train on CPU
    rank, world = init_distributed(
        args.local_rank, args.dist_timeout_minutes, host_collectives=args.fsdp_offload
    )
    device = device_for(args.local_rank)
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device)
    return rank, world, device, resolve_dtype(args.dtype, device)


def setup_deepspeed(args) -> tuple[int, int, torch.device, str]:
    """The DeepSpeed trainer's process: deepspeed.init_distributed (its accelerator picks nccl on
    GPU, gloo on CPU), with the workarounds around it (ds_compat), CPU threads, device and dtype.
    A plain `python train_deepspeed.py` runs as a 1-process job. Returns as `setup_ddp`."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from llama_train.distributed import ds_compat

    check_cuda_usable()  # NVIDIA GPUs that torch cannot use: stop rather than train on CPU
    ensure_launcher_env()
    if os.environ["LOCAL_RANK"] == "0":
        ds_compat.warn_stale_build_locks()
    # this rank's GPU before the first collective: NCCL otherwise puts every rank's barrier on GPU 0
    get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
    ds_compat.allow_cpu_fp16_for_tests()  # tests only: LLAMA_TRAIN_TEST_CPU_FP16=1
    if os.environ["LOCAL_RANK"] == "0" and get_accelerator().device_name() == "cpu":
        ds_compat.announce_op_builds()  # a first run compiles DeepSpeed's shm op: ~90 s of silence
    timeout = datetime.timedelta(minutes=args.dist_timeout_minutes)
    default_group_timeout(timeout)  # the groups DeepSpeed makes itself get it too
    with ds_compat.hide_op_load_banner(args.verbose):
        deepspeed.init_distributed(timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_compat.release_deepspeed_shm(rank, world)
    device = torch.device(get_accelerator().device_name(int(os.environ["LOCAL_RANK"])))
    set_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device)
    dtype = resolve_dtype(args.dtype, device)
    check_engine_precision(dtype, device.type, get_accelerator().is_fp16_supported())
    return rank, world, device, dtype


def init_distributed(
    local_rank: int, timeout_minutes: float = 30.0, host_collectives: bool = False
) -> tuple[int, int]:
    """torch.distributed for the DDP trainer: nccl on GPU, gloo on CPU, collectives that fail after
    `timeout_minutes` (--dist_timeout_minutes, as the DeepSpeed trainer's). `host_collectives`
    (--fsdp_offload: gradients and optimizer state on the host) adds gloo for CPU tensors beside NCCL.
    Returns (rank, world)."""
    if "WORLD_SIZE" not in os.environ:  # plain `python train_ddp.py`: one process, no group
        return 0, 1
    backend = process_group_backend(torch.cuda.is_available(), host_collectives)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(minutes=timeout_minutes)
    default_group_timeout(timeout)
    dist.init_process_group(backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def process_group_backend(cuda: bool, host_collectives: bool) -> str:
    """nccl on GPUs, gloo on CPU; with `host_collectives` on GPUs both, by device: FSDP2's CPU offload
    clips gradients and reads fp16's found_inf over CPU DTensors, which NCCL cannot reduce
    (pytorch#148532; torchtune creates its group the same way)."""
    if not cuda:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if host_collectives else "nccl"


def default_group_timeout(timeout: datetime.timedelta):
    """Every process group made later without a timeout of its own gets `timeout` (--dist_timeout_minutes)
    instead of the backend's default (gloo 30 min, NCCL 10): DeepSpeed's data-parallel (ZeRO's), ZeRO-3
    partition, TP/SP and pipeline groups, and DeviceMesh's. torch 2.13's new_group, split_group and
    DeviceMesh read these two module defaults (distributed_c10d._get_default_timeout);
    tests/test_long_runs.py::test_dist_timeout_minutes_reaches_deepspeeds_own_groups notices when
    they stop doing so."""
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.distributed_c10d.default_pg_nccl_timeout = timeout


def collective_timeout_s(device: torch.device, group=None) -> float | None:
    """The collective timeout of `group` (None: the default group), read back from its backend (what
    --dist_timeout_minutes set, or not); None without a process group."""
    if not is_dist():
        return None
    group = group or dist.distributed_c10d._get_default_group()
    return group._get_backend(device).options._timeout.total_seconds()


def set_cpu_threads(local_world_size: int, device: torch.device):
    """CPU ranks share the cores unless the user chose (2 ranks on 2 cores: 1 each)."""
    if "OMP_NUM_THREADS" not in os.environ and device.type == "cpu":
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


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


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
