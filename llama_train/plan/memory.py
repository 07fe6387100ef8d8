"""Memory: what a rank holds in model state (params, grads, optimizer state, engine buffers),
measured from its tensors, next to the ZeRO paper's formula; and the process's peak memory."""

import resource
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from llama_train.distributed.strategies import (
    DDP,
    DEEPSPEED,
    FSDP2,
    STATE_KINDS,
    EngineKind,
    Strategy,
    run_strategy,
)
from llama_train.model import ModelArgs, param_numels

# bytes per parameter (param, grad, optimizer state K) -- ZeRO paper, mixed-precision Adam:
# fp16/bf16 params and grads, K = 12 (fp32 master copy + Adam m + v). For fp32 training the
# fp32 params are the master copy: 4 + 4 + 8 (m + v).
STATE_BYTES = {"mixed": (2, 2, 12), "float32": (4, 4, 8)}


def _state_split(stage: int, dtype: str) -> tuple[int, int]:
    """(bytes per parameter every rank holds, bytes per parameter split over the N ranks): stage N
    shards the first N kinds of strategies.STATE_KINDS."""
    p, g, k = STATE_BYTES["float32" if dtype == "float32" else "mixed"]
    size = {"params": p, "grads": g, "optimizer": k}
    sharded = sum(size[kind] for kind in STATE_KINDS[:stage])
    return p + g + k - sharded, sharded


def expected_model_state_bytes(
    stage: int, num_params: int, world: int, dtype: str, other_state: float = 0
) -> float:
    """ZeRO paper, per rank: DDP/ZeRO-0 (2+2+K)P, ZeRO-1 (2+2)P + KP/N, ZeRO-2 2P + (2+K)P/N,
    ZeRO-3 and FSDP2 (2+2+K)P/N (fp32: 4, 4, 8 instead of 2, 2, 12). `stage` 0 for DDP. `other_state`:
    the bytes by which the optimizer's state differs from AdamW's two moments over all parameters
    (its record's state_difference; negative: less), sharded like the rest of the optimizer state from
    ZeRO-1 on."""
    replicated, sharded = _state_split(stage, dtype)
    return num_params * (replicated + sharded / world) + other_state / (1 if stage == 0 else world)


def state_formula(stage: int, dtype: str) -> str:
    """expected_model_state_bytes as the paper writes it: '16Ψ', '8Ψ + 8Ψ/N', '16Ψ/N' (Ψ parameters)."""
    replicated, sharded = _state_split(stage, dtype)
    return " + ".join([f"{replicated}Ψ"] * bool(replicated) + [f"{sharded}Ψ/N"] * bool(sharded))


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU; peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def model_state_bytes(params, optimizer) -> dict[str, int]:
    """This rank's model-state bytes by category: params and grads (`params`: the tensors holding
    them, Engine.held_tensors: ZeRO-3's partitions too), the optimizer's state, and other buffers the
    optimizer (a ZeRO wrapper) holds. Call between backward and the step."""
    inner = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside a ZeRO wrapper
    roots = {
        "params_and_grads": list(params),
        "optimizer_state": [inner.state],
        "engine_buffers": [optimizer],
    }
    return held_tensor_bytes(roots)


def _walk_into(obj) -> bool:
    """Optimizer-side objects whose attributes may hold state tensors (not modules or groups)."""
    module = type(obj).__module__
    return module.startswith(("deepspeed.runtime", "torch.optim")) and not isinstance(obj, torch.nn.Module)


