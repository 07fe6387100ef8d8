"""A benchmark's outputs: results.json (summary rows, each with its runs), results.csv, results.md
(the setup, the command that reproduces it, the table, memory gaps, errors) and the plots."""

import csv
import json
import os
import shlex
import statistics
from pathlib import Path

from llama_train.bench.advice import check_recommendation
from llama_train.bench.breakdown import PARTS
from llama_train.bench.gaps import GAP_TOLERANCE
from llama_train.bench.label import label_line, run_label
from llama_train.bench.matrix import Setup
from llama_train.bench.plots import plot_memory, plot_throughput, plot_timing
from llama_train.distributed.strategies import STRATEGIES
from llama_train.plan.memory import state_formula

# the collectives the table has a column for (reduce counts with reduce-scatter, as in the paper)
COMM_COLUMNS = {"all_reduce": ("all_reduce",), "reduce_scatter": ("reduce_scatter", "reduce"),
                "all_gather": ("all_gather",), "broadcast": ("broadcast",)}  # fmt: skip
CSV_FIELDS = (
    "strategy", "world_size", "runs", "tokens_per_s", "tokens_per_s_per_device", "step_time_s",
    "step_time_vs_ddp", "mfu", "final_loss", "peak_mem_bytes", "planned_peak_mem_bytes", "planned_vs_measured",
    "model_state_bytes", "expected_model_state_bytes", "state_vs_expected", "comm_bytes", "expected_comm_bytes",
    "comm_vs_paper", *(f"{op}_bytes" for op in COMM_COLUMNS), *PARTS, "slowest_rank", "zero_stage", "dtype",
    "num_params", "wall_s", "load_1m", "loss_diff_vs_ddp", "planner_rank", "measured_rank", "gap_explanation",
    "comm_explanation", "error", "machine", "date", "commit",
)  # fmt: skip


def flat_row(s: dict) -> dict:
    """A summary row with its bytes by collective and its slowest rank's time split as columns."""
    by_op = s.get("comm_bytes_by_op") or {}
    split = s.get("time_split") or {}
    out = {**s, **{part: split.get(part) for part in PARTS}}
    for column, ops in COMM_COLUMNS.items():
        out[f"{column}_bytes"] = sum(by_op.get(op, 0) for op in ops) if by_op else None
    return out


def write_csv(summary: list[dict], path: Path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(flat_row(s) for s in summary)


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, spec)


def markdown_table(summary: list[dict]) -> str:
    """The results as Markdown tables of at most 10 columns (speed and divergence; memory; bytes
    moved; where a step's time goes), then why memory and communication differ from the ZeRO paper,
    the planner's ranking against the measured step times, and the errors of failed runs."""
    out = "\n\n".join(table(summary, *spec) for spec in TABLES) + "\n\n" + time_split_table(summary)
    for title, key in (("Model state", "gap_explanation"), ("Communication", "comm_explanation")):
        gaps = [f"- **{s['strategy']} x{s['world_size']}**: {s[key]}" for s in summary if s.get(key)]
        if gaps:
            out += f"\n\n{title} more than {GAP_TOLERANCE:.0%} away from the ZeRO paper:\n\n" + "\n".join(
                gaps
            )
    errors = [f"- **{s['strategy']} x{s['world_size']}**: {s['error']}" for s in summary if s["error"]]
    if splits := split_lines(summary):
        out += (
            "\n\nModel parallel, per rank (measured model state vs the ZeRO paper on the rank's share):\n\n"
            + "\n".join(splits)
        )
    if advice := check_recommendation(summary):
        out += "\n\n" + advice
    if errors:
        out += "\n\nFailed:\n\n" + "\n".join(e.replace("\n", "\n  ") for e in errors)
    return out


