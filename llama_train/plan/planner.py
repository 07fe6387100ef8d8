"""Before launching: the per-rank memory of every strategy for a model, batch and world size, which
strategies fit a device, and those that fit ranked by expected step cost (scripts/plan_memory.py,
--recommend; the benchmark's "planned" column and its check of the ranking against what it
measured). The formulas are memory.py's and comm.py's.

A rank's peak = model states (the ZeRO paper's formula plus what DeepSpeed really holds) + buffers
(DDP's gradient buckets, ZeRO-0's flattened and ZeRO-1's full-size gradients, the optimizer's fp32
gradient partition, ZeRO-3's gathered parameters, FSDP2's gathered units and gradient copies, on CPU
the heap DeepSpeed's and FSDP2's steps leave) +
activations of one micro-batch (with the block recomputed under activation checkpointing) + the
loss's logits and their gradients + the runtime: on CPU the process's resident Python/torch/DeepSpeed
runtime, measured; on GPU CUDA's max_memory_allocated has no runtime, and `--reserve_gib` stands for
the CUDA context. All in llama_train/plan/memory.py.
"""

from dataclasses import dataclass
from pathlib import Path

from llama_train.distributed.ds_config import fill_buckets, fill_speed, load_ds_config
from llama_train.distributed.strategies import DEFAULT_STRATEGIES, PAPER_VOLUME, STRATEGIES
from llama_train.model import ModelArgs
from llama_train.optim.registry import optimizer_spec
from llama_train.plan.comm import comm_extras, expected_comm_bytes, persistent_numel, step_transfers
from llama_train.plan.memory import (
    Sharding,
    activation_bytes,
    deepspeed_extras,
    expected_model_state_bytes,
    fsdp_buffers,
    loss_head_bytes,
    offloaded_bytes,
    param_numels,
    recompute_bytes,
    runtime_bytes,
    transient_buffers,
)
from llama_train.plan.steptime import MACHINES, Machine, step_time

GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]  # the checkout: ds_configs/ and the trainers are here


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
    optimizer: str = "adamw"  # --optimizer: its record says what state it keeps and what it moves


def shardings(names: list[str] | None, work: "Workload") -> list[Sharding]:
    """Strategies by name (default: the default set; their records: distributed/strategies.py) with
    their DeepSpeed configs read and their "auto" bucket sizes and switches filled for the workload,
    as the trainer fills them."""
    out = []
    for name in names or DEFAULT_STRATEGIES:
        record = STRATEGIES[name]
        path, config = record.ds_config, None
        if path:
            config = fill_speed(load_ds_config(str(ROOT / path)), work.world_size)
            fill_buckets(config, work.model)
        out.append(Sharding.of(record, config))
    return out


def machine_for(work: Workload, machine: Machine | None = None) -> Machine:
    """The machine a plan's step times are for: `machine`, else the stated H100 (gpu) or the fitted CPU."""
    return machine or MACHINES["h100" if work.device == "gpu" else "cpu"]


def plan_rank(
    sharding: Sharding, work: Workload, reserve: float = 0.0, machine: Machine | None = None
) -> dict:
    """One strategy's predicted peak bytes per rank, by part, its communication per step, and its step
    time on `machine` (steptime.py; default machine_for's), by term."""
    args, world, dtype = work.model, work.world_size, work.dtype
    numels = param_numels(args)
    P = sum(numels)
    extras = deepspeed_extras(sharding, dtype, P, max(numels), world)
    optimizer = optimizer_spec(work.optimizer)
    other_state = optimizer.state_difference(optimizer.numel(args))
    states = expected_model_state_bytes(sharding.stage, P, world, dtype, other_state) + sum(
        b for _, b in extras
    )
    host = offloaded_bytes(sharding, P, world, dtype) if work.device == "gpu" else 0.0
    acts = activation_bytes(args, work.batch_size, work.seq_len, dtype)
    acts += recompute_bytes(args, work.batch_size, work.seq_len, dtype)
    acts += loss_head_bytes(args, work.batch_size, work.seq_len, dtype)
    buffers = sum(b for _, b in plan_buffers(sharding, work))
    runtime = runtime_bytes(sharding, work.device, reserve)
    paper = sum(expected_comm_bytes(sharding.stage, P, world, dtype, sharding.ddp).values())
    ds_extra = sum(
        b for _, b in comm_extras(sharding, args, world, dtype, work.accumulation_steps, optimizer)
    )
    on = machine_for(work, machine)
    transfers = step_transfers(sharding, args, world, dtype, work.accumulation_steps, optimizer, on.streams)
    speed = step_time(sharding, work, on, transfers)
    return {
        "strategy": sharding.name,
        "ddp": sharding.ddp,
        "zero_stage": sharding.stage,
        "offload": sharding.offload_optimizer or sharding.offload_param,
        "model_state_bytes": states - host,
        "host_bytes": host,
        "buffer_bytes": buffers,
        "activation_bytes": acts,
        "runtime_bytes": runtime,
        "total_bytes": states - host + buffers + acts + runtime,
        "paper_comm_bytes": paper,
        "comm_bytes": paper + ds_extra,
        "wire_bytes": sum(t.wire(on.backend, world) for t in transfers),  # what a rank sends a step
        **speed,
    }