def held_tensor_bytes(named_roots: dict) -> dict[str, int]:
    """Bytes of distinct tensor storages reachable from each group of roots, in order; a storage
    counts once, under the first group that reaches it (params and grads, then optimizer state,
    then whatever else the engine holds: ZeRO flat buffers, fp32 partitions, gradient buckets).
    Buffers that live only in C++ (DDP's gradient buckets) are invisible here."""
    seen_obj, seen_storage, out, shards = set(), set(), {}, []
    for name, roots in named_roots.items():
        total, stack = 0, list(roots)
        while stack:
            obj = stack.pop()
            if id(obj) in seen_obj:
                continue
            seen_obj.add(id(obj))
            if isinstance(obj, torch.Tensor):
                stack.extend(t for t in (obj.grad,) if t is not None)
                if isinstance(obj, DTensor):  # FSDP2's: this rank's shard holds the storage
                    shards.append(obj.to_local())  # kept alive: a freed object's id() could come back
                    stack.append(shards[-1])
                    continue
                storage = obj.untyped_storage()
                key = (storage.data_ptr(), str(obj.device))
                if storage.data_ptr() and key not in seen_storage:
                    seen_storage.add(key)
                    total += storage.nbytes()
            elif isinstance(obj, dict):
                stack.extend(obj.values())
            elif isinstance(obj, list | tuple | set):
                stack.extend(obj)
            elif _walk_into(obj):
                stack.extend(vars(obj).values())
        out[name] = total
    return out


# --- planning: what a rank will hold, before launching (scripts/plan_memory.py, the benchmark) ---

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # model params and grads, by trainer dtype

MASTER_COPY = (
    "an fp32 master copy of the rank's partition (the optimizer's own parameters: DeepSpeed keeps it even "
    "for an fp32 model, where the paper counts the fp32 params as the master)"
)
CPU_GRAD_COPY = (
    "the partition's fp32 gradient in (pinned) CPU memory for the CPU optimizer, beside the engine's"
)
STAGE1_GRADS = (
    "gradients reduced into the rank's partition in backward (the paper's ZeRO-1 keeps all of them)"
)
BF16_OPTIMIZER_GRADS = (
    "DeepSpeed's BF16_Optimizer (ZeRO-1 with bf16 weights and fp32 accumulation, not offloaded): a "
    "full-size fp32 gradient buffer on every rank"
)


def bf16_optimizer(sharding: "Sharding", dtype: str) -> bool:
    """Whether DeepSpeed 0.19.8 runs its BF16_Optimizer rather than ZeRO's (engine._configure_optimizer:
    bf16 model, fp32 gradient accumulation, stage 1, nothing offloaded); ds_config.precision_defaults
    accumulates in fp32 from ZeRO-1 on."""
    return sharding.stage == 1 and dtype == "bfloat16" and not sharding.offload_optimizer


DDP_BUCKETS = (
    "DDP's gradient buckets (C++; a second copy of the gradients in the first step, from the second on the "
    "gradients are views into them: gradient_as_bucket_view)"
)


@dataclass(frozen=True)
class Sharding:
    """What a strategy does with model state: DDP, FSDP2 (sharded as ZeRO-3 shards: `stage` 3), or
    DeepSpeed's ZeRO stage, offloads and buffer sizes (its config's zero_optimization section, "auto"
    values filled). The DDP trainer's come from their strategy records (Sharding.of), DeepSpeed's from
    their configs (Sharding.from_config)."""

    name: str
    ddp: bool = False
    stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    zero: dict = field(default_factory=dict)
    fsdp: bool = False

    @property
    def engine(self) -> EngineKind:
        return DDP if self.ddp else FSDP2 if self.fsdp else DEEPSPEED

    @classmethod
    def of(cls, strategy: Strategy, config: dict | None = None) -> "Sharding":
        """A strategy record's: DeepSpeed's from its `config` (read, buckets filled), the DDP trainer's
        (DDP, FSDP2 with its offload: parameters, gradients and AdamW state on the host) from the record."""
        if strategy.engine is DEEPSPEED:
            return cls.from_config(strategy.name, config)
        off, fsdp = strategy.offload, strategy.engine is FSDP2
        return cls(strategy.name, not fsdp, strategy.stage, off, off, fsdp=fsdp)

    @classmethod
    def from_config(cls, name: str, config: dict) -> "Sharding":
        """A DeepSpeed config's (buckets filled): its stage and offloads as a run resolves them."""
        run = run_strategy(config)
        return cls(
            name, False, run.stage, run.offload, run.offload_params, config.get("zero_optimization", {})
        )


