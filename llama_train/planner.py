"""Before launching: the per-rank memory of every strategy for a model, batch and world size, which
strategies fit a device, and the one that fits with the least communication (scripts/plan_memory.py;
the benchmark's "planned" column). The formulas are memory.py's and comm.py's.

A rank's peak = model states (the ZeRO paper's formula plus what DeepSpeed really holds) + buffers
that live through backward (DDP's gradient buckets, ZeRO-0's flattened gradients, the full-size
gradients ZeRO-1 reduces at the step) + activations of one micro-batch (with the block recomputed
under activation checkpointing) + the loss's logits and their gradients + the runtime: on CPU the
process's resident Python/torch/DeepSpeed runtime and data pipeline, measured (see RUNTIME_BYTES); on
GPU CUDA's max_memory_allocated has no runtime, and `--reserve_gib` stands for the CUDA context.
"""

from dataclasses import dataclass

from llama_train.bench.matrix import DEFAULT_STRATEGIES, ROOT, STRATEGIES
from llama_train.comm import deepspeed_comm_extras, expected_comm_bytes
from llama_train.ds_config import fill_buckets, load_ds_config
from llama_train.memory import (
    ELEMENT_BYTES,
    STATE_BYTES,
    Layout,
    activation_bytes,
    deepspeed_extras,
    expected_model_state_bytes,
    loss_head_bytes,
    param_numels,
    recompute_bytes,
)
from llama_train.model import ModelArgs

MiB = 2**20
# Peak RSS of a 2-rank fp32 CPU run of an (almost) empty model (preset debug with --dim 8 --n_heads 2
# --n_layers 1: 8.6k parameters), per rank: Python, torch, transformers, the tokenizer and data
# pipeline, gloo; DeepSpeed adds its own imports and buffers, ZeRO-1..3 more (their optimizers'
# imports). Measured on the 2-core development machine (README: 'What ZeRO costs, read together').
RUNTIME_BYTES = {"ddp": 364 * MiB, "zero0": 386 * MiB, "zero": 430 * MiB}


@dataclass
class Workload:
    """What is planned for: the model, ranks, micro batch, sequence length, precision, device."""

    model: ModelArgs
    world_size: int
    batch_size: int
    seq_len: int
    dtype: str = "bfloat16"
    accumulation_steps: int = 1
    device: str = "gpu"  # gpu: CUDA max allocated per rank; cpu: the process's peak RSS


def layouts(names: list[str] | None = None, dim: int | None = None) -> list[Layout]:
    """The benchmark's strategies (default: all seven) with their DeepSpeed configs read and their
    "auto" bucket sizes filled for hidden size `dim`, as the trainer fills them."""
    out = []
    for name in names or DEFAULT_STRATEGIES:
        path = STRATEGIES[name]
        config = fill_buckets(load_ds_config(str(ROOT / path)), dim) if path else None
        out.append(Layout.from_config(name, config))
    return out


def buffer_bytes(layout: Layout, numels: list[int], dtype: str) -> float:
    """Gradient-sized buffers that live through backward on top of the model states: DDP's buckets
    are in deepspeed_extras; ZeRO-0 flattens all gradients for its all-reduce, ZeRO-1 holds the
    full-size gradients until the step reduces them into the partition."""
    if layout.ddp or layout.stage not in (0, 1):
        return 0.0
    return ELEMENT_BYTES[dtype] * sum(numels)


def runtime_bytes(layout: Layout, device: str, reserve: float = 0.0) -> float:
    if device == "gpu":
        return reserve
    return RUNTIME_BYTES["ddp" if layout.ddp else "zero0" if layout.stage == 0 else "zero"]


def offloaded_bytes(layout: Layout, num_params: int, world: int, dtype: str) -> float:
    """Model state DeepSpeed moves to host memory: the optimizer state (and fp32 gradient copy) with
    offload_optimizer, the parameter partition too with offload_param."""
    p, g, k = STATE_BYTES["float32" if dtype == "float32" else "mixed"]
    shard = num_params / world
    return (k + 4) * shard * layout.offload_optimizer + p * shard * layout.offload_param


def plan_rank(layout: Layout, work: Workload, reserve: float = 0.0) -> dict:
    """One strategy's predicted peak bytes per rank, by part, and its communication per step."""
    args, world, dtype = work.model, work.world_size, work.dtype
    numels = param_numels(args)
    P = sum(numels)
    extras = deepspeed_extras(layout, dtype, P, max(numels), world)
    states = expected_model_state_bytes(layout.stage, P, world, dtype) + sum(b for _, b in extras)
    host = offloaded_bytes(layout, P, world, dtype) if work.device == "gpu" else 0.0
    acts = activation_bytes(args, work.batch_size, work.seq_len, dtype)
    acts += recompute_bytes(args, work.batch_size, work.seq_len, dtype)
    acts += loss_head_bytes(args, work.batch_size, work.seq_len)
    buffers = buffer_bytes(layout, numels, dtype)
    runtime = runtime_bytes(layout, work.device, reserve)
    paper = sum(expected_comm_bytes(layout.stage, P, world, dtype, layout.ddp).values())
    ds_extra = sum(b for _, b in deepspeed_comm_extras(layout, numels, world, dtype, work.accumulation_steps))
    return {
        "strategy": layout.name,
        "zero_stage": layout.stage,
        "model_state_bytes": states - host,
        "host_bytes": host,
        "buffer_bytes": buffers,
        "activation_bytes": acts,
        "runtime_bytes": runtime,
        "total_bytes": states - host + buffers + acts + runtime,
        "paper_comm_bytes": paper,
        "comm_bytes": paper + ds_extra,
    }


def plan(
    work: Workload, device_bytes: float, names: list[str] | None = None, reserve: float = 0.0
) -> list[dict]:
    """Every strategy's plan with `fits` (its total within `device_bytes`) and `recommended` on the
    one that fits with the least communication (DeepSpeed's real bytes; ties: no offload, then the
    lower stage, as they cost the least time)."""
    rows = [plan_rank(layout, work, reserve) for layout in layouts(names, work.model.dim)]
    for r in rows:
        r["fits"], r["recommended"] = r["total_bytes"] <= device_bytes, False
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        best = min(fitting, key=lambda r: (r["comm_bytes"], r["host_bytes"] > 0, r["zero_stage"]))
        best["recommended"] = True
    return rows
