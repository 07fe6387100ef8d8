"""`make bench-gpu` (scripts/bench_gpu.py): the project's GPU benchmark on one GPU, within a fixed
time budget. The strategies at 125m and 1b, each with tok/s, MFU, peak memory, step time and its split,
and an A/B table of the speed changes, each alone against its base row. Under --tiny the same rows
run on the debug and tiny presets in fp32, on CPU: that is its test.

Rows run in priority order, the goals' rows first. A row starts only when its expected wall time (its
own earlier run, else the median of the rows of its size and kind so far, else a prior; a compiled
row's includes its compilation) and a margin fit in what is left of the budget; otherwise, or when
the budget ends while it runs, it is reported as skipped, not failed. With budget left, a second pass
runs every row that worked again, in the same order: each row's step time is the median of its runs,
with their spread.

Step times are what a run gets: rows log every few steps (SIZES), so only log steps wait for the
device; each logged window's mean over its unprobed steps is one sample. No row writes a final
checkpoint (--no_final_checkpoint).
"""

import json
import shlex
import statistics
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from llama_train.bench.matrix import Entry, Setup
from llama_train.bench.runs import run_one
from llama_train.bench.summary import set_mfu
from llama_train.config import PROBE_INTERVAL
from llama_train.distributed.strategies import STRATEGIES
from llama_train.model import preset
from llama_train.plan.planner import ROOT


@dataclass(frozen=True)
class Size:
    preset: str
    batch: int  # micro batch
    seq: int
    accumulation: int  # micro-batches per optimizer step
    steps: int  # optimizer steps, warm-up included
    warmup: int  # first steps left out of the timing
    log_every: int  # --log_interval: steps between the host's waits for the device (one timed window each)


# 1b at the anchors' setting (TinyLlama, llm-foundry's MPT-1b: 0.5-4M tokens a step): 8 x 2048 x 4 =
# 65,536 tokens an optimizer step, so ZeRO-2's update (about 25 ms over 1.1B parameters) is amortised;
# "1b zero2 at 4 x 2048" keeps the earlier 8,192-token step beside it. --tiny: the CPU test's sizes.
SIZES = {"125m": Size("125m", 8, 1024, 1, 30, 5, 5), "1b": Size("1b", 8, 2048, 4, 12, 4, 2)}
TINY = {"125m": Size("debug", 2, 32, 1, 6, 2, 2), "1b": Size("tiny", 2, 32, 2, 6, 2, 2)}
PRIOR_S = {"125m": 45.0, "1b": 90.0}  # a row's wall time before one of its size has run (start-up included)
COMPILE_S = {"125m": 60.0, "1b": 90.0}  # what --compile adds to it, cold: compilation and the eval recompile
MARGIN_S = 30.0  # a row starts only if its expected time and this fit in what is left of the budget
PASSES = 2  # passes over the rows; the second repeats the rows that worked while the budget lasts


@dataclass(frozen=True)
class Row:
    name: str  # the row's name in the tables
    size: str  # "125m" or "1b" (SIZES)
    strategy: str  # a strategy record's name (distributed/strategies.py)
    flags: tuple[str, ...] = ()  # trainer flags on top of the strategy's
    config: dict = field(default_factory=dict)  # dotted ds_config key -> value (a callable of ModelArgs)
    base: str | None = None  # A/B: the row this one is compared with

    @property
    def compiled(self) -> bool:
        return "--compile" in self.flags


def dim_squared(margs) -> int:
    return margs.dim * margs.dim


