"""The GPU benchmark (`make bench-gpu`): one command that fits a 9-minute window on one H100 or H200.

    make bench-gpu                                     # = python scripts/bench_gpu.py
    python scripts/bench_gpu.py --budget_s 300 --rows ddp,zero2,"1b zero2"
    python scripts/bench_gpu.py --tiny --output_dir /tmp/bench_gpu   # on CPU, debug/tiny presets: its test

Rows, in the order they run (llama_train/bench/gpu.py ROWS): DDP, ZeRO-2, ZeRO-1, ZeRO-3 and FSDP2 at
125m (micro batch 8 x 1024); ZeRO-2 (its step 2 profiled), DDP and FSDP2 at 1b (4 x 2048); then the A/B
rows, each one change against its base row: the probe on every step instead of one in 10, and each of
ZeRO's speed settings reverted alone (dim² reduce buckets, overlap_comm on, DeepSpeed's throughput
timer on, the bf16 overflow scan on), `--compile`, and at 1b selective (every other block) and full
activation checkpointing. Each row launches the real trainer on one GPU, as `make bench` does, in bf16
(`--dtype auto`); its step time is the median of its unprobed steps after warm-up. A row that would end
past --budget_s is skipped and reported as such.

Writes docs/benchmarks/<date>-<gpu>-bench-gpu/ (or --output_dir): results.md (the strategies with
tokens/s, MFU, peak memory and step time; the time split of a probed step; the A/B table; the goals;
the profiled step's top kernels and the attention kernels SDPA picked), results.json (every row with
the device, driver, torch, CUDA and DeepSpeed versions, the commit) and runs/<row>_w1_r0/ (each run's
command, logs and metrics.jsonl; the profiled row's trace is summarised in results.md and deleted).
"""

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

from llama_train.bench.gpu import ROWS, environment, run_rows
from llama_train.bench.gpu_report import results_markdown
from llama_train.bench.label import run_label
from llama_train.bench.matrix import DATA_CACHE, Setup
from llama_train.cli import run_script
from llama_train.errors import ConfigError
from llama_train.plan.planner import ROOT


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget_s", type=float, default=540, help="seconds for all rows (default: %(default)s)")
    p.add_argument("--rows", help="comma-separated row names to run, in ROWS order (default: every row)")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    rows, env = chosen_rows(args.rows), environment()
    if env["device"] == "cpu" and not args.tiny:
        raise ConfigError(
            "no GPU visible: make bench-gpu measures one; --tiny checks it on CPU (small presets)"
        )
    out = Path(args.output_dir) if args.output_dir else default_output(env)
    setup = Setup(output_dir=str(out), data_output_path=args.data_output_path, dtype="auto", repeats=1)
    results = run_rows(rows, setup, args.tiny, args.budget_s, say=lambda s: print(s, flush=True))
    label = run_label()
    command = "python scripts/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({**label, **env, "command": command, "rows": results}, indent=2)
    )
    text = results_markdown(results, env, label, command.strip(), out)
    (out / "results.md").write_text(text)
    for trace in out.glob("runs/*/profile/*.json.gz"):  # summarised in results.md; tens of MB each
        trace.unlink()
    print(text)
    print(f"results in {out}/")
    return 0 if all(not r.get("error") or r["error"].startswith("skipped") for r in results) else 1


if __name__ == "__main__":
    run_script(main)
