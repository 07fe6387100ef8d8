"""The planner's step-time model: how long one optimizer step of a strategy should take on a machine,
term by term, so that `scripts/plan_memory.py --recommend` ranks what fits by expected speed, not by
bytes alone.

    compute     6N + 6VD + 12 L D T FLOPs a token (the model's count), at the machine's peak x mfu
    recompute   activation checkpointing: the checkpointed blocks' forward once more (1/3 of their FLOPs)
    comm        the bytes the strategy really moves a step (comm.py), at the link's bandwidth, less what
                hides behind the compute it runs beside (comm_split, hidden_left)
    latency     DeepSpeed's: a fixed cost per collective (the launch and its Python path, which the host
                waits through) and per parameter its hooks handle in Python each micro-step (reduce
                buckets, ZeRO-3's fetch and release); DDP and FSDP2 start theirs from C++ / async hooks
    optimizer   the AdamW step over the parameters this rank updates
    offload     the gradient partition to the host and the updated parameters back, and the host's Adam

Every number of a `Machine` is stated with its source; the CPU one is fitted to `make bench` on the
2-core development machine (docs/memory.md says which pair of strategies it orders differently and why).
"""

import math
from dataclasses import dataclass

from llama_train.plan.comm import element_bytes
from llama_train.plan.memory import ELEMENT_BYTES, Sharding, param_numels

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default


@dataclass(frozen=True)
class Machine:
    """What a step's time depends on, per rank."""

    name: str
    peak_flops: float  # dense FLOP/s of one device in the run's dtype
    mfu: float  # the share of the peak the model's compute reaches
    link_bytes_s: float  # collective bandwidth per rank (bus bandwidth, as nccl-tests report it)
    latency_s: float  # per collective: the launch and the framework's path to it
    param_hook_s: float  # per parameter and micro-step: DeepSpeed's Python gradient hooks (ZeRO-1/2/3)
    fetch_s: float  # per parameter and fetch: ZeRO-3's gather / release bookkeeping
    adam_s: float  # per parameter: the device's fused AdamW step
    host_bytes_s: float  # device <-> host copies (offload)
    host_adam_s: float  # per parameter: DeepSpeedCPUAdam on the host
    streams: bool  # collectives can run beside compute (GPU); on CPU gloo threads: DDP, ds_cpu


# H100 SXM: 989 TFLOP/s bf16 (NVIDIA's datasheet, dense); 0.45 of it as the 1b anchors reach (TinyLlama,
# llm-foundry: 42-56% MFU); NVLink 4 at ~360 GB/s bus bandwidth (a typical nccl-tests all_reduce on 8
# GPUs); fused AdamW ~30 bytes a parameter over 3.35 TB/s of HBM3; PCIe 5 x16 ~50 GB/s; DeepSpeedCPUAdam
# ~1 ns a parameter on a 2-socket host. DeepSpeed's Python path, ~30 us a collective, ~40 us a parameter
# for its gradient hooks and ~100 us for ZeRO-3's fetch and release, is an estimate, not a measurement
# (make bench-gpu's step times will say; docs/gpu.md).
H100 = Machine("H100 SXM (stated)", 989e12, 0.45, 360e9, 30e-6, 40e-6, 100e-6, 9e-12, 50e9, 1e-9, True)
H200 = Machine("H200 (stated)", 989e12, 0.45, 360e9, 30e-6, 40e-6, 100e-6, 6.3e-12, 50e9, 1e-9, True)
A100 = Machine("A100 SXM (stated)", 312e12, 0.45, 230e9, 30e-6, 40e-6, 100e-6, 15e-12, 25e9, 1e-9, True)
# The 2-core development VM, 2 gloo ranks over loopback, fp32, one thread a rank: ~110 GFLOP/s a
# single-thread fp32 matmul (docs/monitoring.md), ~0.85 of it reached by the model's step; the rest
# fitted to make bench's time split on this machine (docs/memory.md, 'Which is fastest'): gloo moves
# ~1 GB/s of paper-counted bytes a rank, a DeepSpeed collective costs ~1 ms, its gradient hooks ~50 us
# a parameter, ZeRO-3's gather and release of a parameter ~2.5 ms (its forward waits for each); fused
# AdamW ~1.4 ns a parameter, DeepSpeedCPUAdam ~2 ns, offload's copies host memcpy (~4 GB/s, both cores busy).
CPU = Machine("2-core CPU, gloo (fitted)", 110e9, 0.85, 1.0e9, 1e-3, 50e-6, 2.5e-3, 1.4e-9, 4e9, 2e-9, False)
MACHINES = {"h100": H100, "h200": H200, "a100": A100, "cpu": CPU}


def flops_per_token(args, seq: int) -> float:
    """Transformer.flops_per_token without building the model: 6 x non-embedding parameters + 6 V D
    (the output head) + 12 L D T (attention)."""
    numels = param_numels(args)
    body = sum(numels) - args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return 6 * body + 6 * args.vocab_size * args.dim + 12 * args.n_layers * args.dim * seq


def buckets(numels: list[int], size: float) -> int:
    """Reductions of one backward as DeepSpeed's ZeRO-1/2 fill their reduce bucket: parameters in
    backward order (the model's, reversed), the bucket reduced before a parameter that would overflow
    it, a parameter larger than the bucket alone."""
    count, held = 0, 0
    for n in reversed(numels):
        if held and held + n > size:
            count, held = count + 1, 0
        held += n
    return count + bool(held)