MIB = 1 / 2**20
# (title, [(column, cell of a summary row)]): every table starts with strategy and ranks
TABLES = [
    (
        "Speed, and whether the strategies compute the same thing (`max loss diff vs DDP`: the largest "
        "relative difference of a step's loss from the DDP run's, over every step):",
        [
            ("tokens/s", lambda s: _fmt(s["tokens_per_s"], ",.0f")),
            ("tokens/s/rank", lambda s: _fmt(s["tokens_per_s_per_device"], ",.0f")),
            ("step (ms)", lambda s: _fmt(s["step_time_s"], ",.0f", 1000)),
            ("step time / DDP", lambda s: _ratio(s["step_time_vs_ddp"])),
            ("MFU", lambda s: _fmt(s["mfu"], ".1%")),
            ("final loss", lambda s: _fmt(s["final_loss"], ".4f")),
            ("max loss diff vs DDP", lambda s: _fmt(s.get("loss_diff_vs_ddp"), ".1e")),
        ],
    ),
    (
        "Memory per rank (MiB): the peak measured and as `scripts/plan_memory.py` plans it, model state "
        "(params, grads, optimizer state) measured and by the ZeRO paper's formula (Ψ: the parameter count):",
        [
            ("peak", lambda s: _fmt(s["peak_mem_bytes"], ",.0f", MIB)),
            ("planned peak", lambda s: _fmt(s.get("planned_peak_mem_bytes"), ",.0f", MIB)),
            ("peak / planned", lambda s: _ratio(s.get("planned_vs_measured"))),
            ("model state", lambda s: _fmt(s["model_state_bytes"], ",.0f", MIB)),
            ("formula", lambda s: state_formula(s["zero_stage"], s["dtype"]) if s.get("runs") else "—"),
            ("by formula", lambda s: _fmt(s["expected_model_state_bytes"], ",.0f", MIB)),
            ("state / formula", lambda s: _ratio(s["state_vs_expected"])),
        ],
    ),
    (
        "Bytes a rank moves per optimizer step (MiB), counted as the ZeRO paper counts (2 Psi: DDP, ZeRO-1/2; "
        "3 Psi: ZeRO-3, FSDP2), by collective:",
        [
            ("measured", lambda s: _fmt(s.get("comm_bytes"), ",.1f", MIB)),
            ("ZeRO paper", lambda s: _fmt(s.get("expected_comm_bytes"), ",.1f", MIB)),
            ("measured / paper", lambda s: _ratio(s.get("comm_vs_paper"))),
            *[
                (column.replace("_", "-"), lambda s, c=column: _fmt(flat_row(s)[f"{c}_bytes"], ",.1f", MIB))
                for column in COMM_COLUMNS
            ],
        ],
    ),
]


def table(summary: list[dict], title: str, columns: list[tuple]) -> str:
    """`title`, then a Markdown table: strategy, ranks and `columns` (a failed row says so)."""
    head = "| strategy | ranks | " + " | ".join(name for name, _ in columns) + " |"
    lines = [title, "", head, "|" + "---|" * (len(columns) + 2)]
    for s in summary:
        cells = [cell(s) for _, cell in columns]
        if s["error"] and not s["runs"]:
            cells[0] = "**failed**"
        lines.append("| " + " | ".join([s["strategy"], str(s["world_size"]), *cells]) + " |")
    return "\n".join(lines)


def _ratio(value) -> str:
    return _fmt(value, ".2f") + ("x" if value else "")


def time_split_table(summary: list[dict]) -> str:
    """Each configuration's slowest rank: milliseconds per phase of a probed step (means over the probed
    steps), their sum, and the same steps' wall time (measured apart); then what probing cost."""
    head = "| strategy | ranks | " + " | ".join(p.removesuffix("_s").replace("_", " ") for p in PARTS)
    lines = [
        "Where a step's time goes, on the slowest rank (named after the strategy; ms, means over the probed "
        "steps of the median run; `step`: the same steps' wall time, measured apart):",
        "",
        head + " | sum | step |",
        "|" + "---|" * (len(PARTS) + 4),
    ]
    for s in summary:
        split = s.get("time_split")
        if not split:
            continue
        parts = [_fmt(split[p], ",.1f", 1000) for p in PARTS]
        total = _fmt(sum(split[p] for p in PARTS), ",.1f", 1000)
        lines.append(
            f"| {s['strategy']} (rank {s['slowest_rank']}) | {s['world_size']} | " + " | ".join(parts)
            + f" | {total} | {_fmt(s.get('mean_step_time_s'), ',.1f', 1000)} |"
        )  # fmt: skip
    costs = [f"{s['strategy']} {s['probe_cost']:+.1%}" for s in summary if s.get("probe_cost") is not None]
    if costs:
        lines += ["", "What probing costs (median over the probed steps of the step's wall time against its two "
                  "unprobed neighbours', less 1): " + ", ".join(costs) + "."]  # fmt: skip
    return "\n".join(lines)


