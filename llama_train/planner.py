"""Before launching: the per-rank memory of every strategy for a model, batch and world size, which
strategies fit a device, and the one that fits with the least communication (scripts/plan_memory.py;
the benchmark's "planned" column). The formulas are memory.py's and comm.py's.

A rank's peak = model states (the ZeRO paper's formula plus what DeepSpeed really holds) + buffers
(DDP's gradient buckets, ZeRO-0's flattened and ZeRO-1's full-size gradients, the optimizer's fp32
gradient partition, ZeRO-3's gathered parameters, on CPU the heap DeepSpeed's steps leave) +
activations of one micro-batch (with the block recomputed under activation checkpointing) + the
loss's logits and their gradients + the runtime: on CPU the process's resident Python/torch/DeepSpeed
runtime, measured; on GPU CUDA's max_memory_allocated has no runtime, and `--reserve_gib` stands for
the CUDA context. All in llama_train/memory.py.
"""

from dataclasses import dataclass
from pathlib import Path

from llama_train.comm import deepspeed_comm_extras, expected_comm_bytes, persistent_numel
from llama_train.ds_config import fill_buckets, load_ds_config
from llama_train.memory import (
    Sharding,
    activation_bytes,
    deepspeed_extras,
    expected_model_state_bytes,
    loss_head_bytes,
    offloaded_bytes,
    param_numels,
    recompute_bytes,
    runtime_bytes,
    transient_buffers,
)
from llama_train.model import ModelArgs

ROOT = Path(__file__).resolve().parents[1]  # the checkout: ds_configs/ and the trainers are here

# name -> DeepSpeed config (None: the DDP trainer). The order is the table's order.
STRATEGIES: dict[str, str | None] = {
    "ddp": None,
    "zero0": "ds_configs/zero0.json",
    "zero1": "ds_configs/zero1.json",
    "zero2": "ds_configs/zero2.json",
    "zero3": "ds_configs/zero3.json",
    "zero2_offload": "ds_configs/zero2_offload.json",
    "zero3_offload": "ds_configs/zero3_offload.json",
    "ddp_static": None,  # opt-in: DDP without the unused-parameter search (the trainer's default)
    "ddp_unused": None,  # opt-in: DDP with --find_unused_parameters (what the search costs)
    # opt-in, model parallel over 2 ranks (x data parallel over the rest): README 'Model parallelism'
    "tp2": "ds_configs/tp2_zero1.json",  # AutoTP: heads and SwiGLU units split
    "sp2": "ds_configs/zero1.json",  # Ulysses: every sequence split
    "pp2": "ds_configs/zero1.json",  # two pipeline stages
}
EXTRA_FLAGS = {
    "ddp_static": ("--no-find_unused_parameters",),
    "ddp_unused": ("--find_unused_parameters",),
    "sp2": ("--sequence_parallel_size", "2"),
    "pp2": ("--pipeline_parallel_size", "2"),
}
DEFAULT_STRATEGIES = list(STRATEGIES)[:7]  # DDP and the six DeepSpeed configs
# the same with the trainers' --compile (scripts/benchmark.py --compile adds them); ZeRO-3 refuses it
COMPILED = {f"{name}_compiled": name for name in ("ddp", "zero0", "zero1", "zero2", "zero2_offload")}
STRATEGIES.update({twin: STRATEGIES[name] for twin, name in COMPILED.items()})
EXTRA_FLAGS.update({twin: ("--compile",) for twin in COMPILED})


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


def shardings(names: list[str] | None = None, dim: int | None = None) -> list[Sharding]:
    """The benchmark's strategies (default: all seven) with their DeepSpeed configs read and their
    "auto" bucket sizes filled for hidden size `dim`, as the trainer fills them."""
    out = []
    for name in names or DEFAULT_STRATEGIES:
        path = STRATEGIES[name]
        config = fill_buckets(load_ds_config(str(ROOT / path)), dim) if path else None
        out.append(Sharding.from_config(name, config))
    return out


def plan_rank(sharding: Sharding, work: Workload, reserve: float = 0.0) -> dict:
    """One strategy's predicted peak bytes per rank, by part, and its communication per step."""
    args, world, dtype = work.model, work.world_size, work.dtype
    numels = param_numels(args)
    P = sum(numels)
    extras = deepspeed_extras(sharding, dtype, P, max(numels), world)
    states = expected_model_state_bytes(sharding.stage, P, world, dtype) + sum(b for _, b in extras)
    host = offloaded_bytes(sharding, P, world, dtype) if work.device == "gpu" else 0.0
    acts = activation_bytes(args, work.batch_size, work.seq_len, dtype)
    acts += recompute_bytes(args, work.batch_size, work.seq_len, dtype)
    acts += loss_head_bytes(args, work.batch_size, work.seq_len, dtype)
    persistent = persistent_numel(numels, sharding.zero) if sharding.stage == 3 else 0
    buffers = sum(b for _, b in transient_buffers(sharding, dtype, numels, world, persistent, work.device))
    runtime = runtime_bytes(sharding, work.device, reserve)
    paper = sum(expected_comm_bytes(sharding.stage, P, world, dtype, sharding.ddp).values())
    ds_extra = sum(
        b for _, b in deepspeed_comm_extras(sharding, numels, world, dtype, work.accumulation_steps)
    )
    return {
        "strategy": sharding.name,
        "ddp": sharding.ddp,
        "zero_stage": sharding.stage,
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
    one that fits with the least communication (DeepSpeed's real bytes; ties, within 1%: no offload,
    then the lower stage, then DDP, as they cost the least time)."""
    rows = [plan_rank(sharding, work, reserve) for sharding in shardings(names, work.model.dim)]
    for r in rows:
        r["fits"], r["recommended"] = r["total_bytes"] <= device_bytes, False
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        least = min(r["comm_bytes"] for r in fitting)
        close = [r for r in fitting if r["comm_bytes"] <= 1.01 * least]  # within 1%: a tie
        best = min(close, key=lambda r: (r["host_bytes"] > 0, r["zero_stage"], not r["ddp"], r["comm_bytes"]))
        best["recommended"] = True
    return rows
