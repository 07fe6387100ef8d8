"""Which to pick: the planner's ranking for the benchmark's own workload (llama_train/plan/planner.py:
what fits this machine's memory, cheapest expected step first, as `scripts/plan_memory.py
--recommend` prints it) checked against the step times the benchmark measured."""

import os

from llama_train.plan.planner import GiB, advice, with_ranks

NOISE = 0.05  # measured step times this close count as equal (this VM's run-to-run spread is larger)


def device_memory_bytes(device: str, world: int) -> float:
    """Memory per rank: the GPU's (all ranks alike), or on CPU this machine's RAM shared by its ranks."""
    if device.startswith("cuda"):
        import torch

        return float(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world


def spearman(a: list[str], b: list[str]) -> float | None:
    """Rank correlation of two orders of the same names (1: the same order, -1: reversed)."""
    n = len(a)
    if n < 2 or set(a) != set(b):
        return None
    where = {name: i for i, name in enumerate(b)}
    d2 = sum((i - where[name]) ** 2 for i, name in enumerate(a))
    return 1 - 6 * d2 / (n * (n * n - 1))


def verdict(pick: dict, fastest: dict) -> tuple[bool, str]:
    """Whether the planner's pick is (within NOISE of) the measured fastest, in words."""
    name, ms = pick["strategy"], pick["step_time_s"] * 1000
    if pick is fastest:
        return True, f"The planner's pick, {name}, measured fastest ({ms:,.0f} ms a step): **they agree**."
    slower = pick["step_time_s"] / fastest["step_time_s"] - 1
    agree = slower <= NOISE
    return agree, (
        f"The planner's pick, {name} ({ms:,.0f} ms a step), measured {slower:.1%} slower than the fastest, "
        f"{fastest['strategy']} ({fastest['step_time_s'] * 1000:,.0f} ms): "
        + (f"within {NOISE:.0%}, **they agree**." if agree else "**they disagree**.")
    )


def check_world(rows: list[dict], world: int) -> list[str]:
    """One world size's ranking, the measured order, and the verdict; sets each row's `planner_rank`,
    `measured_rank` and `pick_agrees`."""
    memory = device_memory_bytes(str(rows[0].get("device", "cpu")), world)
    plans = with_ranks([{**r["plan"], "fits": r["plan"]["total_bytes"] <= memory} for r in rows])
    by_name = {r["strategy"]: r for r in rows}
    measured = sorted(rows, key=lambda r: r["step_time_s"])
    for i, r in enumerate(measured, 1):
        r["measured_rank"], r["planner_rank"] = (
            i,
            next(p["rank"] for p in plans if p["strategy"] == r["strategy"]),
        )
    order = [p["strategy"] for p in sorted((p for p in plans if p["rank"]), key=lambda p: p["rank"])]
    where = (
        "the GPU's"
        if str(rows[0].get("device")).startswith("cuda")
        else "this machine's memory over its ranks"
    )
    lines = [
        f"{world} rank(s), {memory / GiB:,.1f} GiB a rank ({where}); `scripts/plan_memory.py --recommend` for "
        "this workload ranks:",
        "",
        *advice(plans, memory),
        "",
        "Measured, fastest first: "
        + ", ".join(f"{r['strategy']} {r['step_time_s'] * 1000:,.0f} ms" for r in measured)
        + ".",
    ]
    if order:
        agree, text = verdict(by_name[order[0]], measured[0])
        rho = spearman(order, [r["strategy"] for r in measured if r["strategy"] in order])
        for r in rows:
            r["pick_agrees"] = agree
        lines += [
            "",
            text + (f" Rank correlation of the two orders (Spearman): {rho:.2f}." if rho is not None else ""),
        ]
    return lines


def check_recommendation(summary: list[dict]) -> str:
    """Markdown: per world size, the planner's ranking for the measured workload against the measured
    step times. Rows it cannot plan (model parallel, failed runs) and the compiled twins (the planner
    has no --compile) are left out."""
    out = []
    for world in sorted({s["world_size"] for s in summary}):
        rows = [
            s for s in summary
            if s["world_size"] == world and s.get("plan") and not s["error"]
            and "--compile" not in s.get("trainer_flags", ())
        ]  # fmt: skip
        if len(rows) >= 2:
            out += check_world(rows, world) + [""]
    if not out:
        return ""
    return "Which to pick: the planner's ranking against what was measured\n\n" + "\n".join(out).rstrip()