def split_lines(summary: list[dict]) -> list[str]:
    """One line per model-parallel configuration: every rank's measured model state next to the
    paper's bytes for the parameters that rank holds."""
    out = []
    for s in summary:
        layout, params = s.get("layout") or {}, s.get("params_per_rank")
        if not params or layout.get("tp", 1) * layout.get("pp", 1) == 1:
            continue
        ranks = zip(s["model_state_bytes_per_rank"], s["expected_model_state_bytes_per_rank"], params)
        cells = [
            f"rank {r}: {m / 2**20:,.1f} MiB vs {e / 2**20:,.1f} ({n:,} params)"
            for r, (m, e, n) in enumerate(ranks)
        ]
        out.append(
            f"- **{s['strategy']} x{s['world_size']}** (of {s['num_params']:,} params): " + "; ".join(cells)
        )
    return out


def reproduce_command(setup: Setup) -> str:
    """The scripts/benchmark.py line that measures this setup again."""
    names = ",".join(
        s.name
        if s.name in STRATEGIES and s.ds_config == STRATEGIES[s.name].ds_config
        else f"{s.name}={s.ds_config}"
        for s in setup.strategies
    )
    return (
        f"python scripts/benchmark.py --strategies {names} --world_sizes {','.join(map(str, setup.world_sizes))} "
        f"--preset {setup.preset} --steps {setup.steps} --warmup_steps {setup.warmup_steps} "
        f"--probe_interval {setup.probe_interval} --repeats {setup.repeats} "
        f"--max_seq_len {setup.max_seq_len} --batch_size {setup.batch_size} --accumulation_steps {setup.accumulation_steps}"
        + (f" --trainer_args={shlex.quote(setup.trainer_args)}" if setup.trainer_args else "")
    )


def describe_setup(rows: list[dict], setup: Setup) -> str:
    """What was measured, on what, under which load, and the command that reproduces it."""
    loads = [r["load_1m"] for r in rows]
    peaks = {r["world_size"]: (r["mfu_peak_flops"], r["peak_source"]) for r in rows if not r.get("error")}
    mfu = "; ".join(
        f"{w} rank(s): {p / 1e9:,.1f} GFLOP/s per rank ({src})" for w, (p, src) in sorted(peaks.items())
    )
    return (
        f"Preset `{setup.preset}`, sequence length {setup.max_seq_len}, micro batch {setup.batch_size} per rank, "
        f"accumulation {setup.accumulation_steps}, dtype {setup.dtype}; {setup.steps} steps per run, the first "
        f"{setup.warmup_steps} not timed, every {setup.probe_interval} probed for the time split and bytes, median "
        f"step time of the others per run; median of {setup.repeats} interleaved runs. "
        f"MFU against the median of the runs' peaks: {mfu or 'none'}. Machine load (1-minute average) at run "
        f"starts: median {statistics.median(loads):.1f}, max {max(loads):.1f}, on {os.cpu_count()} cores.\n\n"
        f"`{reproduce_command(setup)}`"
    )


def write_outputs(rows: list[dict], summary: list[dict], setup: Setup) -> str:
    """results.json (summary rows, each with its runs), results.csv, results.md, the plots, each
    labelled with the machine, date and commit; returns the tables that results.md ends with."""
    out = Path(setup.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    label = run_label()
    tables = markdown_table(summary)  # also each row's planner_rank / measured_rank (bench/advice.py)
    for s in summary:
        s.update(label)
        s["repeats"] = [
            r for r in rows if (r["strategy"], r["world_size"]) == (s["strategy"], s["world_size"])
        ]
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_csv(summary, out / "results.csv")
    head = f"# Benchmark: {', '.join(s.name for s in setup.strategies)}\n\n{label_line(label)}"
    (out / "results.md").write_text(f"{head}\n\n{describe_setup(rows, setup)}\n\n{tables}\n")
    footer = f"{label['machine']} | {label['date']} | {label['commit']}"
    plot_throughput(summary, out / "throughput.png", footer)
    plot_memory(summary, out / "memory.png", footer)
    plot_timing(summary, out / "timing.png", footer)
    return tables
