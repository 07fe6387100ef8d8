"""`make bench-gpu`'s results.md: the strategies, where their steps go, the A/B table of the speed
changes, the goals against what was measured, and what a profiled step spent its kernels on."""

import gzip
import json
from pathlib import Path

from llama_train.bench.breakdown import PARTS

# (row, field, comparison, bound, what): the goals the benchmark is held to on one GPU
GOALS = [
    (
        "1b zero2",
        "mfu",
        ">=",
        0.45,
        "1b ZeRO-2 bf16 MFU, 8 x 2048 x 4 tokens a step (the 1B anchors reach 42-56%)",
    ),
    ("1b zero2 with --compile", "mfu", ">=", 0.45, "1b ZeRO-2 bf16 MFU with --compile, same step"),
    ("zero2", "step_time_s:ddp", "<=", 1.15, "125m ZeRO-2 step time / DDP's"),
    ("ddp with --compile", "mfu", ">=", 0.30, "125m DDP --compile MFU"),
]
PRECISION_NOTE = (
    "DDP trains fp32 weights under bf16 autocast (an fp32 residual stream, weights cast every forward); "
    "ZeRO holds bf16 weights: the step / DDP's ratio compares precision regimes as well as engines. "
    "FSDP2 (bf16 parameters, fp32 reductions) is the engine-only comparison with ZeRO."
)
ATTENTION = ("flash", "fmha", "sdpa", "attention", "attn")  # SDPA's kernels, whichever backend it picked


def _ms(value) -> str:
    return "n/a" if value is None else f"{value * 1000:,.1f}"


