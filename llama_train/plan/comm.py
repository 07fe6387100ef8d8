"""Communication per optimizer step, counted the same way for DDP and DeepSpeed, twice: as the ZeRO
paper counts it (the payload) and as it goes on the wire (what each rank sends).

The payload (`bytes_by_op` in a `comm` record) is counted as the ZeRO paper counts (Rajbhandari et
al. 2020, section 7): the elements entering each collective times their bytes per element, an
all-reduce counting twice its size (a reduce-scatter plus an all-gather), an all-gather the size of the
gathered tensor, a reduce-scatter or reduce the size of the tensor reduced.

The wire figure (`wire_bytes_by_op`) is what a rank's network interface sends for the same
collectives, by the algorithm the backend runs (wire_factor): a ring all-reduce of S bytes over N ranks
sends 2S(N-1)/N a rank, an all-gather or reduce-scatter S(N-1)/N; gloo (torch 2.13) reduce-scatters by
an all-reduce, 2S(N-1)/N. Checked against the kernel's count of each simulated host's interface
(scripts/multinode_sim.sh; the probe records it beside, `link_tx_bytes`: telemetry/timing.py).

DDP: a comm hook around torch's default all-reduce hook sees every gradient bucket. FSDP2: every
FSDP unit's all-gather and reduce-scatter, through its custom-collective hooks (fsdp.count_fsdp). DeepSpeed: every
ZeRO collective goes through `deepspeed.comm`, whose backend object (`deepspeed.comm.comm.cdb`) we
wrap, so whatever path DeepSpeed takes (gloo, NCCL, its shared-memory all-reduce) is counted as it
runs. The trainers' own small collectives (the logged loss, the stop flag) use torch.distributed
directly and are counted in neither.
"""

import math
from dataclasses import dataclass

import torch

from llama_train.distributed.strategies import PAPER_VOLUME, kind_of
from llama_train.model import ModelArgs
from llama_train.optim.adamw import ADAMW
from llama_train.optim.spec import OptimizerSpec
from llama_train.plan.memory import Sharding, fsdp_units, param_numels

# deepspeed.comm backend method -> (collective, the argument whose elements count and the group: their
# positions and names in torch.distributed's signature, which the backend follows, the paper's multiplier)
DEEPSPEED_METHODS = {
    "all_reduce": ("all_reduce", (0, "tensor"), (2, "group"), 2),
    "inference_all_reduce": ("all_reduce", (0, "tensor"), (2, "group"), 2),
    "all_reduce_coalesced": ("all_reduce", (0, "tensors"), (2, "group"), 2),
    "reduce": ("reduce", (0, "tensor"), (3, "group"), 1),
    "reduce_scatter": ("reduce_scatter", (1, "input_list"), (3, "group"), 1),
    "reduce_scatter_tensor": ("reduce_scatter", (1, "input_tensor"), (3, "group"), 1),
    "all_gather": ("all_gather", (0, "tensor_list"), (2, "group"), 1),
    "all_gather_into_tensor": ("all_gather", (0, "output_tensor"), (2, "group"), 1),
    "all_gather_base": ("all_gather", (0, "output_tensor"), (2, "group"), 1),
    "all_gather_coalesced": ("all_gather", (0, "output_tensors"), (2, "group"), 1),
    "broadcast": ("broadcast", (0, "tensor"), (2, "group"), 1),
    "all_to_all_single": ("all_to_all", (1, "input"), (4, "group"), 1),
    "all_to_all": ("all_to_all", (1, "input_tensor_list"), (2, "group"), 1),
    "send": ("p2p", (0, "tensor"), (2, "group"), 1),
    "recv": ("p2p", (0, "tensor"), (2, "group"), 1),
    "isend": ("p2p", (0, "tensor"), (2, "group"), 1),
    "irecv": ("p2p", (0, "tensor"), (2, "group"), 1),
}
RECEIVES = ("recv", "irecv")  # point-to-point: the sender's interface carries the bytes


