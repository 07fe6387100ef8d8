"""One row per configuration (strategy, world size): the medians of its runs, MFU against one
peak per world size, ratios to DDP and to the ZeRO paper, and why memory differs from the paper."""

import statistics

from llama_train.bench.gaps import explain_comm_gap, explain_gap, load_config, row_sharding
from llama_train.bench.matrix import Entry
from llama_train.model import ModelArgs
from llama_train.plan.planner import Workload, plan_rank

# fields of a run that are medians over repeats in the summary row
NUMERIC = (
    "tokens_per_s", "tokens_per_s_per_device", "step_time_s", "mfu", "final_loss", "peak_mem_bytes",
    "model_state_bytes", "wall_s", "load_1m", "comm_bytes",
)  # fmt: skip


def median_run(runs: list[dict]) -> dict:
    """The summary of one configuration's runs: medians of the numbers over the runs that worked;
    `error` when any failed (all numbers None when none worked)."""
    ok = [r for r in runs if not r.get("error")]
    errors = [f"run {r['repeat'] + 1}: {r['error']}" for r in runs if r.get("error")]
    out = {"strategy": runs[0]["strategy"], "world_size": runs[0]["world_size"], "runs": len(ok)}
    if ok:
        # the non-median fields (breakdown, per-rank lists) come from the run with the median step time
        mid = sorted(ok, key=lambda r: r["step_time_s"])[(len(ok) - 1) // 2]
        out.update({k: v for k, v in mid.items() if k not in ("repeat", "error")})
        out.update({k: statistics.median(r[k] for r in ok) for k in NUMERIC})
        out["step_time_s_runs"] = [r["step_time_s"] for r in ok]
        costs = [r["probe_cost"] for r in ok if r.get("probe_cost") is not None]
        out["probe_cost"] = statistics.median(costs) if costs else None
    else:
        out.update(dict.fromkeys(NUMERIC + ("expected_model_state_bytes",)))
    out["error"] = f"{len(errors)}/{len(runs)} runs failed; " + "\n".join(errors) if errors else None
    return out


def set_mfu(rows: list[dict]):
    """MFU of each run against one peak per world size: the median of the peaks its runs measured.
    On CPU each run times a matmul at start-up, under whatever else runs then; one shared peak
    keeps the strategies' MFU comparable (it is the same machine and thread count)."""
    for world in {r["world_size"] for r in rows}:
        ok = [r for r in rows if r["world_size"] == world and not r.get("error")]
        if ok:
            peak = statistics.median(r["peak_flops"] for r in ok)
            for r in ok:
                r["mfu"] = r["tokens_per_s"] * r["flops_per_token"] / (peak * world)
                r["mfu_peak_flops"] = peak


def summarize(rows: list[dict], strategies: list[Entry]) -> list[dict]:
    """One row per (strategy, world size), in the order asked for, with ratios to DDP and to the
    ZeRO paper's model-state bytes."""
    set_mfu(rows)
    order = {s.name: i for i, s in enumerate(strategies)}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["world_size"], order[r["strategy"]], r["strategy"]), []).append(r)
    summary = [median_run(runs) for _, runs in sorted(groups.items(), key=lambda kv: kv[0][:2])]
    configs = {s.name: s.ds_config for s in strategies}
    flags = {s.name: list(s.flags) for s in strategies}
    ddp = {s["world_size"]: s for s in summary if s["strategy"] == "ddp"}
    for s in summary:
        base = (ddp.get(s["world_size"]) or {}).get("step_time_s")
        s["step_time_vs_ddp"] = s["step_time_s"] / base if base and s["step_time_s"] else None
        s["loss_diff_vs_ddp"] = loss_divergence(
            s.get("losses"), (ddp.get(s["world_size"]) or {}).get("losses")
        )
        measured, expected = s["model_state_bytes"], s["expected_model_state_bytes"]
        s["state_vs_expected"] = measured / expected if measured and expected else None
        s["trainer_flags"] = flags[s["strategy"]]  # with the config: the strategy (gaps.row_sharding)
        config = load_config(configs[s["strategy"]], s)
        s["gap_explanation"] = explain_gap(s, config)
        explain_comm_and_plan(s, config)
    return summary


def loss_divergence(losses: list[float] | None, reference: list[float] | None) -> float | None:
    """The largest relative difference |loss - DDP's| / |DDP's| over the steps both runs logged (the
    same model, data and global batch: the strategies should compute the same losses); None without
    a DDP run at this world size."""
    if not losses or not reference:
        return None
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def explain_comm_and_plan(s: dict, config: dict):
    """Communication against the paper (and why it differs), and the planner's peak memory for the
    run's model, batch and strategy (llama_train/plan/planner.py) against the measured peak."""
    measured, expected = s.get("comm_bytes"), s.get("expected_comm_bytes")
    s["comm_vs_paper"] = measured / expected if measured is not None and expected else None
    s["comm_explanation"] = explain_comm_gap(s, config) if s.get("runs") else None
    s["plan"] = s["planned_peak_mem_bytes"] = s["planned_vs_measured"] = None
    split = s.get("layout") or {}
    if (
        split.get("tp", 1) * split.get("sp", 1) * split.get("pp", 1) > 1
    ):  # the paper and planner: data parallel
        s["comm_vs_paper"] = None
        s["comm_explanation"] = (
            "model parallel: its own collectives (TP all-reduces, Ulysses all-to-alls, pipeline sends) are "
            "outside the ZeRO paper's data-parallel count, and the planner does not model them"
        )
        return
    if not s.get("runs") or not s.get("model"):
        return
    args, model = s["run_args"], ModelArgs(**s["model"])
    device = "gpu" if str(s.get("device", "cpu")).startswith("cuda") else "cpu"
    work = Workload(
        model,
        s["world_size"],
        args["batch_size"],
        args["max_seq_len"],
        s["dtype"],
        args["accumulation_steps"],
        device,
        optimizer=args.get("optimizer") or "adamw",
    )
    s["plan"] = plan_rank(row_sharding(s, config), work)  # bench/advice.py ranks these
    s["planned_peak_mem_bytes"] = s["plan"]["total_bytes"]
    s["planned_vs_measured"] = s["peak_mem_bytes"] / s["planned_peak_mem_bytes"]
