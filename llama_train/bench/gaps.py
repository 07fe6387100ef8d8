"""Why a run's measured model-state bytes differ from the ZeRO paper's: what DeepSpeed holds
beyond (or instead of) the paper's terms, sized from the run's numbers and its config."""

import json

from llama_train.bench.matrix import ROOT

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # model params and grads, by trainer dtype
GAP_TOLERANCE = 0.10  # measured vs expected model state: explain anything further apart

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
OTHER = (
    "other engine buffers (e.g. gradient-buffer slack: a parameter straddling a partition edge is held whole)"
)


def load_config(path: str | None) -> dict:
    """A DeepSpeed config as a dict ({} for DDP or when it cannot be read: the run reports that)."""
    try:
        return json.loads((ROOT / path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}


def known_extras(row: dict, config: dict) -> list[tuple[str, float]]:
    """What DeepSpeed holds beyond (or instead of) the paper's terms, sized from the run's numbers
    and its config: (why, bytes per rank). Read off DeepSpeed 0.19's ZeRO optimizers."""
    zero = config.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    stage, dtype, elem = row["zero_stage"], row["dtype"], ELEMENT_BYTES[row["dtype"]]
    num_params = row.get("local_params") or row["num_params"]  # model parallel: this rank's share
    shard, largest = num_params / row.get("zero_world", row["world_size"]), row["largest_param_numel"]
    extras = []
    if stage >= 1 and dtype == "float32":
        extras.append((MASTER_COPY, 4 * shard))
    if stage == 1 and row["breakdown"].get("params_and_grads", 0) < 1.01 * elem * num_params:  # no param.grad
        extras.append((STAGE1_GRADS, -elem * (num_params - shard)))
    if offload and stage == 3:
        extras.append((CPU_GRAD_COPY, 4 * shard))
    if offload and stage in (1, 2):
        extras.append(
            (f"a copy-back buffer of the updated partition, {elem} B/param (CPU offload)", elem * shard)
        )
        staging = f"two gradient staging buffers for the CPU copy, each the largest parameter ({largest:,})"
        extras.append((staging, 2 * elem * largest))
    if stage == 3:
        bucket = float(zero.get("reduce_bucket_size", 5e8))  # DeepSpeed's default when the config has none
        why = f"the gradient reduce bucket, allocated whole: reduce_bucket_size {bucket:.3g} elements x {elem} B"
        extras.append((why, bucket * elem))
    return extras


def explain_gap(row: dict, config: dict) -> str | None:
    """Why measured model-state bytes differ from the ZeRO paper's by more than GAP_TOLERANCE, from
    the run's breakdown (params+grads, optimizer state, engine buffers) and its DeepSpeed config;
    what the known causes leave over is reported as such."""
    measured, expected = row.get("model_state_bytes"), row.get("expected_model_state_bytes")
    if not measured or not expected or abs(measured / expected - 1) <= GAP_TOLERANCE:
        return None
    P = row.get("local_params") or row["num_params"]

    def size(b: float) -> str:
        return f"{b / P:+.2f} B/param ({b / 2**20:+,.1f} MiB)"

    parts = ", ".join(f"{k.replace('_', ' ')} {v / P:.2f}" for k, v in row["breakdown"].items())
    head = (
        f"measured {measured / P:.2f} B/param ({parts}) vs the paper's {expected / P:.2f} for stage "
        f"{row['zero_stage']}, {row['dtype']}, N={row.get('zero_world', row['world_size'])}: {size(measured - expected)}."
    )
    extras = [] if row["strategy"] == "ddp" else known_extras(row, config)
    rest = measured - expected - sum(b for _, b in extras)
    if abs(rest) > 0.01 * expected or not extras:
        extras.append((OTHER, rest))
    return head + " " + "; ".join(f"{size(b)}: {why}" for why, b in extras) + "."