def wire_factor(backend: str, op: str, world: int) -> float:
    """Bytes a rank sends per byte of one collective's tensor (the reduced one; the gathered one), at
    `world` ranks, by the algorithm `backend` runs, measured on gloo with the kernel's counters (two and
    four simulated hosts, torch 2.13: every figure within 0.5%): a ring all-reduce 2(N-1)/N, an
    all-gather (N-1)/N; a reduce-scatter (N-1)/N, on gloo 2(N-1)/N (gloo reduces the whole tensor, an
    all-reduce, and keeps its slice). A broadcast sends (N-1)/N a rank on average over its roots (gloo:
    a binomial tree, whose root sends the tensor log2(N) times: even only when every rank broadcasts in
    turn, as ds_cpu's gather does); a reduce, an all-to-all (N-1)/N; one rank sends nothing."""
    if world <= 1:
        return 0.0
    ring = (world - 1) / world
    if op == "all_reduce" or (op == "reduce_scatter" and backend == "gloo"):
        return 2 * ring
    return 1.0 if op == "p2p" else ring


def tensor_bytes(value) -> int:
    """Bytes of a tensor, or of the tensors in a list."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(tensor_bytes(v) for v in value or ())


class CommCounter:
    """Bytes (the paper's count and the wire's) and calls by collective while `active` (the trainers'
    measured steps). `timer`, when set (timing.StepTimer), is told when the host blocks in a collective."""

    def __init__(self, backend: str):
        self.backend, self.active, self.timer = backend, False, None
        self.bytes, self.wire, self.calls = {}, {}, {}

    def add(self, op: str, nbytes: int, wire: float):
        """One collective: `nbytes` as the paper counts it, `wire` bytes this rank sends for it."""
        if self.active:
            self.bytes[op] = self.bytes.get(op, 0) + nbytes
            self.wire[op] = self.wire.get(op, 0) + round(wire)
            self.calls[op] = self.calls.get(op, 0) + 1

    def add_collective(self, op: str, size: int, world: int, paper: int = 1, sends: bool = True):
        """One collective over a tensor of `size` bytes among `world` ranks (wire_factor)."""
        self.add(op, paper * size, size * wire_factor(self.backend, op, world) if sends else 0)

    def take(self) -> tuple[dict, dict, dict]:
        """(paper bytes, wire bytes, calls), each by collective, since the last take."""
        out = (self.bytes, self.wire, self.calls)
        self.bytes, self.wire, self.calls = {}, {}, {}
        return out


def count_ddp(model, counter: CommCounter):
    """Count DDP's gradient buckets: a comm hook that is torch's default all-reduce hook (the same
    division and all-reduce, so the results do not change) plus the count. The all-reduce is
    launched asynchronously and overlaps backward; DDP waits for it at the end of backward."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    world = model.process_group.size() if model.process_group is not None else 1

    def counted_allreduce(state, bucket):
        if counter.active:  # log steps only
            counter.add_collective("all_reduce", tensor_bytes(bucket.buffer()), world, paper=2)
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counted_allreduce)


class _TimedWork:
    """An async collective's handle whose wait() counts as blocking communication."""

    def __init__(self, work, timer):
        self._work, self._timer = work, timer

    def wait(self, *args, **kwargs):
        with self._timer.phase("comm_wait"):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def argument(args: tuple, kwargs: dict, where: tuple[int, str]):
    """A call's argument by its position or its name (None when it is given neither way)."""
    position, name = where
    return args[position] if len(args) > position else kwargs.get(name)


def _counted(method, name: str, counter: CommCounter):
    # (DeepSpeed's backend methods are wrapped without functools.wraps: their signature is lost)
    op, counted_arg, group_arg, factor = DEEPSPEED_METHODS[name]

    def counted(*args, **kwargs):
        if not counter.active:
            return method(*args, **kwargs)
        world = torch.distributed.get_world_size(argument(args, kwargs, group_arg))
        size = tensor_bytes(argument(args, kwargs, counted_arg))
        counter.add_collective(op, size, world, factor, name not in RECEIVES)
        timer = counter.timer
        if timer is None:
            return method(*args, **kwargs)
        with timer.phase("comm_wait"):  # the host blocks here (gloo; or a stream sync on GPU)
            work = method(*args, **kwargs)
        return _TimedWork(work, timer) if work is not None and hasattr(work, "wait") else work

    return counted


def count_deepspeed(counter: CommCounter):
    """Wrap deepspeed.comm's backend: every collective DeepSpeed runs passes through it, whichever
    function of deepspeed.comm called it (allgather_fn, reduce_scatter_fn, ...)."""
    from deepspeed.comm import comm as ds_comm

    backend = ds_comm.cdb
    for name in DEEPSPEED_METHODS:
        method = getattr(backend, name, None)
        if method is not None and not hasattr(method, "_llama_train_counted"):
            wrapped = _counted(method, name, counter)
            wrapped._llama_train_counted = True
            setattr(backend, name, wrapped)