def collectives(sharding: Sharding, args, world: int, accumulation: int) -> int:
    """Collective calls a rank makes per optimizer step (the bytes are comm.py's)."""
    numels = param_numels(args)
    P, n, zero = sum(numels), len(numels), sharding.zero
    if world <= 1:
        return 0
    if sharding.ddp:
        return math.ceil(4 * P / DDP_BUCKET_BYTES)  # autocast: fp32 gradients in 25 MB buckets
    if sharding.fsdp:
        return accumulation * (2 * args.n_layers + 1) + args.n_layers + 1  # gathers; reduce-scatters once
    if sharding.stage == 0:
        return 1  # the flattened gradients, one all-reduce
    reductions = buckets(numels, float(zero.get("reduce_bucket_size", 5e8)))
    reductions *= accumulation if sharding.stage >= 2 else 1
    if sharding.stage in (1, 2):
        return reductions + math.ceil(P / float(zero.get("allgather_bucket_size", 5e8)))
    return reductions + accumulation * n  # ZeRO-3: a gather per parameter and forward (kept for backward)


def comm_split(
    sharding: Sharding, machine: Machine, comm_bytes: float, P: int, dtype: str
) -> tuple[float, float]:
    """(bytes that can move beside backward, bytes the step waits for). DDP's bucket all-reduces run
    beside backward everywhere (gloo's own threads on CPU); ZeRO-1/2's gradient reductions with
    overlap_comm (a GPU's side stream; on a CPU our asynchronous all-reduces, distributed/ds_cpu.py,
    for fp32 gradients); ZeRO-3's and FSDP2's prefetched gathers and reduce-scatters where the device has
    streams. ZeRO-0 reduces after backward, and ZeRO-1/2 all-gather the updated parameters after the
    step, on any device; nothing overlaps under optimizer offload."""
    if sharding.ddp:
        return comm_bytes, 0.0
    streams = machine.streams and not sharding.offload_optimizer
    if sharding.fsdp or sharding.stage == 3:
        return (comm_bytes, 0.0) if streams else (0.0, comm_bytes)
    cpu_overlap = not machine.streams and dtype == "float32" and not sharding.offload_optimizer
    if sharding.stage in (1, 2) and sharding.zero.get("overlap_comm") and (streams or cpu_overlap):
        gathers = P * element_bytes(dtype, ddp=False)["param"]
        return comm_bytes - gathers, gathers
    return 0.0, comm_bytes


def hidden_left(sharding: Sharding, args, beside_s: float, compute_s: float) -> float:
    """Seconds of the collectives beside compute that still show: what does not fit behind the compute
    they run beside (backward for gradient reductions; forward and backward for ZeRO-3's and FSDP2's
    gathers), and at least the last unit's share, which has nothing left to hide behind (a 25 MB bucket
    of DDP's, a ZeRO-2 reduce bucket, one block of ZeRO-3 / FSDP2 at each end)."""
    if not beside_s:
        return 0.0
    P = sum(param_numels(args))
    if sharding.ddp:
        units = max(1, 4 * P / DDP_BUCKET_BYTES)
    elif sharding.fsdp or sharding.stage == 3:
        units = max(1, args.n_layers / 2)  # the first gather and the last reduce-scatter
    else:
        units = max(1, P / float(sharding.zero.get("reduce_bucket_size", 5e8)))
    window = compute_s if sharding.fsdp or sharding.stage == 3 else 2 / 3 * compute_s
    return max(beside_s - window, beside_s / units)


def step_time(sharding: Sharding, work, machine: Machine, comm_bytes: float) -> dict[str, float]:
    """Predicted seconds of one optimizer step on one rank, by term (see the module docstring), and
    `step_s`, their sum. `work`: planner.Workload; `comm_bytes`: what the strategy moves a step."""
    args, world, acc = work.model, work.world_size, work.accumulation_steps
    P, tokens = sum(param_numels(args)), work.batch_size * work.seq_len * acc
    rate = machine.peak_flops * machine.mfu
    per_token = flops_per_token(args, work.seq_len)
    compute = tokens * per_token / rate
    blocks = 1 - 6 * args.vocab_size * args.dim / per_token  # the blocks' share: all but the output head
    recompute = compute * blocks * args.checkpointed_layers / args.n_layers / 3  # their forward again
    beside, after = comm_split(sharding, machine, comm_bytes, P, work.dtype) if world > 1 else (0.0, 0.0)
    exposed = hidden_left(sharding, args, beside / machine.link_bytes_s, compute + recompute)
    exposed += after / machine.link_bytes_s
    deepspeed = not sharding.ddp and not sharding.fsdp  # DDP's and FSDP2's collectives start in C++ / async
    n = acc * len(param_numels(args))
    latency = collectives(sharding, args, world, acc) * machine.latency_s * deepspeed
    latency += n * machine.param_hook_s * (deepspeed and sharding.stage >= 1)
    latency += n * machine.fetch_s * (deepspeed and sharding.stage == 3)
    shard = P / world if sharding.stage >= 1 or sharding.fsdp else P
    offloaded = sharding.offload_optimizer
    optimizer = shard * (machine.host_adam_s if offloaded else machine.adam_s)
    offload = 0.0
    if offloaded:  # fp32 gradient partition out, the updated parameters back
        offload = shard * (4 + ELEMENT_BYTES[work.dtype]) / machine.host_bytes_s
    parts = {
        "compute_s": compute,
        "recompute_s": recompute,
        "comm_s": exposed,
        "latency_s": latency,
        "optimizer_s": optimizer,
        "offload_s": offload,
    }
    return {**parts, "step_s": sum(parts.values())}