PROFILE = ("--profile", "--profile_interval", "2")  # a trace of step 2 (warm-up): SDPA's kernels, the rest
ROWS = [
    # the goals' rows first (gpu_report.GOALS): what a short window must measure
    Row("zero2", "125m", "zero2"),
    Row("ddp", "125m", "ddp"),
    Row("1b zero2", "1b", "zero2", PROFILE),
    Row("ddp with --compile", "125m", "ddp", ("--compile",), base="ddp"),
    Row("1b zero2 with --compile", "1b", "zero2", ("--compile",), base="1b zero2"),
    # the 1b step of earlier benches (8,192 tokens, no accumulation), beside the anchors' setting
    Row(
        "1b zero2 at 4 x 2048",
        "1b",
        "zero2",
        ("--batch_size", "4", "--accumulation_steps", "1"),
        base="1b zero2",
    ),  # fmt: skip
    Row("zero1", "125m", "zero1"),
    Row("zero3", "125m", "zero3"),
    Row("fsdp2", "125m", "fsdp2"),
    Row("1b ddp", "1b", "ddp"),
    Row("1b fsdp2", "1b", "fsdp2"),
    Row("zero2 with probe every step", "125m", "zero2", ("--probe_interval", "1"), base="zero2"),
    Row("ddp with probe every step", "125m", "ddp", ("--probe_interval", "1"), base="ddp"),
    Row(
        "zero2 with dim² buckets",
        "125m",
        "zero2",
        config={"zero_optimization.reduce_bucket_size": dim_squared},
        base="zero2",
    ),  # fmt: skip
    Row(
        "zero2 with overlap_comm",
        "125m",
        "zero2",
        config={"zero_optimization.overlap_comm": True},
        base="zero2",
    ),
    Row(
        "zero2 with throughput timer",
        "125m",
        "zero2",
        config={"timers.throughput.enabled": True},
        base="zero2",
    ),
    Row(
        "zero2 with bf16 overflow scan",
        "125m",
        "zero2",
        config={"bf16.check_grad_overflow": True},
        base="zero2",
    ),
    Row(
        "1b zero2 with every other block recomputed",
        "1b",
        "zero2",
        ("--gradient_checkpointing", "--checkpoint_every", "2"),
        base="1b zero2",
    ),  # fmt: skip
    Row(
        "1b zero2 with every block recomputed", "1b", "zero2", ("--gradient_checkpointing",), base="1b zero2"
    ),
]


def variant_config(row: Row, margs, out: Path) -> str | None:
    """The row's DeepSpeed config: the strategy's, or a copy with the row's keys set (written to
    out/configs/); None for the DDP trainer."""
    path = STRATEGIES[row.strategy].ds_config
    if not path or not row.config:
        return path
    config = json.loads((ROOT / path).read_text())
    for dotted, value in row.config.items():
        *parents, key = dotted.split(".")
        node = config
        for p in parents:
            node = node.setdefault(p, {})
        node[key] = value(margs) if callable(value) else value
    target = out / "configs" / f"{slug(row.name)}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(config, indent=2) + "\n")
    return str(target)


def slug(name: str) -> str:
    """A row's name as a file name: 'zero2 with dim² buckets' -> 'zero2_with_dim2_buckets'."""
    kept = "".join(c if c.isascii() and c.isalnum() else "2" if c == "²" else "_" for c in name.lower())
    return "_".join(filter(None, kept.split("_")))


def row_setup(row: Row, base: Setup, tiny: bool) -> tuple[Entry, Setup]:
    """The launch of one row: its strategy (config and flags) and the shared settings at its size."""
    size = (TINY if tiny else SIZES)[row.size]
    setup = replace(
        base, preset=size.preset, batch_size=size.batch, max_seq_len=size.seq, accumulation_steps=size.accumulation,
        steps=size.steps, warmup_steps=size.warmup, log_interval=size.log_every, probe_interval=PROBE_INTERVAL,
        trainer_args=shlex.join(row.flags),  # last: they win
    )  # fmt: skip
    margs = preset(size.preset, max_seq_len=size.seq)
    config = variant_config(row, margs, Path(base.output_dir))
    return Entry(slug(row.name), config, flags=STRATEGIES[row.strategy].flags), setup


def expected_s(row: Row, done: list[dict]) -> float:
    """The wall time `row` is expected to take: its own earlier run's, else the median of the runs of its
    size and kind (compiled or not) so far, else those of its size plus the compile prior, else priors."""
    walls = [r for r in done if "wall_s" in r and not r.get("error")]
    own = [r["wall_s"] for r in walls if r["strategy"] == row.name]
    if own:
        return statistics.median(own)
    size = [r for r in walls if r["size"] == row.size]
    kind = [r["wall_s"] for r in size if ("--compile" in r["flags"]) == row.compiled]
    if kind:
        return statistics.median(kind)
    eager = [r["wall_s"] for r in size if "--compile" not in r["flags"]]
    return (statistics.median(eager) if eager else PRIOR_S[row.size]) + (
        COMPILE_S[row.size] if row.compiled else 0
    )