def deepspeed_extras(
    sharding: Sharding, dtype: str, num_params: int, largest: int, world: int
) -> list[tuple[str, float]]:
    """What DeepSpeed 0.19 holds beyond (or instead of) the paper's terms, per rank:
    (why, bytes); `largest`: the largest parameter's elements. DDP holds the paper's 16P (its
    gradient buckets are in `transient_buffers`). Read off its ZeRO optimizers and
    measured (docs/benchmarks.md)."""
    if sharding.ddp or sharding.fsdp:  # FSDP2 holds the paper's 16P/N (fsdp_buffers: what it gathers)
        return []
    P, elem, stage = num_params, ELEMENT_BYTES[dtype], sharding.stage
    shard = P / world
    extras = []
    if stage >= 1 and dtype == "float32":
        extras.append((MASTER_COPY, 4 * shard))
    if stage == 1:
        extras.append((STAGE1_GRADS, -elem * (P - shard)))
    if sharding.offload_optimizer and stage == 3:
        extras.append((CPU_GRAD_COPY, 4 * shard))
    if sharding.offload_optimizer and stage in (1, 2):
        extras.append(
            (f"a copy-back buffer of the updated partition, {elem} B/param (CPU offload)", elem * shard)
        )
        staging = f"two gradient staging buffers for the CPU copy, each the largest parameter ({largest:,})"
        extras.append((staging, 2 * elem * largest))
    if stage == 3:
        bucket = float(sharding.zero.get("reduce_bucket_size", 5e8))  # DeepSpeed's default when absent
        why = f"the gradient reduce bucket, allocated whole: reduce_bucket_size {bucket:.3g} elements x {elem} B"
        extras.append((why, bucket * elem))
    return extras


def activation_bytes(args: ModelArgs, batch: int, seq: int, dtype: str) -> float:
    """Bytes autograd saves for backward in one micro-batch's forward (tests check it against
    autograd's saved tensors, fp32 and bf16). Per token and layer: 2 RMSNorms (the fp32 input, 1/rms,
    the normalised and the scaled output: 4D + 4 + 2 x e x D bytes each, e = bytes per element of the
    model dtype), then in the model dtype q, k, v and the attention output (2D + 2 kv) with its fp32
    log-sum-exp (H), and the SwiGLU's w1 and w3 outputs, silu and product (4F). Head: the final norm
    and the int64 token ids (the embedding's); unchunked (`loss_chunk_tokens` 0) also the fp32
    log-softmax output (V), while the chunked head saves nothing, not even the norm's output (its
    gradients, computed in forward, are in `loss_head_bytes`). With activation checkpointing a checkpointed block
    (every `checkpoint_every`-th) keeps only its input (D); `recompute_bytes` is the block recomputed in backward."""
    e, D, L, k = ELEMENT_BYTES[dtype], args.dim, args.n_layers, args.checkpointed_layers
    head = norm_bytes(D, e) + 8 + (-e * D if args.loss_chunk_tokens else 4 * args.vocab_size)
    body = k * e * D + (L - k) * block_bytes(args, dtype)
    return batch * seq * (body + head)


def norm_bytes(dim: int, e: int) -> int:
    """An RMSNorm's saved tensors per token: its fp32 input, 1/rms, normalised and scaled outputs."""
    return 4 * dim + 4 + 2 * e * dim


def block_bytes(args: ModelArgs, dtype: str) -> float:
    """Bytes a transformer block saves for backward, per token."""
    e, D, kv = ELEMENT_BYTES[dtype], args.dim, args.kv_heads * args.head_dim
    return 2 * norm_bytes(D, e) + e * (2 * D + 2 * kv + 4 * args.ffn_hidden_dim) + 4 * args.n_heads


