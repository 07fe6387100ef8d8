"""A benchmark's outputs: results.json (summary rows, each with its runs), results.csv, results.md
(the setup, the command that reproduces it, the table, memory gaps, errors) and the plots."""

import csv
import json
import os
import shlex
import statistics
from pathlib import Path

from llama_train.bench.breakdown import PARTS
from llama_train.bench.gaps import GAP_TOLERANCE
from llama_train.bench.matrix import Setup
from llama_train.bench.plots import plot_memory, plot_throughput, plot_timing
from llama_train.planner import STRATEGIES

# the collectives the table has a column for (reduce counts with reduce-scatter, as in the paper)
COMM_COLUMNS = {"all_reduce": ("all_reduce",), "reduce_scatter": ("reduce_scatter", "reduce"),
                "all_gather": ("all_gather",), "broadcast": ("broadcast",)}  # fmt: skip
CSV_FIELDS = (
    "strategy", "world_size", "runs", "tokens_per_s", "tokens_per_s_per_device", "step_time_s",
    "step_time_vs_ddp", "mfu", "final_loss", "peak_mem_bytes", "planned_peak_mem_bytes", "planned_vs_measured",
    "model_state_bytes", "expected_model_state_bytes", "state_vs_expected", "comm_bytes", "expected_comm_bytes",
    "comm_vs_paper", *(f"{op}_bytes" for op in COMM_COLUMNS), *PARTS, "slowest_rank", "zero_stage", "dtype",
    "num_params", "wall_s", "load_1m", "gap_explanation", "comm_explanation", "error",
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
    """The results table, where a step's time goes, then why memory and communication differ from
    the ZeRO paper, and the errors of failed runs."""
    head = (
        "| strategy | ranks | tokens/s | tokens/s/rank | step (ms) | vs DDP | MFU | final loss "
        "| peak mem/rank (MiB) | planned (MiB) | model state/rank (MiB) | ZeRO paper (MiB) | measured/paper "
        "| comm/step (MiB) | ZeRO paper (MiB) | measured/paper |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    mib = 1 / 2**20
    for s in summary:
        cells = [
            s["strategy"], str(s["world_size"]), _fmt(s["tokens_per_s"], ",.0f"),
            _fmt(s["tokens_per_s_per_device"], ",.0f"), _fmt(s["step_time_s"], ",.0f", 1000),
            _ratio(s["step_time_vs_ddp"]), _fmt(s["mfu"], ".1%"), _fmt(s["final_loss"], ".3f"),
            _fmt(s["peak_mem_bytes"], ",.0f", mib), _fmt(s.get("planned_peak_mem_bytes"), ",.0f", mib),
            _fmt(s["model_state_bytes"], ",.0f", mib), _fmt(s["expected_model_state_bytes"], ",.0f", mib),
            _ratio(s["state_vs_expected"]), _fmt(s.get("comm_bytes"), ",.1f", mib),
            _fmt(s.get("expected_comm_bytes"), ",.1f", mib), _ratio(s.get("comm_vs_paper")),
        ]  # fmt: skip
        if s["error"] and not s["runs"]:
            cells[2] = "**failed**"
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines) + "\n\n" + time_split_table(summary)
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
    if errors:
        out += "\n\nFailed:\n\n" + "\n".join(e.replace("\n", "\n  ") for e in errors)
    return out


def _ratio(value) -> str:
    return _fmt(value, ".2f") + ("x" if value else "")


def time_split_table(summary: list[dict]) -> str:
    """Each configuration's slowest rank: milliseconds per phase of a step (means over the timed
    steps), their sum, and the mean step time of the same steps' train records (measured apart)."""
    head = "| strategy | ranks | slowest rank | " + " | ".join(
        p.removesuffix("_s").replace("_", " ") for p in PARTS
    )
    lines = [
        "Where a step's time goes, on the slowest rank (ms, means over the timed steps of the median run;"
        " `step`: the same steps' train records):",
        "",
        head + " | sum | step |",
        "|" + "---|" * (len(PARTS) + 5),
    ]
    for s in summary:
        split = s.get("time_split")
        if not split:
            continue
        parts = [_fmt(split[p], ",.1f", 1000) for p in PARTS]
        total = _fmt(sum(split[p] for p in PARTS), ",.1f", 1000)
        lines.append(
            f"| {s['strategy']} | {s['world_size']} | {s['slowest_rank']} | " + " | ".join(parts)
            + f" | {total} | {_fmt(s.get('mean_step_time_s'), ',.1f', 1000)} |"
        )  # fmt: skip
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
        s.name if s.ds_config == STRATEGIES.get(s.name) else f"{s.name}={s.ds_config}"
        for s in setup.strategies
    )
    return (
        f"python scripts/benchmark.py --strategies {names} --world_sizes {','.join(map(str, setup.world_sizes))} "
        f"--preset {setup.preset} --steps {setup.steps} --warmup_steps {setup.warmup_steps} --repeats {setup.repeats} "
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
        f"{setup.warmup_steps} not timed, median step time per run; median of {setup.repeats} interleaved runs. "
        f"MFU against the median of the runs' peaks: {mfu or 'none'}. Machine load (1-minute average) at run "
        f"starts: median {statistics.median(loads):.1f}, max {max(loads):.1f}, on {os.cpu_count()} cores.\n\n"
        f"`{reproduce_command(setup)}`"
    )


def write_outputs(rows: list[dict], summary: list[dict], setup: Setup) -> str:
    """results.json (summary rows, each with its runs), results.csv, results.md, the plots; returns
    the table that results.md ends with."""
    out = Path(setup.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for s in summary:
        s["repeats"] = [
            r for r in rows if (r["strategy"], r["world_size"]) == (s["strategy"], s["world_size"])
        ]
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_csv(summary, out / "results.csv")
    table = markdown_table(summary)
    (out / "results.md").write_text(describe_setup(rows, setup) + "\n\n" + table + "\n")
    plot_throughput(summary, out / "throughput.png")
    plot_memory(summary, out / "memory.png")
    plot_timing(summary, out / "timing.png")
    return table
