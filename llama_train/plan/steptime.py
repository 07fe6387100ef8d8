"""The planner's step-time model: how long one optimizer step of a strategy should take on a machine,
term by term, so that `scripts/plan_memory.py --recommend` ranks what fits by expected speed, not by
bytes alone.

    compute     6N + 6VD + 12 L D T FLOPs a token (the model's count), at the machine's peak x mfu (on a
                CPU whose cores the ranks share, each rank's share of them)
    recompute   activation checkpointing: the checkpointed blocks' forward once more (1/3 of their FLOPs)
    comm        what the strategy sends a step (comm.step_transfers: the bytes on the wire, by phase) over
                the link (bandwidth: the slower of the host's bus and its links to the other hosts, which
                a ring crosses once a host), a network latency per ring step (ds_cpu's broadcasts on a
                CPU: gloo's trees, two at a time, Link.broadcasts); the part the step waits for:
                gradient buckets reduced beside backward as it frees them (bucket_wait), gathers
                prefetched beside compute where the device has streams, the rest after backward
    latency     DeepSpeed's: a fixed cost per collective (the launch and its Python path, which the host
                waits through) and per parameter its hooks handle in Python each micro-step (reduce
                buckets, ZeRO-3's fetch and release); FSDP2's per unit (its copies around each collective,
                0 on a GPU, where they overlap); DDP starts its collectives from C++
    optimizer   the AdamW step over the parameters this rank updates
    offload     the gradient partition to the host and the updated parameters back, and the host's Adam

Every number of a `Machine` is stated with its source; the CPU one is fitted to `make bench` on the
2-core development machine (docs/memory.md says which pair of strategies it orders differently and why),
and `make bench-cluster` calibrates one for the simulated hosts (docs/cluster.md).
"""

import dataclasses
import json
import math
from dataclasses import dataclass

from llama_train.errors import ConfigError
from llama_train.plan.comm import Transfer, ds_cpu_patched, head_in_forward, wire_factor
from llama_train.plan.memory import ELEMENT_BYTES, Sharding, param_numels


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
    backend: str = (
        "nccl"  # whose collective algorithms (comm.wire_factor: gloo reduce-scatters by all-reduce)
    )
    inter_bytes_s: float = 0.0  # between hosts: bytes a host's links carry a second, on the wire; 0: one host
    ranks_per_host: int = 8  # ranks that share a host (its bus, its links)
    hop_s: float = 0.0  # a message's latency across the network: each step of a ring waits it once
    framing: float = 1.0  # bytes on the wire per byte sent (TCP/IP over Ethernet at MTU 1500: 1514/1448)
    cores: int = 0  # CPU: the cores every rank shares (simulated hosts on one machine); 0: a device a rank
    fsdp_unit_s: float = 0.0  # per FSDP2 unit and micro-step: its copies in and out around each collective
    # bytes of its tensor a collective gets through a second at most, by collective, whatever the link:
    # a CPU's copies and reductions around gloo's transfers (make bench-cluster's link probe); none: no limit
    op_bytes_s: tuple[tuple[str, float], ...] = ()


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
CPU = Machine(
    "2-core CPU, gloo (fitted)", 110e9, 0.85, 1.0e9, 1e-3, 50e-6, 2.5e-3, 1.4e-9, 4e9, 2e-9, False, "gloo"
)
MACHINES = {"h100": H100, "h200": H200, "a100": A100, "cpu": CPU}


def read_machine(path: str) -> Machine:
    """A Machine from a JSON file of its fields (make bench-cluster writes one per host count)."""
    try:
        with open(path) as f:
            fields = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--calibration {path}: {e}; give a machine_h<N>.json that make bench-cluster wrote"
        ) from e
    known = {f.name for f in dataclasses.fields(Machine)}
    if unknown := sorted(set(fields) - known):
        raise ConfigError(f"{path}: unknown machine fields {unknown}; known: {sorted(known)}")
    return Machine(**fields)


def flops_per_token(args, seq: int) -> float:
    """Transformer.flops_per_token without building the model: 6 x non-embedding parameters + 6 V D
    (the output head) + 12 L D T (attention)."""
    numels = param_numels(args)
    body = sum(numels) - args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    return 6 * body + 6 * args.vocab_size * args.dim + 12 * args.n_layers * args.dim * seq


def forward_share(args, seq: int) -> float:
    """The share of a step's FLOPs that forward computes: a third of the blocks' and attention's, and
    all of the output head's where the chunked loss head computes its gradients in forward."""
    head = 6 * args.vocab_size * args.dim
    in_forward = head if head_in_forward(args) else head / 3
    return (in_forward + (flops_per_token(args, seq) - head) / 3) / flops_per_token(args, seq)