def recompute_bytes(args: ModelArgs, batch: int, seq: int, dtype: str) -> float:
    """Activation checkpointing: the one block whose activations backward recomputes at a time."""
    return batch * seq * block_bytes(args, dtype) if args.gradient_checkpointing else 0.0


def loss_head_bytes(args: ModelArgs, batch: int, seq: int, dtype: str = "float32") -> float:
    """The loss head at its peak, beyond the saved activations. Chunked (model.ChunkedCrossEntropy):
    the gradients it computes in forward and holds until backward, d h (B x T x D) and d weight (V x D),
    both fp32 (backward casts them to the model dtype: a copy of each below fp32), and one chunk's fp32
    logits with the gradient written over them and a log-sum-exp's worth of temporaries (2 x chunk x V). Unchunked:
    the fp32 logits the trainer holds and the gradients of the log-probabilities and of the logits
    (B x T x V each)."""
    e, D, V, tokens = ELEMENT_BYTES[dtype], args.dim, args.vocab_size, batch * seq
    if not args.loss_chunk_tokens:
        return 3 * 4 * tokens * V
    copies = e * (tokens + V) * D if e != 4 else 0
    return 4 * (tokens + V) * D + copies + 2 * 4 * min(args.loss_chunk_tokens, tokens) * V


def transient_buffers(
    sharding: Sharding, dtype: str, numels: list[int], world: int, zero3_persistent: int, device: str
) -> list[tuple[str, float]]:
    """Buffers a rank holds at its peak beyond model states and activations: (why, bytes).
    `zero3_persistent`: elements of the parameters ZeRO-3 keeps whole (comm.persistent_numel)."""
    P, e = sum(numels), ELEMENT_BYTES[dtype]
    if sharding.ddp:  # autocast keeps fp32 weights, so fp32 gradients and buckets
        return [(DDP_BUCKETS, 4 * P)]
    out = []
    if sharding.stage == 0:
        out.append(
            ("the gradients flattened for ZeRO-0's all-reduce (allreduce_bucket_size: all of them)", e * P)
        )
    if bf16_optimizer(sharding, dtype):  # ZeRO-1, bf16 weights, fp32 accumulation: BF16_Optimizer
        out.append((BF16_OPTIMIZER_GRADS, 4 * P))  # the partition it steps is a view into this buffer
    elif sharding.stage == 1:
        out.append(("full-size gradients until the step reduces them into the partition", e * P))
    if sharding.stage >= 1 and not sharding.offload_optimizer and not bf16_optimizer(sharding, dtype):
        out.append(("the fp32 gradient partition the optimizer step builds", 4 * P / world))
    if sharding.stage in (1, 2) and not bf16_optimizer(sharding, dtype):
        out.append(reduce_buckets(sharding, dtype))
    if sharding.stage == 3:
        live = min(P - zero3_persistent, int(sharding.zero.get("stage3_max_live_parameters", 1e9)))
        out.append(("the parameters ZeRO-3 gathers for forward and keeps through backward", e * live))
    heap = (
        sharding.engine.cpu_heap.get((sharding.stage, sharding.offload_optimizer), 0.0)
        if device == "cpu"
        else 0.0
    )
    if heap:
        out.append(
            (
                f"heap the CPU process keeps after ZeRO's per-step buffers (measured: {heap} x 4P/N)",
                heap * 4 * P / world,
            )
        )
    return out


def reduce_buckets(sharding: Sharding, dtype: str) -> tuple[str, float]:
    """ZeRO-1/2's contiguous reduce bucket, allocated whole for each backward (DeepSpeed 0.19.8
    setup_buckets): reduce_bucket_size elements in the model dtype (fp32 for an offloaded bf16
    ZeRO-1, which stages its fp32 accumulation there), a second one with overlap_comm to fill while
    the first reduces. (why, bytes)."""
    bucket = float(sharding.zero.get("reduce_bucket_size", 5e8))  # DeepSpeed's default when absent
    size = 4 if sharding.stage == 1 and dtype == "bfloat16" else ELEMENT_BYTES[dtype]
    copies = 2 if sharding.zero.get("overlap_comm") else 1
    why = f"the gradient reduce bucket(s): {copies} x reduce_bucket_size {bucket:.3g} elements x {size} B"
    return why, copies * bucket * size