def run_row(row: Row, base: Setup, tiny: bool, repeat: int, left: float, run=run_one) -> dict:
    """One run of `row`, killed when the budget ends (`left` seconds from now): then reported skipped."""
    strategy, setup = row_setup(row, base, tiny)
    setup = replace(setup, timeout=max(1, int(min(setup.timeout, left))))
    result = run(strategy, 1, repeat, setup)
    out = {**result, "strategy": row.name, "size": row.size, "base": row.base, "flags": [*strategy.flags, *row.flags],
           "preset": setup.preset, "run_dir": f"runs/{strategy.name}_w1_r{repeat}"}  # fmt: skip
    if out.get("error") and setup.timeout < base.timeout and out.get("wall_s", 0) >= setup.timeout - 1:
        out["error"] = f"skipped: the budget ended {setup.timeout} s into it"
    return out


def run_rows(rows: list[Row], base: Setup, tiny: bool, budget_s: float, say=print, run=run_one, on_row=None,
             clock=time.perf_counter, passes: int = PASSES) -> list[dict]:  # fmt: skip
    """The rows in order while the budget allows, then again (the ones that worked) while it still does;
    every run, in the order it ran. `on_row(runs)` after each (the results files are written there)."""
    started, done = clock(), []
    for repeat in range(passes):
        ran = {r["strategy"] for r in done if not r.get("error")}
        for row in rows if repeat == 0 else [r for r in rows if r.name in ran]:
            left, expect = budget_s - (clock() - started), expected_s(row, done)
            if expect + MARGIN_S > left:
                if repeat == 0:
                    why = f"skipped: expected {expect:.0f} s + {MARGIN_S:.0f} s, {max(0.0, left):.0f} s of the {budget_s:.0f} s budget left"
                    preset = (TINY if tiny else SIZES)[row.size].preset
                    done.append({"strategy": row.name, "size": row.size, "preset": preset, "base": row.base, "error": why})  # fmt: skip
                continue
            say(f"bench-gpu: {row.name} ({(TINY if tiny else SIZES)[row.size].preset}, run {repeat + 1})")
            done.append(run_row(row, base, tiny, repeat, left, run))
            if on_row:
                on_row(done)
    return done


def failed(runs: list[dict]) -> bool:
    """Whether any run failed; a skip (the budget) is no failure."""
    return any(r.get("error") and not r["error"].startswith("skipped") for r in runs)


MERGED = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "peak_mem_bytes", "wall_s")


def merge_runs(rows: list[Row], done: list[dict]) -> list[dict]:
    """One entry per row that was asked for, in `rows` order: the medians of its runs (the other fields
    from its median run), their number and spread ((max - min) / median of the step times); or the
    row's skip or error."""
    set_mfu([r for r in done if not r.get("error")])
    out = []
    for row in rows:
        runs = [r for r in done if r["strategy"] == row.name]
        ok = [r for r in runs if not r.get("error")]
        if not ok:
            out += runs[:1]
            continue
        mid = sorted(ok, key=lambda r: r["step_time_s"])[(len(ok) - 1) // 2]
        times = [r["step_time_s"] for r in ok]
        merged = {k: statistics.median(r[k] for r in ok) for k in MERGED}
        spread = (max(times) - min(times)) / statistics.median(times) if len(ok) > 1 else None
        out.append({**mid, **merged, "runs": len(ok), "step_time_s_runs": times, "spread": spread})
    return out


def environment() -> dict:
    """The device, driver and the versions the numbers depend on. The GPU's name comes from nvidia-smi:
    asking torch would create a CUDA context in this process (about 0.5 GiB) for the whole benchmark."""
    import deepspeed
    import torch

    smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        gpus = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        gpus = ""
    visible = gpus and torch.cuda.is_available()  # is_available: a device count, no context
    return {
        "gpu": gpus or "none (nvidia-smi absent)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": deepspeed.__version__,
        "device": gpus.splitlines()[0].split(",")[0].strip() if visible else "cpu",
    }
