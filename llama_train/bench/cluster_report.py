"""make bench-cluster's numbers beside the planner's: the machine the planner is given for the simulated
hosts (calibrated once from measurements of this machine, never from a row), its prediction for every
row, the error, and whether it orders the strategies as measured in each setting (hosts, link rate).

The calibration: each rank's compute rate and AdamW time from one rank without a link, a copy on every
core at once (DDP, calibrate()); the unshaped links' collective rates and a message's latency from
linkprobe.py at each host count;
DeepSpeed's per-parameter-hook and ZeRO-3 fetch costs and FSDP2's per-unit cost from the 1-rank ZeRO-2,
ZeRO-3 and FSDP2 runs against DDP's; the simulated hosts share this machine's cores. A shaped row's link is its rate, on
the wire, less TCP/IP's framing (steptime.ETHERNET_TCP)."""

import dataclasses
import json
import os
import statistics
from pathlib import Path

from llama_train.bench.advice import NOISE
from llama_train.bench.cluster import UNSHAPED, ClusterSetup
from llama_train.bench.linkprobe import REPEATS
from llama_train.model import param_numels, preset
from llama_train.plan.planner import Workload, plan_rank, shardings
from llama_train.plan.steptime import CPU, ETHERNET_TCP, Link, Machine, flops_per_token

UNLIMITED = (
    1e15  # the unshaped links' own bandwidth: their cost is the collectives' measured rates (op_bytes_s)
)
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
    args, ddp = model_of(setup), calibration["ddp"]
    tokens = setup.batch_size * setup.max_seq_len
    flops = tokens * flops_per_token(args, setup.max_seq_len) / (ddp["forward_s"] + ddp["backward_s"])
    P = calibration["ddp"]["num_params"]
    n = len(param_numels(args))
    hooks = overhead(calibration, "zero2", ddp) / n
    fetch = max(0.0, overhead(calibration, "zero3", ddp) / n - hooks)
    units = overhead(calibration, "fsdp2", ddp) / (args.n_layers + 1)
    world = link["world_size"]
    return dataclasses.replace(
        CPU,
        name=f"this machine's {world} simulated hosts (calibrated)",
        peak_flops=flops,
        mfu=1.0,
        link_bytes_s=UNLIMITED
        if "bytes_s" in link.get("sent", {}).get("all_reduce", {})
        else link["wire_bytes_s"],
        latency_s=0.0,  # DeepSpeed's Python per collective runs in the 1-rank runs too: in `hooks` and `fetch`
        param_hook_s=hooks,
        fetch_s=fetch,
        fsdp_unit_s=units,
        adam_s=ddp["optimizer_s"] / P,
        ranks_per_host=1,
        hop_s=link["latency_s"] / (2 * (world - 1)),
        framing=ETHERNET_TCP,
        cores=os.cpu_count() or 1,
        op_bytes_s=tuple((op, c["bytes_s"]) for op, c in link.get("sent", {}).items() if "bytes_s" in c),
    )


def overhead(calibration: dict[str, dict], name: str, ddp: dict) -> float:
    """Seconds a 1-rank step of `name` takes beyond DDP's (DeepSpeed's Python, FSDP2's copies)."""
    if "step_time_s" not in calibration.get(name, {}):
        return 0.0
    return max(0.0, calibration[name]["step_time_s"] - ddp["step_time_s"])


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


def apart(a: float, b: float) -> int:
    """1 if a is more than NOISE slower than b, -1 if faster, 0 within NOISE: a tie."""
    return 0 if abs(a / b - 1) <= NOISE else (1 if a > b else -1)