def plan_buffers(sharding: Sharding, work: Workload) -> list[tuple[str, float]]:
    """(why, bytes) a rank holds at its peak beyond model states and activations: FSDP2's gathered
    units and gradient buffers (memory.fsdp_buffers), or DDP's / DeepSpeed's (memory.transient_buffers)."""
    if sharding.fsdp:
        return fsdp_buffers(work.model, work.dtype, work.world_size, work.accumulation_steps, work.device)
    numels = param_numels(work.model)
    persistent = persistent_numel(numels, sharding.zero) if sharding.stage == 3 else 0
    return transient_buffers(sharding, work.dtype, numels, work.world_size, persistent, work.device)


def plan(
    work: Workload,
    device_bytes: float,
    names: list[str] | None = None,
    reserve: float = 0.0,
    machine: Machine | None = None,
) -> list[dict]:
    """Every strategy's plan with `fits` (its total within `device_bytes`), `rank` among those that
    fit (1: the fastest expected step, `ranked`) and `recommended` on rank 1."""
    rows = [plan_rank(sharding, work, reserve, machine) for sharding in shardings(names, work)]
    for r in rows:
        r["fits"] = r["total_bytes"] <= device_bytes
    return with_ranks(rows)


def with_ranks(rows: list[dict]) -> list[dict]:
    """`rank` (None: does not fit) and `recommended` set on every row, by `ranked`."""
    order = {id(r): i for i, r in enumerate(ranked(rows), 1)}
    for r in rows:
        r["rank"] = order.get(id(r))
        r["recommended"] = r["rank"] == 1
    return rows


TIE = 1.05  # expected step times within 5% rank as a tie: the model is good to about that


def _tie_break(row: dict) -> tuple:
    return row["zero_stage"], not row["ddp"]


def ranked(rows: list[dict]) -> list[dict]:
    """The rows that fit, the fastest expected step first (`step_s`, steptime.py); times within 5% a
    tie, which goes to the lower stage (less sharding to get wrong), then to DDP. Offload comes after
    the rest whatever its time: it is for when nothing else fits (its host memory is the machine's)."""
    out = []
    for offload in (False, True):
        groups: list[list[dict]] = []
        for r in sorted(
            (r for r in rows if r["fits"] and r["offload"] == offload), key=lambda r: r["step_s"]
        ):
            if groups and r["step_s"] <= TIE * groups[-1][0]["step_s"]:
                groups[-1].append(r)
            else:
                groups.append([r])
        out += [r for group in groups for r in sorted(group, key=_tie_break)]
    return out


def advice(rows: list[dict], device_bytes: float) -> list[str]:
    """The ranking as sentences: each strategy that fits, cheapest first, with its spare memory, the
    bytes a rank sends on the wire and, counted as the paper counts, against the ZeRO paper's 2 or 3 Psi;
    then those that do not fit, with what they need."""
    lines = []
    for r in ranked(rows):
        where = f" ({size(r['host_bytes'])} more in host memory)" if r["host_bytes"] else ""
        psi = sum(k for k, _ in PAPER_VOLUME[r["zero_stage"]].values())
        moves = "moves nothing"
        if r["paper_comm_bytes"]:
            ratio = r["comm_bytes"] / r["paper_comm_bytes"]
            moves = (
                f"sends {size(r['wire_bytes'])} a step on the wire (counted as the ZeRO paper counts, "
                f"{size(r['comm_bytes'])}: {ratio:.2f}x its {psi} Psi)"
            )
        spare = size(device_bytes - r["total_bytes"])
        lines.append(f"{r['rank']}. {r['strategy']} fits with {spare} spare{where}; {expected(r)}; {moves}")
    for r in rows:
        if not r["fits"]:
            lines.append(f"- {r['strategy']} does not fit: it needs {size(r['total_bytes'])} a rank")
    return lines


SPLIT = ("compute", "recompute", "comm", "latency", "optimizer", "offload")


def expected(row: dict) -> str:
    """'~412 ms a step (compute 380, comm 20, latency 12)': the step-time model's terms over 0.5 ms."""
    terms = ", ".join(f"{k} {row[f'{k}_s'] * 1000:,.0f}" for k in SPLIT if row[f"{k}_s"] >= 5e-4)
    return f"~{row['step_s'] * 1000:,.0f} ms a step expected ({terms})"


def size(b: float) -> str:
    """'9.1 GiB', or '420 MiB' under a GiB."""
    return f"{b / GiB:,.1f} GiB" if abs(b) >= GiB else f"{b / 2**20:,.0f} MiB"
