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
        op_bytes_s=tuple((op, c["bytes_s"]) for op, c in link.get("sent", {}).items()),
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


def gbit_of(rate: str, machine: Machine) -> float:
    """A row's link in Gbit/s on the wire: its rate, or what the unshaped links carry (the link probe)."""
    return machine.link_bytes_s * 8 / 1e9 if rate == UNSHAPED else rate_bits(rate) / 1e9


def curves(rows: list[dict], setup: ClusterSetup, machines: dict[int, Machine]) -> dict:
    """(hosts, strategy) -> the planner's (Gbit/s, seconds) from a quarter of the slowest rate to the
    unshaped links."""
    args, out = model_of(setup), {}
    for h, machine in machines.items():
        top = gbit_of(UNSHAPED, machine)
        lowest = min(rate_bits(r) / 1e9 for r in setup.rates if r != UNSHAPED) / 4
        points = [lowest * (top / lowest) ** (k / 40) for k in range(41)]
        work = Workload(args, h, setup.batch_size, setup.max_seq_len, "float32", device="cpu")
        for sharding in shardings([s.name for s in setup.strategies], work):
            out[(h, sharding.name)] = [
                (g, plan_rank(sharding, work, machine=machine_for(machine, f"{g * 1000:.3f}mbit"))["step_s"])
                for g in points
            ]
    return out


MB = 1e-6


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1000:,.0f}"


def rows_table(rows: list[dict]) -> str:
    """One line per (strategy, hosts, rate): measured, counted and predicted."""
    head = (
        "| strategy | hosts | link | step (ms) | fastest–slowest | comm wait | rest | sent/rank (kernel, MB) "
        "| comm record: wire / paper (MB) | planner (ms) | error |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        if r.get("error"):
            lines.append(
                f"| {r['strategy']} | {r['hosts']} | {r['rate']} | failed: {r['error'].splitlines()[0]} |"
            )
            continue
        lo, hi = r["step_time_range_s"]
        kernel = "—" if r["kernel_bytes"] is None else f"{r['kernel_bytes'] * MB:,.1f}"
        lines.append(
            f"| {r['strategy']} | {r['hosts']} | {r['rate']} | {_ms(r['step_time_s'])} | {_ms(lo)}–{_ms(hi)} "
            f"| {_ms(r['comm_wait_s'])} | {_ms(r['compute_s'])} | {kernel} "
            f"| {r['wire_bytes'] * MB:,.1f} / {r['paper_bytes'] * MB:,.1f} | {_ms(r.get('predicted_s'))} "
            f"| {r.get('error_rel', 0):+.0%} |"
        )
    return "\n".join(lines)


def verdict_text(v: dict) -> str:
    goal = v["median_abs_error"] <= TARGET_MEDIAN and v["worst_abs_error"] <= TARGET_WORST
    lines = [
        f"The planner against all {v['rows']} rows: median |error| **{v['median_abs_error']:.1%}**, worst "
        f"**{v['worst_abs_error']:.1%}** (goals {TARGET_MEDIAN:.0%} and {TARGET_WORST:.0%}: "
        f"{'met' if goal else 'missed'}); the measured order of strategies reproduced in "
        f"{sum(o['agrees'] for o in v['orders'].values())} of {len(v['orders'])} settings (pairs measured within "
        f"{NOISE:.0%} of each other count as ties).",
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
    lines = ["| hosts | compute (GFLOP/s a rank alone) | AdamW (ns a parameter) | unshaped link (Gbit/s on the wire) "
             "| latency a message (µs) | DeepSpeed hooks (µs a parameter) | ZeRO-3 fetch (µs a parameter) | cores |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for h, m in sorted(machines.items()):
        lines.append(
            f"| {h} | {m.peak_flops / 1e9:,.1f} | {m.adam_s * 1e9:.2f} | {m.link_bytes_s * 8 / 1e9:.2f} "
            f"| {m.hop_s * 1e6:,.0f} | {m.param_hook_s * 1e6:,.0f} | {m.fetch_s * 1e6:,.0f} | {m.cores} |"
        )
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


def results_markdown(setup, rows, machines, links, verdict_, command, loads, seconds, label: str) -> str:
    """results.md: what ran, the verdict, every row, the calibrated machine."""
    names = ", ".join(s.name for s in setup.strategies)
    return f"""# Shaped simulated hosts: {names}

{label}

{", ".join(map(str, setup.hosts))} simulated hosts (scripts/multinode_sim.sh: network namespaces behind a bridge,
one rank each, `OMP_NUM_THREADS=1`, sharing this machine's {os.cpu_count()} cores), links shaped with `tc tbf`
on both ends of each host's link to {", ".join(setup.rates)} (`off`: unshaped). Preset `{setup.preset}`
`{setup.trainer_args}`, sequence {setup.max_seq_len}, micro batch {setup.batch_size}, fp32, gloo. One launch
per strategy and host count; {setup.warmup_steps} warm-up steps, then windows of {setup.window_steps} measured
steps (the one after each change left out) at the rates {" -> ".join(setup.schedule())}; every step probed.
Medians over the steps of each rate. Load (1-minute average) at the start and end: {loads[0]:.1f},
{loads[-1]:.1f}; {seconds / 60:.1f} minutes in all.

`{command}`

{verdict_text(verdict_)}

Step time and its split (mean rank's communication wait, and the rest: compute and DeepSpeed's own work),
the bytes a rank sent per step as the kernel counted them on its interface beside the comm record's wire
figure and the ZeRO paper's count, and the planner's prediction (`scripts/plan_memory.py --calibration
machine_h<N>.json --link_gbit R --ranks_per_host 1 ...`):

{rows_table(rows)}

The planner's machine, calibrated once per host count (llama_train/bench/cluster_report.py: one rank alone
for compute and AdamW, the link probe for the unshaped links and a message's latency, 1-rank ZeRO-2/3
against DDP for DeepSpeed's Python costs), never from a row above:

{machines_text(machines)}

Bytes a rank's interface sent per byte of a collective's tensor, counted by the kernel in the link probe
(llama_train/bench/linkprobe.py: 16 MiB of fp32, 5 calls; `broadcast`: one from each rank in turn, as
ds_cpu gathers ZeRO-1/2's parameters), beside what the comm record counts:

{sent_text(links)}

![step time against link rate](link_rates.png)
"""
