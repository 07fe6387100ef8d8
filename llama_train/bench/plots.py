"""The benchmark's figures: throughput by strategy, model state per rank against the ZeRO paper,
and where each rank's step time goes. matplotlib is imported when a figure is drawn (Agg: no display needed)."""

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, footer: str):
    """Written with the machine, date and commit it was measured on, bottom right."""
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.text(0.99, 0.01, footer, ha="right", va="bottom", fontsize=7, color="#555555")
    fig.savefig(path, dpi=110)


def plot_throughput(summary: list[dict], path: Path, footer: str = ""):
    """Tokens/s by strategy, one bar per world size; a failed configuration has no bar."""
    plt = _pyplot()
    names = list(dict.fromkeys(s["strategy"] for s in summary))
    worlds = sorted({s["world_size"] for s in summary})
    width = 0.8 / len(worlds)
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 4))
    for j, world in enumerate(worlds):
        by_name = {s["strategy"]: s["tokens_per_s"] for s in summary if s["world_size"] == world}
        xs = [i + (j - (len(worlds) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [by_name.get(n) or 0 for n in names], width, label=f"{world} rank(s)")
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title("Throughput by strategy (median of repeats)")
    ax.legend()
    _save(fig, path, footer)
    plt.close(fig)


def plot_memory(summary: list[dict], path: Path, footer: str = ""):
    """Model-state bytes per rank, measured vs the ZeRO paper, one panel per world size."""
    plt = _pyplot()
    worlds = sorted({s["world_size"] for s in summary})
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        rows = [s for s in summary if s["world_size"] == world]
        xs = range(len(rows))
        for offset, key, label in (
            (-0.2, "model_state_bytes", "measured"),
            (0.2, "expected_model_state_bytes", "ZeRO paper"),
        ):
            ax.bar([x + offset for x in xs], [(s[key] or 0) / 2**20 for s in rows], 0.4, label=label)
        ax.set_xticks(list(xs), [s["strategy"] for s in rows], rotation=20)
        ax.set_ylabel("model state per rank (MiB)")
        ax.set_title(f"Params + grads + optimizer state, {world} rank(s)")
        ax.legend()
    _save(fig, path, footer)
    plt.close(fig)


PHASE_COLORS = {  # timing.PHASES, in stacking order
    "data": "#9e9e9e", "forward": "#4c72b0", "backward": "#55a868", "comm_wait": "#c44e52",
    "optimizer": "#dd8452", "other": "#ccb974",
}  # fmt: skip


def plot_timing(summary: list[dict], path: Path, footer: str = ""):
    """A stacked bar per rank per strategy: milliseconds of data wait, forward, backward,
    communication wait, optimizer and other (means over the timed steps), one panel per world size."""
    plt = _pyplot()
    worlds = sorted({s["world_size"] for s in summary})
    fig, axes = plt.subplots(1, len(worlds), figsize=(1.2 * len(summary) + 3, 4.5), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        rows = [s for s in summary if s["world_size"] == world]
        width = 0.8 / world
        for i, s in enumerate(rows):
            for rank, split in enumerate(s.get("time_split_per_rank") or []):
                x, bottom = i + (rank - (world - 1) / 2) * width, 0.0
                for phase, color in PHASE_COLORS.items():
                    value = split[f"{phase}_s"] * 1000
                    label = phase.replace("_", " ") if i == rank == 0 else None
                    ax.bar(x, value, width * 0.9, bottom=bottom, color=color, label=label)
                    bottom += value
        ax.set_xticks(range(len(rows)), [s["strategy"] for s in rows], rotation=20)
        ax.set_ylabel("ms per step (mean over the timed steps)")
        ax.set_title(f"Where a step goes, one bar per rank, {world} rank(s)")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.15)  # room for the legend above the bars
        ax.legend(fontsize=8, ncol=len(PHASE_COLORS), loc="upper left")
    _save(fig, path, footer)
    plt.close(fig)


def plot_link_rates(rows: list[dict], curves: dict, path: Path, footer: str = ""):
    """Step time against the link rate, a panel per host count: each strategy's measured medians (bars:
    its fastest and slowest step) and the planner's line; the unshaped links at the right, marked."""
    plt = _pyplot()
    hosts = sorted({r["hosts"] for r in rows})
    fig, axes = plt.subplots(1, len(hosts), figsize=(6.5 * len(hosts), 4.5), squeeze=False)
    for ax, h in zip(axes[0], hosts):
        for i, name in enumerate(name for hh, name in curves if hh == h):
            line, color = curves[(h, name)], f"C{i}"
            ax.plot([x for x, _ in line], [y * 1000 for _, y in line], "-", color=color, alpha=0.6)
            mine = [r for r in rows if r["hosts"] == h and r["strategy"] == name and not r.get("error")]
            xs = [r["gbit"] for r in mine]
            ys = [r["step_time_s"] * 1000 for r in mine]
            lo = [y - r["step_time_range_s"][0] * 1000 for y, r in zip(ys, mine)]
            hi = [r["step_time_range_s"][1] * 1000 - y for y, r in zip(ys, mine)]
            ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", color=color, label=name, capsize=3)
        unshaped = [r["gbit"] for r in rows if r["hosts"] == h and r["rate"] == "off"]
        if unshaped:
            ax.axvline(unshaped[0], color="#999999", linestyle=":", linewidth=1)
            ax.text(unshaped[0], ax.get_ylim()[1] * 0.97, " unshaped", fontsize=8, va="top", color="#555555")
        ax.set_xscale("log")
        ticks = sorted({round(r["gbit"], 2) for r in rows if r["hosts"] == h and not r.get("error")})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("link rate per host (Gbit/s on the wire)")
        ax.set_ylabel("ms per step")
        ax.set_title(f"{h} simulated hosts, one rank each: measured (points), planner (lines)")
        ax.legend(fontsize=8)
    _save(fig, path, footer)
    plt.close(fig)
