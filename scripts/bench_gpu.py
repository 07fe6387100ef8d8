"""The GPU benchmark (`make bench-gpu`): one command that fits a 9-minute window on one H100 or H200.

    make bench-gpu                                     # = setup (what the bench needs) + python scripts/bench_gpu.py
    python scripts/bench_gpu.py --budget_s 300 --rows ddp,zero2,"1b zero2"
    python scripts/bench_gpu.py --tiny --output_dir /tmp/bench_gpu   # on CPU, debug/tiny presets: its test

Rows, in the order they run (llama_train/bench/gpu.py ROWS), the goals' first: ZeRO-2 and DDP at 125m
(micro batch 8 x 1024), ZeRO-2 at 1b at the anchors' setting (micro batch 8 x 2048, 4 micro-batches a
step: 65,536 tokens; its step 2 profiled), DDP at 125m and ZeRO-2 at 1b with --compile; then ZeRO-2 at
1b with the earlier 4 x 2048 step, ZeRO-1, ZeRO-3 and FSDP2 at 125m, DDP and FSDP2 at 1b, and the A/B
rows, each one change against its base row: the probe on every step instead of one in 10, each of
ZeRO's speed settings reverted alone (dim² reduce buckets, overlap_comm on, DeepSpeed's throughput
timer on, the bf16 overflow scan on), and at 1b selective (every other block) and full activation
checkpointing. Each row launches the real trainer on one GPU, as `make bench` does, in bf16
(`--dtype auto`), logging every few steps (only log steps wait for the GPU) and writing no final
checkpoint; its step time is the median of its logged windows' unprobed steps after warm-up. A row
that would end past --budget_s is skipped and reported as such (a skip is not a failure); with budget
left, the rows run a second time and each row's figures are the medians of its runs, with their spread.

Writes docs/benchmarks/<date>-<gpu>-bench-gpu/ (or --output_dir), after every row (a run cut short
keeps what it measured): results.md (the strategies with tokens/s, MFU, peak memory and step time;
the time split of a probed step; the A/B table; the goals; the profiled step's top kernels and the
attention kernels SDPA picked), results.json (every row with the device, driver, torch, CUDA and
DeepSpeed versions, the commit, and every run) and runs/<row>_w1_r<k>/ (each run's command, logs and
metrics.jsonl; the profiled row's trace is summarised in results.md and deleted).
"""

import argparse
import datetime
import functools
import json
import re
import sys
import time
from pathlib import Path

from llama_train.bench.gpu import PASSES, ROWS, environment, failed, merge_runs, run_rows
from llama_train.bench.gpu_report import results_markdown
from llama_train.bench.label import run_label
from llama_train.bench.matrix import DATA_CACHE, Setup
from llama_train.cli import run_script
from llama_train.errors import ConfigError
from llama_train.plan.planner import ROOT


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--budget_s",
        type=float,
        default=420,
        help="seconds for all rows, start-ups included (default: %(default)s)",
    )
    p.add_argument(
        "--setup_s",
        type=float,
        default=0,
        help="seconds the setup before it took (make bench-gpu): in the stated total",
    )
    p.add_argument("--rows", help="comma-separated row names to run, in ROWS order (default: every row)")
    p.add_argument(
        "--passes",
        type=int,
        default=PASSES,
        help="passes over the rows while the budget lasts (default: %(default)s)",
    )
    p.add_argument("--tiny", action="store_true", help="debug/tiny presets in fp32: runs on CPU (the test)")
    p.add_argument("--output_dir", help="default: docs/benchmarks/<date>-<gpu>-bench-gpu")
    p.add_argument(
        "--data_output_path", default=str(DATA_CACHE), help="tokenizer + token cache (default: %(default)s)"
    )
    return p.parse_args(argv)


def chosen_rows(spec: str | None) -> list:
    """ROWS, or those named in --rows (an unknown name: one error naming the known ones)."""
    if not spec:
        return ROWS
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in {r.name for r in ROWS}]
    if unknown:
        raise ConfigError(f"--rows: unknown {unknown}; the rows are {[r.name for r in ROWS]}")
    return [r for r in ROWS if r.name in names]


def default_output(env: dict) -> Path:
    """docs/benchmarks/<date>-<device>-bench-gpu, as the dated result folders are named."""
    device = re.sub(r"[^a-z0-9]+", "-", env["device"].lower().removeprefix("nvidia ")).strip("-")
    today = datetime.date.today().isoformat()
    return ROOT / "docs" / "benchmarks" / f"{today}-{device}-bench-gpu"


def write_results(
    out: Path, runs: list[dict], rows: list, env: dict, label: dict, command: str, timing: dict
):
    """results.json (every run, and the rows' medians) and results.md, as they stand."""
    merged = merge_runs(rows, runs)
    out.mkdir(parents=True, exist_ok=True)
    record = {**label, **env, "command": command, **timing, "rows": merged, "runs": runs}
    (out / "results.json").write_text(json.dumps(record, indent=2))
    text = results_markdown(merged, env, label, command, out, timing)
    (out / "results.md").write_text(text)
    return merged, text


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.passes < 1 or args.budget_s <= 0:
        raise ConfigError(f"--passes must be >= 1 and --budget_s > 0, got {args.passes} and {args.budget_s}")
    start, rows, env = time.perf_counter(), chosen_rows(args.rows), environment()
    if env["device"] == "cpu" and not args.tiny:
        raise ConfigError(
            "no GPU visible: make bench-gpu measures one; --tiny checks it on CPU (small presets)"
        )
    out = Path(args.output_dir) if args.output_dir else default_output(env)
    setup = Setup(output_dir=str(out), data_output_path=args.data_output_path, dtype="auto", repeats=1)
    label = run_label()
    command = ("python scripts/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()

    def timing() -> dict:
        took = time.perf_counter() - start
        return {
            "budget_s": args.budget_s,
            "setup_s": args.setup_s,
            "bench_s": took,
            "total_s": args.setup_s + took,
        }

    def written(runs: list[dict]):
        write_results(out, runs, rows, env, label, command, timing())

    say = functools.partial(print, flush=True)
    runs = run_rows(rows, setup, args.tiny, args.budget_s, say=say, on_row=written, passes=args.passes)
    _, text = write_results(out, runs, rows, env, label, command, timing())
    for trace in out.glob("runs/*/profile/*.json.gz"):  # summarised in results.md; tens of MB each
        trace.unlink()
    print(text)
    print(f"results in {out}/")
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    run_script(main)