def install_counter(engine) -> CommCounter:
    """A counter for this engine's collectives (Engine.count_comm: DDP's buckets, FSDP2's all-gathers
    and reduce-scatters, or DeepSpeed's comm)."""
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    counter = CommCounter(backend)
    engine.count_comm(counter)
    return counter


# --- the ZeRO paper's figure (its volume per stage: strategies.PAPER_VOLUME) ---


def element_bytes(dtype: str, ddp: bool) -> dict[str, int]:
    """Bytes per communicated element: gradients travel in fp32 under DDP's autocast (fp32 weights)
    and under our bf16 DeepSpeed configs (communication_data_type fp32), in fp16 under fp16 ZeRO;
    parameters travel in the model dtype."""
    half = dtype in ("bfloat16", "float16")
    grad = 2 if dtype == "float16" and not ddp else 4
    return {"grad": grad, "param": 2 if half and not ddp else 4}


def expected_comm_bytes(stage: int, num_params: int, world: int, dtype: str, ddp: bool) -> dict[str, float]:
    """The ZeRO paper's bytes per rank per optimizer step by collective (DDP, ZeRO-1, ZeRO-2: 2 Psi;
    ZeRO-3: 3 Psi; Psi = parameters x bytes per element), for one micro-batch per step. One rank
    communicates nothing."""
    if world <= 1:
        return {}
    size = element_bytes(dtype, ddp)
    return {op: k * num_params * size[what] for op, (k, what) in PAPER_VOLUME[stage].items()}