# collectives a gloo process group runs at once: ProcessGroupGloo's worker threads (torch 2.13's default)
GLOO_THREADS = 2
ETHERNET_TCP = 1514 / 1448  # an Ethernet frame per 1448 bytes of TCP payload (MTU 1500, timestamps on)


def bandwidth(machine: Machine, world: int) -> float:
    """Bytes a second a rank's ring collectives move: within one host its bus (`link_bytes_s`); across
    hosts the slower of that and the host's links to the others less their framing. A ring enters and
    leaves each host once (per channel: every channel shares the host's links), so a host's links carry
    what one rank sends, whatever the ranks per host."""
    hosts = math.ceil(world / max(1, machine.ranks_per_host))
    if hosts <= 1 or not machine.inter_bytes_s:
        return machine.link_bytes_s
    return min(machine.link_bytes_s, machine.inter_bytes_s / machine.framing)


class Link:
    """Seconds the collectives of a step take on `machine`'s link with `world` ranks."""

    def __init__(self, machine: Machine, world: int):
        self.machine, self.world, self.bytes_s = machine, world, bandwidth(machine, world)

    def seconds(self, op: str, size: float, calls: int = 1) -> float:
        """The link's time for `size` bytes of `op`'s tensors in `calls` calls (a latency per ring step
        included) and the host's own work on them (host_seconds)."""
        return self.on_link(op, size, calls) + self.host_seconds(op, size)

    def on_link(self, op: str, size: float, calls: int = 1) -> float:
        """Seconds `size` bytes of `op` spend on the link: its wire bytes at the bandwidth, and a
        message's latency per ring step of each call (broadcasts: broadcasts()). Compute can go on
        meanwhile (gloo's threads wait)."""
        if op == "broadcast":
            return self.broadcasts(size, calls)
        factor = wire_factor(self.machine.backend, op, self.world)
        return size * factor / self.bytes_s + calls * self.steps(op, factor) * self.machine.hop_s

    def broadcasts(self, size: float, calls: int) -> float:
        """Seconds `calls` broadcasts of `size` bytes in all take, each of an equal part from its own
        root, launched together (ds_cpu's gather of ZeRO-1/2's parameters). Each is gloo's binomial tree
        over d = log2 N rounds: its root sends the part to its d children at once, sharing its link,
        and a child forwards it only once it holds all of it, so the longest path crosses d + (d-1) +
        ... + 1 = d(d+1)/2 parts' times on a link. Gloo runs GLOO_THREADS collectives at once (their
        roots' trees use different links: at 4 ranks, the two roots send at once, then a child of each),
        the rest after them. The ranks send the bytes of a ring all-gather (wire_factor) but not all at
        once: at 2 ranks as long as one, at 4 twice (measured, docs/cluster.md)."""
        d = math.ceil(math.log2(max(2, self.world)))
        waves = math.ceil(calls / GLOO_THREADS)
        return waves * (d * (d + 1) / 2 * size / max(1, calls) / self.bytes_s + d * self.machine.hop_s)

    def host_seconds(self, op: str, size: float) -> float:
        """Seconds the host's cores spend on `size` bytes of `op` (a CPU's copies, reductions and TCP
        stack: Machine.op_bytes_s, measured unshaped), which no compute runs beside; 0 on a GPU."""
        return size / dict(self.machine.op_bytes_s).get(op, math.inf)

    def steps(self, op: str, factor: float) -> int:
        """Messages a call waits for in turn: a ring's N-1 steps per (N-1)/N of its tensor sent
        (2(N-1) for an all-reduce)."""
        return round(factor * self.world)

    def transfer(self, t: Transfer) -> float:
        return self.seconds(t.op, t.size, t.calls)


def bucket_wait(link: Link, t: Transfer, backward_s: float, in_flight: int) -> float:
    """Seconds backward ends later for its gradient buckets, each reduced as soon as backward frees it
    and the link is free: the waits in backward when a bucket's buffer is wanted again (`in_flight`:
    buckets that may be under way at once, DeepSpeed's double buffer: 1; 0: no limit, DDP) and the tail
    after the last gradient."""
    stall, link_free, finishes = 0.0, 0.0, []
    for size, ready in t.buckets:
        stall += link.host_seconds(t.op, size)  # the host's own work on the bucket takes the core
        now = ready * backward_s + stall
        link_free = max(now, link_free) + link.on_link(t.op, size)
        finishes.append(link_free)
        if in_flight and len(finishes) > in_flight:
            stall += max(0.0, finishes[-1 - in_flight] - now)
    return max(backward_s + stall, link_free) - backward_s


