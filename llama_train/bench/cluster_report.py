"""make bench-cluster's numbers beside the planner's: the machine the planner is given for the simulated
hosts (calibrated once from measurements of this machine, never from a row), its prediction for every
row, the error, and whether it orders the strategies as measured in each setting (hosts, link rate).

The calibration: each rank's compute rate and AdamW time from one rank alone, without a link (DDP,
calibrate()); the unshaped links' bandwidth and a message's latency from linkprobe.py at each host count;
DeepSpeed's per-collective, per-parameter-hook and ZeRO-3 fetch costs from the 1-rank ZeRO-2 and ZeRO-3
runs against DDP's; the simulated hosts share this machine's cores. A shaped row's link is its rate, on
the wire, less TCP/IP's framing (steptime.ETHERNET_TCP)."""

import dataclasses
import os
import statistics

from llama_train.bench.advice import NOISE
from llama_train.bench.cluster import UNSHAPED, ClusterSetup
from llama_train.model import param_numels, preset
from llama_train.plan.planner import Workload, plan_rank, shardings
from llama_train.plan.steptime import CPU, ETHERNET_TCP, Machine, flops_per_token

TARGET_MEDIAN, TARGET_WORST = 0.15, 0.30  # the goals for the planner against the shaped rows


def model_of(setup: ClusterSetup):
    """The ModelArgs the runs trained (the preset with the benchmark's overrides)."""
    flags = setup.trainer_args.split()
    overrides = {flags[i].lstrip("-"): int(flags[i + 1]) for i in range(0, len(flags), 2)}
    return preset(setup.preset, **overrides)


def rate_bits(rate: str) -> float:
    """tc's rate ('500mbit', '2gbit') in bits a second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12, "bit": 1.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate.removesuffix(unit)) * scale
    raise ValueError(f"not a tc rate: {rate!r}")


def base_machine(setup: ClusterSetup, calibration: dict[str, dict], link: dict) -> Machine:
    """The simulated hosts as a Machine (module docstring), unshaped; link: linkprobe's at this host count."""
    args, ddp = model_of(setup), calibration["ddp"]["time_split"]
    tokens = setup.batch_size * setup.max_seq_len
    flops = tokens * flops_per_token(args, setup.max_seq_len) / (ddp["forward_s"] + ddp["backward_s"])
    P = calibration["ddp"]["num_params"]
    n = len(param_numels(args))
    hooks = overhead(calibration, "zero2", ddp) / n
    fetch = max(0.0, overhead(calibration, "zero3", ddp) / n - hooks)
    world = link["world_size"]
    return dataclasses.replace(
        CPU,
        name=f"this machine's {world} simulated hosts (calibrated)",
        peak_flops=flops,
        mfu=1.0,
        link_bytes_s=link["wire_bytes_s"],
        param_hook_s=hooks,
        fetch_s=fetch,
        adam_s=ddp["optimizer_s"] / P,
        ranks_per_host=1,
        hop_s=link["latency_s"] / (2 * (world - 1)),
        framing=ETHERNET_TCP,
        cores=os.cpu_count() or 1,
    )


def overhead(calibration: dict[str, dict], name: str, ddp: dict) -> float:
    """Seconds a 1-rank step of `name` takes beyond DDP's compute and optimizer (DeepSpeed's Python)."""
    split = calibration.get(name, {}).get("time_split")
    if not split:
        return 0.0
    keys = ("forward_s", "backward_s", "optimizer_s", "comm_wait_s")
    return max(0.0, sum(split[k] for k in keys) - sum(ddp[k] for k in keys))


def machine_for(base: Machine, rate: str) -> Machine:
    """`base` with its links shaped to `rate` (unshaped: as measured)."""
    if rate == UNSHAPED:
        return base
    return dataclasses.replace(base, inter_bytes_s=rate_bits(rate) / 8)


def predict(rows: list[dict], setup: ClusterSetup, machines: dict[int, Machine]):
    """Each measured row's predicted step time and terms (`plan`), and its relative error (in place)."""
    args = model_of(setup)
    for row in rows:
        if row.get("error"):
            continue
        work = Workload(args, row["hosts"], setup.batch_size, setup.max_seq_len, "float32", device="cpu")
        (sharding,) = shardings([row["strategy"]], work)
        row["plan"] = plan_rank(sharding, work, machine=machine_for(machines[row["hosts"]], row["rate"]))
        row["predicted_s"] = row["plan"]["step_s"]
        row["error_rel"] = row["predicted_s"] / row["step_time_s"] - 1


def settings(rows: list[dict]) -> dict[tuple[int, str], list[dict]]:
    """The rows by (hosts, rate)."""
    out: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        if not row.get("error"):
            out.setdefault((row["hosts"], row["rate"]), []).append(row)
    return out


def order_agrees(group: list[dict]) -> tuple[bool, list[str], list[str]]:
    """Whether the predictions order every pair of strategies as measured, pairs measured within NOISE
    of each other counting as ties; with the measured and the predicted order."""
    measured = [r["strategy"] for r in sorted(group, key=lambda r: r["step_time_s"])]
    predicted = [r["strategy"] for r in sorted(group, key=lambda r: r["predicted_s"])]
    ok = all(
        (a["step_time_s"] < b["step_time_s"]) == (a["predicted_s"] < b["predicted_s"])
        for a in group
        for b in group
        if a is not b and abs(a["step_time_s"] / b["step_time_s"] - 1) > NOISE
    )
    return ok, measured, predicted


def verdict(rows: list[dict]) -> dict:
    """The planner against every row: median and worst |error|, and the orders per setting."""
    errors = [abs(r["error_rel"]) for r in rows if "error_rel" in r]
    orders = {f"{h} hosts, {rate}": order_agrees(g) for (h, rate), g in settings(rows).items()}
    return {
        "median_abs_error": statistics.median(errors) if errors else None,
        "worst_abs_error": max(errors) if errors else None,
        "rows": len(errors),
        "orders": {k: {"agrees": ok, "measured": m, "predicted": p} for k, (ok, m, p) in orders.items()},
        "orders_agree": all(ok for ok, _, _ in orders.values()),
    }