def runtime_bytes(sharding: Sharding, device: str, reserve: float = 0.0) -> float:
    """What the process holds besides the training tensors: measured on CPU (EngineKind.cpu_runtime); on
    GPU, `reserve` (CUDA's context and the caching allocator's slack, which max_memory_allocated does
    not count)."""
    if device == "gpu":
        return reserve
    runtime = sharding.engine.cpu_runtime
    return runtime[min(sharding.stage, len(runtime) - 1)]


# --- FSDP2 (llama_train/fsdp.py): one unit per transformer block, then the root ---

FSDP_ROOT_GATHERED = (
    "FSDP2's root unit (embedding, final norm, output head: {n:,} parameters) gathered from forward to "
    "backward (FSDP2 does not reshard the root after forward)"
)
FSDP_BLOCKS_GATHERED = "the transformer blocks gathered at a time: the one computing and the next, prefetched"
FSDP_ROOT_REDUCED = "the root unit's unsharded gradient and its fp32 copy into the reduce-scatter input, at the end of backward"
FSDP_UNSHARDED_GRADS = (
    "with accumulation, every block's unsharded fp32 gradient, kept from micro-batch to micro-batch until "
    "the last one reduce-scatters them (set_requires_gradient_sync)"
)


def fsdp_units(args: ModelArgs) -> tuple[int, int]:
    """(elements of FSDP2's root unit, elements of one transformer block), as fsdp.wrap_fsdp shards
    the model: a unit per block, the rest (embedding, final norm, output) in the root."""
    numels = param_numels(args)
    block = sum(numels[1:10])  # wq wk wv wo w1 w2 w3, 2 norms
    return sum(numels) - args.n_layers * block, block


def fsdp_buffers(
    args: ModelArgs, dtype: str, world: int, accumulation: int = 1, device: str = "gpu"
) -> list[tuple[str, float]]:
    """What an FSDP2 rank holds at its peak beyond its 16P/N of model state: (why, bytes). Parameters
    are gathered in the model dtype (mixed precision: bf16/fp16), gradients reduced in fp32; on CPU
    the heap the process keeps after the per-unit gathers and reductions (EngineKind.cpu_heap)."""
    e, (root, block) = ELEMENT_BYTES[dtype], fsdp_units(args)
    out = [
        (FSDP_ROOT_GATHERED.format(n=root), e * root),
        (FSDP_BLOCKS_GATHERED, min(2, args.n_layers) * e * block),
        (FSDP_ROOT_REDUCED, (e + 4) * root),
    ]
    if accumulation > 1:
        out.append((FSDP_UNSHARDED_GRADS, 4 * args.n_layers * block))
    if device == "cpu":
        heap = FSDP2.cpu_heap[(3, False)]  # with or without its offload, the same
        P = root + args.n_layers * block
        out.append(
            (
                f"heap the CPU process keeps after FSDP2's gathers and reductions (measured: {heap} x 4P/N)",
                heap * 4 * P / world,
            )
        )
    return out


def offloaded_bytes(sharding: Sharding, num_params: int, world: int, dtype: str) -> float:
    """Model state DeepSpeed moves to host memory: the optimizer state (and fp32 gradient copy) with
    offload_optimizer, the parameter partition too with offload_param."""
    p, _g, k = STATE_BYTES["float32" if dtype == "float32" else "mixed"]
    shard = num_params / world
    if sharding.fsdp:  # CPUOffloadPolicy: the sharded parameters, gradients and AdamW state, all of it
        return expected_model_state_bytes(3, num_params, world, dtype) * sharding.offload_param
    return (k + 4) * shard * sharding.offload_optimizer + p * shard * sharding.offload_param