def order_agrees(group: list[dict]) -> tuple[bool, list[str], list[str]]:
    """Whether no pair of strategies is ordered the other way by the planner than measured: a pair
    within NOISE on either side is a tie (the planner's own: planner.TIE), which agrees with anything.
    With the measured and the predicted order."""
    measured = [r["strategy"] for r in sorted(group, key=lambda r: r["step_time_s"])]
    predicted = [r["strategy"] for r in sorted(group, key=lambda r: r["predicted_s"])]
    ok = all(
        apart(a["step_time_s"], b["step_time_s"]) * apart(a["predicted_s"], b["predicted_s"]) >= 0
        for a in group
        for b in group
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


def gbit_of(rate: str, link: dict) -> float:
    """A row's link in Gbit/s on the wire: its rate, or what the unshaped links carried in the link probe's
    all-reduce."""
    return link["wire_bytes_s"] * 8 / 1e9 if rate == UNSHAPED else rate_bits(rate) / 1e9


def curves(setup: ClusterSetup, machines: dict[int, Machine], links: dict[int, dict]) -> dict:
    """(hosts, strategy) -> the planner's (Gbit/s, seconds) from two thirds of the slowest rate to the
    unshaped links' (there: unshaped)."""
    args, out = model_of(setup), {}
    for h, machine in machines.items():
        top = gbit_of(UNSHAPED, links[h])
        lowest = min(rate_bits(r) / 1e9 for r in setup.rates if r != UNSHAPED) / 1.5
        points = [lowest * (top / lowest) ** (k / 40) for k in range(40)]
        work = Workload(args, h, setup.batch_size, setup.max_seq_len, "float32", device="cpu")
        for sharding in shardings([s.name for s in setup.strategies], work):
            line = [(g, machine_for(machine, f"{g * 1000:.3f}mbit")) for g in points] + [(top, machine)]
            out[(h, sharding.name)] = [(g, plan_rank(sharding, work, machine=m)["step_s"]) for g, m in line]
    return out


MB = 1e-6


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1000:,.0f}"


def rows_table(rows: list[dict]) -> str:
    """One line per (strategy, hosts, rate): step time, its split, its ratio to DDP's, the planner's."""
    head = "| strategy | hosts | link | step (ms) | fastest–slowest | / DDP | comm wait | rest | planner (ms) | error |"
    ddp = {
        (r["hosts"], r["rate"]): r["step_time_s"]
        for r in rows
        if r["strategy"] == "ddp" and not r.get("error")
    }
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if r.get("error"):
            lines.append(
                f"| {r['strategy']} | {r['hosts']} | {r['rate']} | failed: {r['error'].splitlines()[0]} |"
            )
            continue
        lo, hi = r["step_time_range_s"]
        base = ddp.get((r["hosts"], r["rate"]))
        ratio = f"{r['step_time_s'] / base:.2f}" if base else "—"
        lines.append(
            f"| {r['strategy']} | {r['hosts']} | {r['rate']} | {_ms(r['step_time_s'])} | {_ms(lo)}–{_ms(hi)} | {ratio} "
            f"| {_ms(r['comm_wait_s'])} | {_ms(r['compute_s'])} | {_ms(r.get('predicted_s'))} | {r.get('error_rel', 0):+.0%} |"
        )
    return "\n".join(lines)


