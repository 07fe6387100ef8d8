"""A run's communication and time split from its `comm` and `timing` records (timing.StepProbe):
medians over the timed steps, per rank, and the slowest rank."""

import statistics

from llama_train.telemetry.timing import PHASES

PARTS = tuple(f"{p}_s" for p in PHASES)


def read_comm(records: list[dict], warmup: int) -> dict:
    """Bytes per optimizer step: the median over the timed steps of the busiest rank's total, with
    that step's split by collective, next to the ZeRO paper's figure."""
    comm = [r for r in records if r["event"] == "comm" and r["step"] > warmup]
    if not comm:
        return {}
    totals = [max(r["bytes_total"]) for r in comm]
    mid = comm[sorted(range(len(comm)), key=totals.__getitem__)[(len(comm) - 1) // 2]]
    rank = max(range(len(mid["bytes_total"])), key=mid["bytes_total"].__getitem__)
    return {
        "comm_bytes": statistics.median(totals),
        "comm_bytes_by_op": mid["bytes_by_op"][rank],
        "comm_calls_by_op": mid["calls_by_op"][rank],
        "expected_comm_bytes": mid["expected_bytes"],
        "expected_comm_by_op": mid["expected_by_op"],
        "comm_backend": mid["backend"],
    }


def read_timing(records: list[dict], warmup: int) -> dict:
    """Seconds per phase, per rank (means over the probed steps, so that the parts add up to the mean
    probed step), the slowest rank (the one that worked longest: its step time less its communication
    wait) and its split; the probed steps' mean wall time on rank 0's clock (what the parts split);
    per-rank peak memory at the last probed step."""
    timing = [r for r in records if r["event"] == "timing" and r["step"] > warmup]
    if not timing:
        return {}
    world = len(timing[0]["step_time_s"])
    per_rank = [
        {k: statistics.fmean(r[k][rank] for r in timing) for k in (*PARTS, "step_time_s")}
        for rank in range(world)
    ]
    wall = [r["wall_s"] for r in timing]
    busy = [p["step_time_s"] - p["comm_wait_s"] for p in per_rank]
    slowest = max(range(world), key=busy.__getitem__)
    return {
        "time_split": per_rank[slowest],
        "time_split_per_rank": per_rank,
        "slowest_rank": slowest,
        "mean_step_time_s": statistics.fmean(wall),
        "peak_mem_bytes_per_rank": timing[-1].get("peak_mem_bytes"),
    }


def probe_cost(records: list[dict], warmup: int) -> float | None:
    """What probing adds to a step: the median over the probed steps after warm-up of the step's wall
    time (the probe's record-keeping included) against the mean of its unprobed neighbours (steps
    s - 1 and s + 1, each its own train record: --log_interval 1). Pairs of adjacent steps see the same
    load on a shared machine; None without such pairs."""
    alone = {
        r["step"]: r["step_time_s"] for r in records if r["event"] == "train" and r.get("timed_steps") == 1
    }
    pairs = [
        (r["wall_s"] + r["probe_s"]) / ((alone[r["step"] - 1] + alone[r["step"] + 1]) / 2) - 1
        for r in records
        if r["event"] == "timing" and r["step"] > warmup and {r["step"] - 1, r["step"] + 1} <= alone.keys()
    ]
    return statistics.median(pairs) if pairs else None
