"""`make bench-gpu` (scripts/bench_gpu.py): the project's GPU benchmark on one GPU, within a fixed
time budget. The strategies at 125m and 1b, each with tok/s, MFU, peak memory, step time and its split,
and an A/B table of the speed changes, each alone against its base row. Under --tiny the same rows
run on the debug and tiny presets in fp32, on CPU: that is its test.

Rows run in priority order; a row whose expected wall time (the median of the rows of its size so far,
else a prior) would pass the budget is reported as skipped, so the whole fits the window it is given.
"""

import json
import shlex
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

# size -> (preset, micro batch, sequence, steps, warm-up steps); --tiny: the CPU test's
SIZES = {"125m": ("125m", 8, 1024, 20, 5), "1b": ("1b", 4, 2048, 12, 4)}
TINY = {"125m": ("debug", 2, 32, 6, 2), "1b": ("tiny", 2, 32, 6, 2)}
PRIOR_S = {"125m": 45.0, "1b": 75.0}  # a row's wall time before one of its size has run (start-up included)


@dataclass(frozen=True)
class Row:
    name: str  # the row's name in the tables
    size: str  # "125m" or "1b" (SIZES)
    strategy: str  # a strategy record's name (distributed/strategies.py)
    flags: tuple[str, ...] = ()  # trainer flags on top of the strategy's
    config: dict = field(default_factory=dict)  # dotted ds_config key -> value (a callable of ModelArgs)
    base: str | None = None  # A/B: the row this one is compared with


def dim_squared(margs) -> int:
    return margs.dim * margs.dim


PROFILE = ("--profile", "--profile_interval", "2")  # a trace of step 2 (warm-up): SDPA's kernels, the rest
ROWS = [
    Row("ddp", "125m", "ddp"),
    Row("zero2", "125m", "zero2"),
    Row("zero1", "125m", "zero1"),
    Row("zero3", "125m", "zero3"),
    Row("fsdp2", "125m", "fsdp2"),
    Row("1b zero2", "1b", "zero2", PROFILE),
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
    Row("ddp with --compile", "125m", "ddp", ("--compile",), base="ddp"),
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
    Row("1b zero2 with --compile", "1b", "zero2", ("--compile",), base="1b zero2"),
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
    name, batch, seq, steps, warmup = (TINY if tiny else SIZES)[row.size]
    setup = replace(
        base, preset=name, batch_size=batch, max_seq_len=seq, steps=steps, warmup_steps=warmup,
        probe_interval=PROBE_INTERVAL, trainer_args=shlex.join(row.flags),  # last: they win
    )  # fmt: skip
    margs = preset(name, max_seq_len=seq)
    config = variant_config(row, margs, Path(base.output_dir))
    return Entry(slug(row.name), config, flags=STRATEGIES[row.strategy].flags), setup


def run_rows(rows: list[Row], base: Setup, tiny: bool, budget_s: float, say=print) -> list[dict]:
    """Each row once, in order, while the budget allows (a row expected to end past it: skipped)."""
    started, done = time.perf_counter(), []
    for row in rows:
        took = [r["wall_s"] for r in done if r.get("size") == row.size and "wall_s" in r]
        expect = sorted(took)[len(took) // 2] if took else PRIOR_S[row.size]
        if time.perf_counter() - started + expect > budget_s:
            done.append(
                {"strategy": row.name, "size": row.size, "error": f"skipped: the {budget_s:.0f} s budget"}
            )
            continue
        strategy, setup = row_setup(row, base, tiny)
        left = budget_s - (time.perf_counter() - started)
        setup = replace(
            setup, timeout=int(max(60, min(setup.timeout, left)))
        )  # a hung run ends in the budget
        say(f"bench-gpu: {row.name} ({setup.preset})")
        result = run_one(strategy, 1, 0, setup)
        flags = [*strategy.flags, *row.flags]
        done.append({**result, "strategy": row.name, "size": row.size, "base": row.base, "flags": flags,
                     "preset": setup.preset, "run_dir": f"runs/{strategy.name}_w1_r0"})  # fmt: skip
    set_mfu([r for r in done if not r.get("error")])
    return done


def environment() -> dict:
    """The device, driver and the versions the numbers depend on."""
    import deepspeed
    import torch

    smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        gpus = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        gpus = ""
    return {
        "gpu": gpus or "none (nvidia-smi absent)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": deepspeed.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
