"""Why a run's measured model-state bytes differ from the ZeRO paper's: what DeepSpeed holds
beyond (or instead of) the paper's terms, sized from the run's numbers and its config."""

import json

from llama_train.distributed.ds_config import fill_buckets, fill_speed
from llama_train.distributed.strategies import STRATEGIES
from llama_train.model import ModelArgs
from llama_train.optim.registry import optimizer_spec
from llama_train.plan.comm import comm_extras, element_bytes
from llama_train.plan.memory import (
    ELEMENT_BYTES,
    STAGE1_GRADS,
    Sharding,
    deepspeed_extras,
    param_numels,
)
from llama_train.plan.planner import ROOT

GAP_TOLERANCE = 0.10  # measured vs expected model state or communication: explain anything further apart
OTHER = (
    "other engine buffers (e.g. gradient-buffer slack: a parameter straddling a partition edge is held whole)"
)


def load_config(path: str | None, row: dict | None = None) -> dict:
    """A DeepSpeed config as a dict, its "auto" bucket sizes and switches filled for the run `row`
    (its model, ranks and device) as the trainer fills them ({} for DDP or when it cannot be read:
    the run reports that)."""
    try:
        config = json.loads((ROOT / path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}
    if not row or not row.get("model") or not isinstance(config, dict):
        return config
    fill_speed(config, row.get("zero_world", row["world_size"]))
    return fill_buckets(config, ModelArgs(**row["model"]))


def row_sharding(row: dict, config: dict) -> Sharding:
    """A run's strategy as the memory and communication formulas see it: its record's (the DDP
    trainer's: DDP, or FSDP2 and its offload), or its DeepSpeed config's (NAME=CONFIG has no record)."""
    record = STRATEGIES.get(row["strategy"])
    if record is not None and not record.ds_config:
        return Sharding.of(record)
    return Sharding.from_config(row["strategy"], config)


def known_extras(row: dict, config: dict) -> list[tuple[str, float]]:
    """What DeepSpeed holds beyond (or instead of) the paper's terms (memory.deepspeed_extras), sized
    from the run's numbers and its config; ZeRO-1's partitioned gradients only where the measured
    breakdown shows them. Model parallel: the rank's share of the parameters, over its ZeRO group."""
    sharding = row_sharding(row, config)
    num_params = row.get("local_params") or row["num_params"]  # model parallel: this rank's share
    world = row.get("zero_world", row["world_size"])
    extras = deepspeed_extras(sharding, row["dtype"], num_params, row["largest_param_numel"], world)
    full_grads = (
        row["breakdown"].get("params_and_grads", 0) >= 1.01 * ELEMENT_BYTES[row["dtype"]] * num_params
    )
    return [(why, b) for why, b in extras if not (why == STAGE1_GRADS and full_grads)]


def explain_gap(row: dict, config: dict) -> str | None:
    """Why measured model-state bytes differ from the ZeRO paper's by more than GAP_TOLERANCE, from
    the run's breakdown (params+grads, optimizer state, engine buffers) and its DeepSpeed config;
    what the known causes leave over is reported as such."""
    measured, expected = row.get("model_state_bytes"), row.get("expected_model_state_bytes")
    if not measured or not expected or abs(measured / expected - 1) <= GAP_TOLERANCE:
        return None
    P = row.get("local_params") or row["num_params"]  # model parallel: this rank's share
    parts = ", ".join(f"{k.replace('_', ' ')} {v / P:.2f}" for k, v in row["breakdown"].items())
    head = (
        f"measured {measured / P:.2f} B/param ({parts}) vs the paper's {expected / P:.2f} for stage "
        f"{row['zero_stage']}, {row['dtype']}, N={row.get('zero_world', row['world_size'])}: {_size(measured - expected, P, 'B/param')}."
    )
    extras = known_extras(row, config)
    return _itemize(head, measured, expected, extras, OTHER, P, "B/param")


def _size(b: float, unit: float, name: str) -> str:
    return f"{b / unit:+.2f} {name} ({b / 2**20:+,.1f} MiB)"


def _itemize(
    head: str, measured: float, expected: float, extras: list, other: str, unit: float, name: str
) -> str:
    """`head`, then each known cause with its size, then what they leave unexplained (if > 1%)."""
    rest = measured - expected - sum(b for _, b in extras)
    if abs(rest) > 0.01 * expected or not extras:
        extras = [*extras, (other, rest)]
    return head + " " + "; ".join(f"{_size(b, unit, name)}: {why}" for why, b in extras) + "."


def explain_comm_gap(row: dict, config: dict) -> str | None:
    """Why measured bytes per step differ from the ZeRO paper's by more than GAP_TOLERANCE, cause by
    cause (comm.comm_extras: FSDP2's or DeepSpeed's, from the run's model and config); what the known
    causes leave over is reported as such."""
    measured, expected = row.get("comm_bytes"), row.get("expected_comm_bytes")
    if not measured or not expected or abs(measured / expected - 1) <= GAP_TOLERANCE:
        return None
    sharding, model = row_sharding(row, config), ModelArgs(**row["model"])
    numels, world, dtype = param_numels(model), row["world_size"], row["dtype"]
    psi = sum(numels) * element_bytes(dtype, sharding.ddp)["grad"]
    ops = ", ".join(f"{op.replace('_', '-')} {b / psi:.2f}" for op, b in row["comm_bytes_by_op"].items())
    head = (
        f"measured {measured / psi:.2f} Psi a step ({ops}) vs the paper's {expected / psi:.2f} Psi "
        f"(Psi = {sum(numels):,} params x {psi // sum(numels)} B = {psi / 2**20:,.1f} MiB): "
        f"{_size(measured - expected, psi, 'Psi')}."
    )
    run_args = row.get("run_args") or {}
    optimizer = optimizer_spec(run_args.get("optimizer") or "adamw")
    extras = comm_extras(sharding, model, world, dtype, run_args.get("accumulation_steps") or 1, optimizer)
    return _itemize(head, measured, expected, extras, "other collectives", psi, "Psi")