def bytes_table(rows: list[dict]) -> str:
    """Per strategy and host count: what a rank sent per step by the kernel's count (the median over the
    rates), the comm record's wire and paper figures, and the kernel's against the record's."""
    lines = ["| strategy | hosts | kernel (MB) | comm record: wire (MB) | comm record: paper (MB) | kernel / wire |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if not r.get("error") and r["kernel_bytes"] is not None:
            groups.setdefault((r["hosts"], r["strategy"]), []).append(r)
    for (hosts, name), group in sorted(groups.items()):
        kernel, wire = statistics.median(r["kernel_bytes"] for r in group), group[0]["wire_bytes"]
        lines.append(f"| {name} | {hosts} | {kernel * MB:,.1f} | {wire * MB:,.1f} | {group[0]['paper_bytes'] * MB:,.1f} "
                     f"| {kernel / wire:.3f} |")  # fmt: skip
    return "\n".join(lines)


def verdict_text(v: dict) -> str:
    goal = v["median_abs_error"] <= TARGET_MEDIAN and v["worst_abs_error"] <= TARGET_WORST
    lines = [
        f"The planner against all {v['rows']} rows: median |error| **{v['median_abs_error']:.1%}**, worst "
        f"**{v['worst_abs_error']:.1%}** (goals {TARGET_MEDIAN:.0%} and {TARGET_WORST:.0%}: "
        f"{'met' if goal else 'missed'}); the measured order of strategies reproduced in "
        f"{sum(o['agrees'] for o in v['orders'].values())} of {len(v['orders'])} settings (no pair of strategies "
        f"ordered the other way; a pair within {NOISE:.0%} of each other, measured or predicted, is a tie).",
        "",
        "| setting | measured, fastest first | planner | same order |",
        "|---|---|---|---|",
    ]
    for name, o in v["orders"].items():
        lines.append(
            f"| {name} | {', '.join(o['measured'])} | {', '.join(o['predicted'])} | {'yes' if o['agrees'] else '**no**'} |"
        )
    return "\n".join(lines)


def machines_text(machines: dict[int, Machine]) -> str:
    """The calibrated machine per host count, as plan_memory.py --calibration reads it."""
    ops = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
    head = ["hosts", "compute (GFLOP/s a rank, every core busy)", "AdamW (ns a parameter)", "latency a message (µs)",
            "DeepSpeed hooks (µs a parameter)", "ZeRO-3 fetch (µs a parameter)", "FSDP2 (µs a unit)",
            *(f"{op} unshaped (MB/s)" for op in ops)]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for h, m in sorted(machines.items()):
        rates = dict(m.op_bytes_s)
        cells = [h, f"{m.peak_flops / 1e9:,.1f}", f"{m.adam_s * 1e9:.2f}", f"{m.hop_s * 1e6:,.0f}",
                 f"{m.param_hook_s * 1e6:,.0f}", f"{m.fetch_s * 1e6:,.0f}", f"{m.fsdp_unit_s * 1e6:,.0f}",
                 *(f"{rates[op] / 1e6:,.0f}" if op in rates else "—" for op in ops)]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def sent_text(links: dict[int, dict]) -> str:
    """The link probe's bytes sent per rank per byte of each collective's tensor: the kernel's count on
    every rank's interface beside comm.wire_factor's."""
    lines = ["| hosts | collective | kernel, each rank | comm record (wire_factor) |", "|---|---|---|---|"]
    for h, link in sorted(links.items()):
        for op, c in link.get("sent", {}).items():
            kernel = ", ".join("—" if k is None else f"{k:.3f}" for k in c["kernel"])
            lines.append(f"| {h} | {op} | {kernel} | {c['model']:.3f} |")
    return "\n".join(lines)


def replanned_text(measured: dict) -> str:
    """The line that says the planner's column was recomputed later from these measurements, if it was."""
    again = measured.get("replanned")
    if not again:
        return ""
    return (
        f"\n\nThe planner's column (its predictions, errors and orders, and the plot's lines) recomputed at "
        f"commit {again['commit']} on {again['date']} from the measurements of {measured['date']}, which did "
        f"not run again: `{again['command']}`."
    )


def read_gathers(out) -> dict[tuple[int, str], dict]:
    """(hosts, rate) -> linkprobe --gather's result, from the gather_h<N>_<rate>.json files in `out`."""
    found = {}
    for path in sorted(Path(out).glob("gather_h*_*.json")):
        hosts, rate = path.stem.removeprefix("gather_h").split("_", 1)
        found[(int(hosts), rate)] = json.loads(path.read_text())
    return found


def gathers_text(gathers: dict[tuple[int, str], dict], machines: dict[int, Machine]) -> str:
    """linkprobe --gather's medians beside the planner's link time of a ring all-gather and of ds_cpu's
    broadcasts (steptime.Link.broadcasts) for the same tensor and link ('' without measurements)."""
    if not gathers:
        return ""
    lines = [
        "ZeRO-1/2's parameter gather on a CPU (ds_cpu: one broadcast from each rank in turn) against a ring "
        "all-gather, on the links alone (`python -m llama_train.bench.linkprobe --gather`, 16 MiB of fp32, "
        f"{REPEATS} calls, medians; gather_h<N>_<rate>.json), beside the planner's time on the link:",
        "",
        "| hosts | link | ring all-gather, planned (ms) | all-gather, measured (ms) | broadcasts, planned (ms) "
        "| broadcasts, measured (ms) | fastest call | broadcasts measured / ring planned |",
        "|" + "---|" * 8,
    ]
    for (hosts, rate), g in sorted(gathers.items(), key=lambda kv: (kv[0][0], -rate_bits(kv[0][1]))):
        link = Link(machine_for(machines[hosts], rate), hosts)
        ring, tree = link.on_link("all_gather", g["bytes"]), link.on_link("broadcast", g["bytes"], hosts)
        measured = g["median_s"]
        lines.append(
            f"| {hosts} | {rate} | {_ms(ring)} | {_ms(measured['all_gather'])} | {_ms(tree)} "
            f"| {_ms(measured['broadcasts'])} | {_ms(min(g['seconds']['broadcasts']))} "
            f"| {measured['broadcasts'] / ring:.2f} |"
        )
    return "\n".join(lines) + "\n\n"


def results_markdown(setup, measured: dict, machines, verdict_, label: str) -> str:
    """results.md: what ran, the verdict, every row, the calibrated machine, the link probe's counts."""
    names, loads, rows = ", ".join(s.name for s in setup.strategies), measured["loads"], measured["rows"]
    return f"""# Shaped simulated hosts: {names}

{label}{replanned_text(measured)}

{", ".join(map(str, setup.hosts))} simulated hosts (scripts/multinode_sim.sh: network namespaces behind a bridge,
one rank each, `OMP_NUM_THREADS=1`, sharing this machine's {os.cpu_count()} cores), links shaped with `tc tbf`
on both ends of each host's link to {", ".join(setup.rates)} (`off`: unshaped). Preset `{setup.preset}`
`{setup.trainer_args}`, sequence {setup.max_seq_len}, micro batch {setup.batch_size}, fp32, gloo. One launch
per strategy and host count; {setup.warmup_steps} warm-up steps, then windows of {setup.window_steps} measured
steps (the one after each change left out) at the rates {" -> ".join(setup.schedule())}; every step probed.
Medians over the steps of each rate. Load (1-minute average) at the start and end: {loads[0]:.1f},
{loads[-1]:.1f}; {measured["seconds"] / 60:.1f} minutes in all.

`{measured["command"]}`

{verdict_text(verdict_)}

Step time, its ratio to DDP's in the same setting and its split (the mean rank's communication wait, and
the rest: compute, DeepSpeed's and FSDP2's own work), and the planner's prediction (`scripts/plan_memory.py
--calibration machine_h<N>.json --link_gbit R --ranks_per_host 1 ...`):

{rows_table(rows)}

Bytes a rank sent per step, as the kernel counted them on its host's interface (the median over the link
settings), beside the comm record's wire figure and the ZeRO paper's count:

{bytes_table(rows)}

The planner's machine, calibrated once per host count (llama_train/bench/cluster_report.py: one rank
without a link, a copy on every core at once, for compute and AdamW; the same for ZeRO-2, ZeRO-3 and FSDP2
against DDP for DeepSpeed's Python and FSDP2's copies; the link probe for each collective's unshaped rate
and a message's latency), never from a row above:

{machines_text(machines)}

Bytes a rank's interface sent per byte of a collective's tensor, counted by the kernel in the link probe
(llama_train/bench/linkprobe.py: 16 MiB of fp32, 12 calls; `broadcast`: one from each rank in turn, as
ds_cpu gathers ZeRO-1/2's parameters), beside what the comm record counts:

{sent_text(measured["links"])}

{gathers_text(measured.get("gathers", {}), machines)}![step time against link rate](link_rates.png)
"""