def _cell(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _runs(r: dict) -> str:
    """'2 (spread 1.8%)': a row's runs and the spread of their step times, (max - min) / median."""
    spread = r.get("spread")
    return f"{r.get('runs', 1)}" + (f" (spread {spread:.1%})" if spread is not None else "")


def strategy_table(rows: list[dict]) -> str:
    """The rows without a base (the strategies): speed, MFU, memory, step time against DDP's."""
    ddp = {r["size"]: r for r in rows if r["strategy"] in ("ddp", "1b ddp") and not r.get("error")}
    lines = [
        "| row | preset | tokens/s | MFU | peak memory (GiB) | step (ms) | step / DDP's | runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("base"):
            continue
        if r.get("error"):
            lines.append(
                f"| {r['strategy']} | {r.get('preset', r['size'])} | **{r['error'].splitlines()[0]}** | | | | | |"
            )
            continue
        base = ddp.get(r["size"])
        vs = r["step_time_s"] / base["step_time_s"] if base else None
        lines.append(
            f"| {r['strategy']} | {r['preset']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | "
            f"{r['peak_mem_bytes'] / 2**30:,.2f} | {_ms(r['step_time_s'])} | {_cell(vs, '.2f')} | {_runs(r)} |"
        )
    return "\n".join(lines)


def split_table(rows: list[dict]) -> str:
    """Every row's probed-step split (ms): the same phases as `make bench`."""
    head = " | ".join(p.removesuffix("_s").replace("_", " ") for p in PARTS)
    lines = [f"| row | {head} | probed step |", "|" + "---|" * (len(PARTS) + 2)]
    for r in rows:
        split = r.get("time_split")
        if split:
            cells = " | ".join(_ms(split[p]) for p in PARTS)
            lines.append(f"| {r['strategy']} | {cells} | {_ms(r.get('mean_step_time_s'))} |")
    return "\n".join(lines)


def ab_table(rows: list[dict]) -> str:
    """Each A/B row against its base: step time, its ratio, MFU and peak memory."""
    by_name = {r["strategy"]: r for r in rows}
    lines = [
        "| change (alone) | against | step (ms) | base step (ms) | step / base | MFU | peak memory (GiB) | timed from "
        "| runs | base runs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = by_name.get(r.get("base") or "")
        if not base:
            continue
        if r.get("error") or base.get("error"):
            why = (r.get("error") or f"base: {base['error']}").splitlines()[0]
            lines.append(f"| {r['strategy']} | {base['strategy']} | **{why}** | | | | | | | |")
            continue
        lines.append(
            f"| {r['strategy']} | {base['strategy']} | {_ms(r['step_time_s'])} | {_ms(base['step_time_s'])} | "
            f"{r['step_time_s'] / base['step_time_s']:.3f} | {r['mfu']:.1%} | {r['peak_mem_bytes'] / 2**30:,.2f} "
            f"| {r.get('timed_from', '')} | {_runs(r)} | {_runs(base)} |"
        )
    return "\n".join(lines)


def goal_lines(rows: list[dict]) -> list[str]:
    """Each goal: the measured value and whether it is met (or why it could not be measured)."""
    by_name, out = {r["strategy"]: r for r in rows}, []
    for name, key, op, bound, what in GOALS:
        field, _, against = key.partition(":")
        missing = [n for n in (name, against) if n and (n not in by_name or by_name[n].get("error"))]
        if missing:
            why = by_name.get(missing[0], {}).get("error") or "row not run"
            out.append(f"- {what}: not measured ({missing[0]}: {why.splitlines()[0]})")
            continue
        r = by_name[name]
        value = r["step_time_s"] / by_name[against]["step_time_s"] if against else r[field]
        met = value >= bound if op == ">=" else value <= bound
        shown = f"{value:.1%}" if key == "mfu" else f"{value:.2f}"
        runs = "; ".join(f"{n}: {_runs(by_name[n])} run(s)" for n in (name, against) if n)
        out.append(f"- {what}: **{shown}** (goal {op} {bound:g}): {'met' if met else '**not met**'} ({runs})")
    return out


def kernel_lines(run_dir: Path, top: int = 8) -> list[str]:
    """What the profiled step's kernels (on CPU: operators) spent their time on, and SDPA's kernels."""
    traces = sorted(run_dir.glob("profile/*.json.gz"))
    if not traces:
        return [f"- no trace under {run_dir}/profile/"]
    with gzip.open(traces[0], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kind = "kernel" if any(e.get("cat") == "kernel" for e in events) else "cpu_op"
    spent: dict[str, float] = {}
    for e in events:
        if e.get("cat") == kind and "dur" in e:
            spent[e["name"]] = spent.get(e["name"], 0.0) + e["dur"]
    total = sum(spent.values()) or 1.0
    ranked = sorted(spent.items(), key=lambda kv: -kv[1])
    lines = [f"- {name[:90]}: {us / 1000:,.2f} ms, {us / total:.1%}" for name, us in ranked[:top]]
    attention = [(n, us) for n, us in ranked if any(k in n.lower() for k in ATTENTION)]
    names = "; ".join(f"{n[:80]} ({us / total:.1%})" for n, us in attention[:4]) or "none found"
    return [f"Top {kind}s of the profiled step ({traces[0].name}), by time:", "", *lines, "",
            f"Attention {kind}s (SDPA's choice): {names}"]  # fmt: skip


def time_line(timing: dict) -> str:
    """What the whole took: setup (make bench-gpu), the rows against their budget, the total."""
    return (
        f"Time: setup {timing['setup_s']:.0f} s + benchmark {timing['bench_s']:.0f} s (rows' budget "
        f"{timing['budget_s']:.0f} s) = {timing['total_s']:.0f} s."
    )


def results_markdown(rows: list[dict], env: dict, label: dict, command: str, out: Path, timing: dict) -> str:
    """results.md: what ran where, then the tables, the goals and the profile."""
    profiled = next((r for r in rows if "--profile" in r.get("flags", ()) and not r.get("error")), None)
    profile = kernel_lines(out / profiled["run_dir"]) if profiled else ["- the profiled row did not run"]
    return "\n\n".join([
        "# make bench-gpu",
        f"Machine: {label['machine']}. Date: {label['date']}. Commit: {label['commit']}.",
        f"GPU: {env['gpu']}; torch {env['torch']} (CUDA {env['cuda']}), DeepSpeed {env['deepspeed']}.",
        f"`{command}`",
        time_line(timing),
        "## Strategies, one GPU\n\n" + strategy_table(rows) + "\n\n" + PRECISION_NOTE,
        "## Where a probed step's time goes (ms)\n\n" + split_table(rows),
        "## A/B: each change alone, against its base row\n\n" + ab_table(rows),
        "## Goals\n\n" + "\n".join(goal_lines(rows)),
        f"## Profile of step 2 of {profiled['strategy'] if profiled else 'the profiled row'}\n\n" + "\n".join(profile),
    ]) + "\n"  # fmt: skip