def overlaps(sharding: Sharding, machine: Machine, dtype: str) -> tuple[bool, bool]:
    """(gradient reductions run beside backward, gathers run beside compute). DDP's bucket all-reduces
    run beside backward everywhere (gloo's own threads on CPU); ZeRO-1/2's with overlap_comm (a GPU's
    side stream; on a CPU our asynchronous all-reduces, distributed/ds_cpu.py, for fp32 gradients);
    ZeRO-3's prefetched gathers everywhere (asynchronous collectives: a GPU's stream, gloo's threads), its
    reduce-scatters where the device has streams; FSDP2's gathers and reduce-scatters where the device has
    streams. Nothing overlaps under optimizer offload."""
    streams = machine.streams and not sharding.offload_optimizer
    if sharding.ddp:
        return True, False
    if sharding.fsdp:
        return streams, streams
    if sharding.stage == 3:  # ZeRO-3 prefetches its gathers asynchronously: gloo's threads run them too
        return streams, not sharding.offload_optimizer
    overlap = sharding.stage in (1, 2) and bool(sharding.zero.get("overlap_comm"))
    return overlap and (streams or ds_cpu_patched(sharding, machine.streams, dtype)), False


def comm_wait(sharding: Sharding, work, machine: Machine, transfers: list, phases: tuple) -> float:
    """Seconds a step waits for its collectives (the module's docstring): `phases` = (forward seconds,
    backward seconds) they may hide behind."""
    link, (forward_s, backward_s) = Link(machine, work.world_size), phases
    reductions, gathers = overlaps(sharding, machine, work.dtype)
    units = max(1, work.model.n_layers / 2)  # a prefetched gather's first and last unit show
    in_flight = 0 if sharding.ddp else 1
    out = 0.0
    for t in transfers:
        seconds = link.transfer(t)
        if t.phase == "after" or not (reductions if t.buckets else gathers):
            out += seconds
        elif t.buckets and not (sharding.fsdp or sharding.stage == 3):
            out += bucket_wait(link, t, backward_s, in_flight)
        else:  # beside compute on a stream: what does not fit behind it, and at least a unit's share
            window = forward_s if t.phase == "forward" else backward_s
            out += max(seconds - window, seconds / units)
    return out


def collectives(sharding: Sharding, transfers: list) -> int:
    """Collective calls a rank makes per optimizer step through DeepSpeed's Python path (the bytes
    are comm.py's)."""
    return 0 if sharding.ddp or sharding.fsdp else sum(t.calls for t in transfers)


def step_time(sharding: Sharding, work, machine: Machine, transfers: list) -> dict[str, float]:
    """Predicted seconds of one optimizer step on one rank, by term (see the module docstring), and
    `step_s`, their sum. `work`: planner.Workload; `transfers`: comm.step_transfers."""
    args, world, acc = work.model, work.world_size, work.accumulation_steps
    P, tokens = sum(param_numels(args)), work.batch_size * work.seq_len * acc
    share = min(1.0, machine.cores / world) if machine.cores else 1.0  # simulated hosts share the cores
    rate = machine.peak_flops * machine.mfu * share
    per_token = flops_per_token(args, work.seq_len)
    compute = tokens * per_token / rate
    blocks = 1 - 6 * args.vocab_size * args.dim / per_token  # the blocks' share: all but the output head
    recompute = compute * blocks * args.checkpointed_layers / args.n_layers / 3  # their forward again
    phases = (
        compute * forward_share(args, work.seq_len),
        compute * (1 - forward_share(args, work.seq_len)) + recompute,
    )
    exposed = comm_wait(sharding, work, machine, transfers, phases) if world > 1 else 0.0
    deepspeed = not sharding.ddp and not sharding.fsdp  # DDP's and FSDP2's collectives start in C++ / async
    n = acc * len(param_numels(args))
    latency = collectives(sharding, transfers) * machine.latency_s
    latency += n * machine.param_hook_s * (deepspeed and sharding.stage >= 1)
    latency += n * machine.fetch_s * (deepspeed and sharding.stage == 3)
    latency += acc * (args.n_layers + 1) * machine.fsdp_unit_s * sharding.fsdp
    latency /= share  # the host's Python, on the share of a core this rank gets
    shard = P / world if sharding.stage >= 1 or sharding.fsdp else P
    offloaded = sharding.offload_optimizer
    optimizer = shard * (machine.host_adam_s if offloaded else machine.adam_s) / share
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