def expected_run_comm_bytes(stage: int, record: dict) -> dict[str, float]:
    """expected_comm_bytes for a run's `config` record (metrics.jsonl): with tensor or pipeline
    parallelism a rank holds about 1/(tp x pp) of the parameters (an even split is assumed) and
    exchanges their gradients with its data-parallel peers alone (x sp: Ulysses reduces over sequence
    and data ranks together), so dp = 1 expects nothing where the paper's 2 Psi assumed every rank."""
    layout = record.get("layout") or {}
    split = layout.get("tp", 1) * layout.get("pp", 1)
    ranks = record["world_size"] // split
    engine = kind_of(record["strategy"])
    fp32 = bool(engine and engine.fp32_comm)  # DDP's autocast
    return expected_comm_bytes(stage, record["num_params"] // split, ranks, record["dtype"], fp32)


# --- what DeepSpeed 0.19 really moves: the paper's figure, corrected by what we measured ---

ALLREDUCE_GRADS = (
    "DeepSpeed's ZeRO-1/2 reduce each gradient bucket with an all-reduce where the paper reduce-scatters "
    "(use_multi_rank_bucket_allreduce, on by default; false reduces each slice to its owner rank: the "
    "paper's volume)"
)
KEPT_GATHERED = (
    "ZeRO-3 keeps the gathered parameters from forward to backward (the model is under "
    "stage3_max_live_parameters / stage3_max_reuse_distance): no second all-gather in backward"
)
PERSISTENT = (
    "ZeRO-3 keeps parameters under stage3_param_persistence_threshold whole: not gathered in forward and "
    "backward, but all-gathered once after each step"
)


def persistent_numel(numels: list[int], zero: dict) -> int:
    """Elements of the parameters ZeRO-3 keeps whole (fewer elements than the threshold)."""
    threshold = int(zero.get("stage3_param_persistence_threshold", 1e5))  # DeepSpeed's default
    return sum(n for n in numels if n < threshold)


EVERY_MICRO_BATCH = (
    "{stage} communicates for every micro-batch ({acc} per step), the paper's figure is for one"
)


def deepspeed_comm_extras(
    sharding, numels: list[int], world: int, dtype: str, accumulation: int = 1
) -> list[tuple[str, float]]:
    """(why, bytes) by which DeepSpeed 0.19's collectives per optimizer step differ from the paper's
    figure, for a memory.Sharding, as measured (docs/memory.md: 'What ZeRO costs, read together'); [] for DDP
    and ZeRO-0 (the paper's 2 Psi to the byte, at any accumulation: one reduction per step) and for
    one rank. The few bytes of gradient-norm all-reduces are left out."""
    if world <= 1 or sharding.ddp or sharding.fsdp or sharding.stage == 0:
        return []
    size, P, zero, acc = element_bytes(dtype, ddp=False), sum(numels), sharding.zero, accumulation
    grads = P * size["grad"]
    every = EVERY_MICRO_BATCH.format(stage=f"ZeRO-{sharding.stage}", acc=acc)
    allreduce = zero.get("use_multi_rank_bucket_allreduce", True)
    if sharding.stage in (1, 2):  # ZeRO-1 reduces at the accumulation boundary only, ZeRO-2 every micro-batch
        times = acc if sharding.stage == 2 else 1
        extras = [(ALLREDUCE_GRADS, times * grads)] if allreduce else []
        return extras + ([(every, (acc - 1) * grads)] if sharding.stage == 2 and acc > 1 else [])
    persistent = persistent_numel(numels, zero)
    window = min(
        int(zero.get("stage3_max_live_parameters", 1e9)), int(zero.get("stage3_max_reuse_distance", 1e9))
    )
    kept = P - persistent <= window
    extras = [(PERSISTENT, -persistent * size["param"])] if persistent else []
    if kept:
        extras.append((KEPT_GATHERED, -(P - persistent) * size["param"]))
    if acc > 1:
        gathers = (1 if kept else 2) * (P - persistent) * size["param"]
        extras.append((every, (acc - 1) * (gathers + grads)))
    return extras


# --- what FSDP2 (torch 2.13's fully_shard, one unit per block then the root) really moves ---

FSDP_ROOT_KEPT = (
    "FSDP2 keeps its root unit ({n:,} parameters: embedding, final norm, output) gathered from forward to "
    "backward: no second all-gather for it"
)
FSDP_EVERY_MICRO_BATCH = (
    "FSDP2 all-gathers for every micro-batch ({acc} per step), the paper's figure is for one; it "
    "reduce-scatters once a step (set_requires_gradient_sync on the last micro-batch only)"
)


def fsdp_comm_extras(
    args: ModelArgs, world: int, dtype: str, accumulation: int = 1
) -> list[tuple[str, float]]:
    """(why, bytes) by which FSDP2's collectives per optimizer step differ from the paper's 3 Psi, as
    measured (docs/fsdp.md); [] for one rank."""
    if world <= 1:
        return []
    param, (root, _) = element_bytes(dtype, ddp=False)["param"], fsdp_units(args)
    extras = [(FSDP_ROOT_KEPT.format(n=root), -root * param)]
    if accumulation > 1:
        gathered = 2 * sum(param_numels(args)) - root
        extras.append(
            (FSDP_EVERY_MICRO_BATCH.format(acc=accumulation), (accumulation - 1) * gathered * param)
        )
    return extras


def comm_extras(
    sharding: Sharding,
    args: ModelArgs,
    world: int,
    dtype: str,
    accumulation: int = 1,
    optimizer: OptimizerSpec = ADAMW,
):
    """What a strategy moves beyond (or short of) the paper's figure, cause by cause: FSDP2's
    (fsdp_comm_extras) or DeepSpeed's (deepspeed_comm_extras, and the optimizer record's
    comm_extras); [] for DDP."""
    if sharding.fsdp:
        return fsdp_comm_extras(args, world, dtype, accumulation)
    ds = deepspeed_comm_extras(sharding, param_numels(args), world, dtype, accumulation)
    grad = element_bytes(dtype, ddp=False)["grad"]
    bucket = float(sharding.zero.get("reduce_bucket_size", 5e8))  # DeepSpeed's default where none is set
    return ds + optimizer.comm_extras(sharding.stage, world, grad, args, bucket)


# --- what a strategy sends, when: the step-time model's input (plan/steptime.py) ---


@dataclass(frozen=True)
class Transfer:
    """Collectives of one kind a rank runs each optimizer step: when (`phase`: "forward", "backward",
    or "after" backward), which (`op`), over how many bytes in all (`size`: the tensors reduced or
    gathered, as CommCounter counts them) and in how many `calls`; `buckets`, for the gradient
    reductions of backward, each call's bytes and how far backward is when it can start (its share of
    backward's matmul work done: ready_fractions)."""

    phase: str
    op: str
    size: float
    calls: int
    buckets: tuple[tuple[float, float], ...] = ()

    def wire(self, backend: str, world: int) -> float:
        """Bytes a rank sends for these collectives (wire_factor)."""
        return self.size * wire_factor(backend, self.op, world)

    def paper(self) -> float:
        """Their bytes as the ZeRO paper counts (an all-reduce twice its size)."""
        return self.size * (2 if self.op == "all_reduce" else 1)


def ready_fractions(numels: list[int], head_in_forward: bool = False) -> list[float]:
    """For each parameter in backward order (the model's, reversed), the share of backward's matmul
    work done when its gradient is ready: a matrix's backward costs 4 FLOPs per element and token, the
    input embedding's (a scatter) and a norm's next to nothing. `head_in_forward`: the chunked loss
    head (model.ChunkedCrossEntropy) computed the output weight's gradient in forward, so it is ready
    as backward starts. Attention's own FLOPs are left out."""
    small = min(numels)  # a norm's
    work = [n if n > small else 0 for n in reversed(numels)]
    work[-1] = 0  # the input embedding, last in backward
    if head_in_forward:
        work[0] = 0
    total, done, out = sum(work), 0, []
    for w in work:
        done += w
        out.append(done / total)
    return out


def head_in_forward(args: ModelArgs) -> bool:
    """Whether the output weight's gradient is computed in forward (an untied, chunked loss head)."""
    return args.loss_chunk_tokens > 0 and not args.tie_embeddings


def fill_buckets(numels: list[int], size: float, close_after: bool = False) -> list[int]:
    """Elements of each bucket of gradients in backward order (the parameters' order, reversed).
    DeepSpeed (ZeRO-1/2, ZeRO-3's reduce-scatter) reduces a bucket before a parameter that would
    overflow it; DDP (`close_after`) closes a bucket once it reaches the cap, the parameter that got it
    there included. A parameter larger than the cap is a bucket of its own either way."""
    out, held = [], 0
    for n in reversed(numels):
        if held and held + n > size and not close_after:
            out, held = [*out, held], 0
        held += n
        if close_after and held >= size:
            out, held = [*out, held], 0
    return out + ([held] if held else [])


def timed_buckets(
    numels: list[int], cuts: list[int], element: int, head_first: bool = False
) -> tuple[tuple[float, float], ...]:
    """(bytes, ready fraction) of each bucket: it is ready with its last parameter's gradient."""
    ready, out, k, held = ready_fractions(numels, head_first), [], 0, 0
    for i, n in enumerate(reversed(numels)):
        held += n
        if held >= cuts[k]:
            out.append((element * cuts[k], ready[i]))
            k, held = k + 1, 0
    return tuple(out)


def ddp_buckets(numels: list[int], element: int) -> list[int]:
    """DDP's gradient buckets in backward order, in elements: 1 MiB first, then 25 MiB
    (torch's _DEFAULT_FIRST_BUCKET_BYTES and bucket_cap_mb), each closed once it reaches its cap."""
    first = fill_buckets(numels, 2**20 / element, close_after=True)[0]
    kept, rest = 0, list(numels)
    while kept < first:
        kept += rest.pop()
    return [first, *fill_buckets(rest, DDP_BUCKET_BYTES / element, close_after=True)]


DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default


def ds_cpu_patched(sharding: Sharding, streams: bool, dtype: str) -> bool:
    """Whether distributed/ds_cpu.py's patches run for `sharding` on a device without `streams` (a CPU,
    gloo): ZeRO-1/2 with overlap_comm, fp32 gradients communicated as they are, no offload. Then the
    gradient buckets are all-reduced beside backward and the updated parameters gathered by one
    broadcast from each partition's owner instead of DeepSpeed's all-gather."""
    zero12 = not (sharding.ddp or sharding.fsdp) and sharding.stage in (1, 2)
    return (
        zero12 and not streams and bool(sharding.zero.get("overlap_comm"))
        and dtype == "float32" and not sharding.offload_optimizer
    )  # fmt: skip


def step_transfers(
    sharding: Sharding, args: ModelArgs, world: int, dtype: str, accumulation: int = 1,
    optimizer: OptimizerSpec = ADAMW, streams: bool = True,
) -> list[Transfer]:  # fmt: skip
    """What each strategy runs a step, as DeepSpeed 0.19.8 and torch 2.13 run it on a device with
    `streams` (a GPU) or without (a CPU, where ds_cpu_patched's ZeRO-1/2 gather by broadcasts). The
    causes are comm_extras'; counted as the paper counts, their sum is the paper's figure plus
    comm_extras': a test holds the two together. [] for one rank."""
    if world <= 1:
        return []
    numels, size = param_numels(args), element_bytes(dtype, sharding.ddp)
    P, grad, param, acc = sum(numels), size["grad"], size["param"], accumulation
    if sharding.ddp:
        cuts = ddp_buckets(numels, grad)
        buckets = timed_buckets(numels, cuts, grad, head_in_forward(args))
        return [Transfer("backward", "all_reduce", grad * P, len(cuts), buckets)]
    if sharding.fsdp:
        return fsdp_transfers(args, grad, param, acc)
    zero = sharding.zero
    if sharding.stage == 0:
        return [Transfer("after", "all_reduce", grad * P, 1)]
    if sharding.stage == 3:
        return zero3_transfers(sharding, args, grad, param, acc) + optimizer_transfers(
            optimizer, args, world, grad, zero
        )
    cuts = fill_buckets(numels, float(zero.get("reduce_bucket_size", 5e8)))
    times = acc if sharding.stage == 2 else 1  # ZeRO-1 reduces at the accumulation boundary only
    reduce = "all_reduce" if zero.get("use_multi_rank_bucket_allreduce", True) else "reduce_scatter"
    gathers = math.ceil(P / float(zero.get("allgather_bucket_size", 5e8)))
    buckets = timed_buckets(numels, cuts, grad, head_in_forward(args))
    if ds_cpu_patched(sharding, streams, dtype):  # one broadcast of each rank's partition
        gather = Transfer("after", "broadcast", param * P, world)
    else:
        gather = Transfer("after", "all_gather", param * P, gathers)
    return [Transfer("backward", reduce, times * grad * P, times * len(cuts), buckets), gather]


def zero3_transfers(sharding: Sharding, args: ModelArgs, grad: int, param: int, acc: int) -> list[Transfer]:
    """ZeRO-3's: a gather per parameter in forward (and again in backward unless they are kept,
    KEPT_GATHERED), the gradients reduce-scattered in buckets, the parameters it keeps whole gathered
    once after the step (PERSISTENT)."""
    numels = param_numels(args)
    zero, P = sharding.zero, sum(numels)
    threshold = int(zero.get("stage3_param_persistence_threshold", 1e5))
    persistent, kept_whole = persistent_numel(numels, zero), len([n for n in numels if n < threshold])
    fetched = len(numels) - kept_whole
    window = min(
        int(zero.get("stage3_max_live_parameters", 1e9)), int(zero.get("stage3_max_reuse_distance", 1e9))
    )
    cuts = fill_buckets(numels, float(zero.get("reduce_bucket_size", 5e8)))
    gathered = acc * param * (P - persistent)
    out = [
        Transfer("forward", "all_gather", gathered, acc * fetched),
        Transfer(
            "backward",
            "reduce_scatter",
            acc * grad * P,
            acc * len(cuts),
            timed_buckets(numels, cuts, grad, head_in_forward(args)),
        ),
    ]
    if P - persistent > window:  # released after forward: gathered again in backward
        out.append(Transfer("backward", "all_gather", gathered, acc * fetched))
    if persistent:
        out.append(Transfer("after", "all_gather", param * persistent, kept_whole))  # one call each
    return out


def optimizer_transfers(optimizer: OptimizerSpec, args: ModelArgs, world: int, grad: int, zero: dict) -> list:
    """What the optimizer adds under ZeRO-3 (its record's comm_extras), after backward."""
    bucket = float(zero.get("reduce_bucket_size", 5e8))
    extra = sum(b for _, b in optimizer.comm_extras(3, world, grad, args, bucket))
    return [Transfer("after", "all_gather", extra, 1)] if extra else []


def fsdp_transfers(args: ModelArgs, grad: int, param: int, acc: int) -> list[Transfer]:
    """FSDP2's: every unit gathered in forward, again in backward but the root (FSDP_ROOT_KEPT), for
    each micro-batch; the gradients reduce-scattered unit by unit once a step, the blocks' from the last
    as backward finishes each, the root's last."""
    (root, block), L = fsdp_units(args), args.n_layers
    P = root + L * block
    ready = ready_fractions(param_numels(args), head_in_forward(args))
    per_block = len(ready[2:-1]) // L  # backward order: output, final norm, the blocks, the embedding
    units = [(grad * block, ready[2 + (k + 1) * per_block - 1]) for k in range(L)] + [(grad * root, 1.0)]
    return [
        Transfer("forward", "all_gather", acc * param * P, acc * (L + 1)),
        Transfer("backward", "all_gather", acc * param * (P - root), acc * L),
        Transfer("backward", "reduce_scatter", grad * P, L + 1, tuple(units)),
    ]
