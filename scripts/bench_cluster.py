"""DDP, ZeRO-1/2/3 and FSDP2 across simulated hosts whose links are shaped (`make bench-cluster`): step
time and its split, the bytes each rank sends as the kernel counts them beside the comm record's, and the
planner's prediction for every row. Needs root (scripts/multinode_sim.sh: network namespaces, sshd, pdsh,
tc); about 12 minutes on 2 cores with the defaults.

    python scripts/bench_cluster.py                                   # 2 and 4 hosts, 4 link settings
    python scripts/bench_cluster.py --hosts 2 --rates off,1gbit --strategies ddp,zero2,zero3

Per host count, one simulation (scripts/multinode_sim.sh up: hosts behind a bridge, one rank each,
OMP_NUM_THREADS=1, sharing this machine's cores) and one launch per strategy, as users launch across hosts
(`deepspeed --hostfile` over pdsh, `torchrun --nnodes N`). In each launch the links change between windows
of --window_steps steps (the rates, then back, --cycles passes: interleaved repeats in one warm process);
the step after a change is left out. Every step is probed: its wall time, its communication wait, the comm
record's bytes (the ZeRO paper's count and the wire's) and what each host's interface sent
(/sys/class/net/IF/statistics/tx_bytes). Before the launches: each strategy on one rank without a link,
and a link probe per host count (llama_train/bench/linkprobe.py), which calibrate the planner's machine
(llama_train/bench/cluster_report.py) once for every row.

Writes docs/benchmarks/<date>-<machine>-cluster/ (or --output_dir): results.md (the rows, the planner's
median and worst error, the measured and predicted order per setting, the calibrated machine),
results.json, link_rates.png (step time against link rate per strategy: measured points, planner lines),
machine_h<N>.json (scripts/plan_memory.py --calibration reads it) and runs/ (each launch's logs and
metrics.jsonl).
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from llama_train.bench import cluster_report as report
from llama_train.bench.cluster import SIM, ClusterSetup, calibrate, run_cluster
from llama_train.bench.flags import add_flags
from llama_train.bench.label import label_line, run_label
from llama_train.bench.matrix import parse_strategies
from llama_train.bench.plots import plot_link_rates
from llama_train.cli import run_script
from llama_train.errors import ConfigError
from llama_train.plan.planner import ROOT

D = ClusterSetup()
FLAGS = {
    "window_steps": "steps measured in each window of one link rate, after one left out (default: {})",
    "cycles": "passes over the rates in each launch, alternating direction (default: {})",
    "preset": "model preset (default: {})",
    "trainer_args": "model overrides and extra trainer flags, one string (default: '{}': 7.6M parameters)",
    "max_seq_len": "tokens per sequence (default: {})",
    "batch_size": "micro batch per rank (default: {})",
    "data_output_path": "tokenizer + token cache shared by the runs (default: <repo>/data_cache)",
    "sim_dir": "the simulation's state directory, LLT_SIM_DIR (default: {})",
    "timeout": "seconds before a launch is killed and reported (default: {})",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--strategies", default="ddp,zero1,zero2,zero3,fsdp2", help="comma-separated (default: %(default)s)"
    )
    p.add_argument(
        "--hosts", default="2,4", help="simulated host counts, one rank each (default: %(default)s)"
    )
    p.add_argument(
        "--rates",
        default=",".join(D.rates),
        help="link rates per host in tc's units, off: unshaped (default: %(default)s)",
    )
    p.add_argument("--output_dir", help="default: docs/benchmarks/<date>-<machine>-cluster")
    p.add_argument(
        "--from_results",
        help="measure nothing: the planner against the measurements of an earlier run's results.json (in place)",
    )
    add_flags(p, D, FLAGS)
    args = p.parse_args(argv)
    problems = [f"--{k} must be >= 1" for k in ("window_steps", "cycles") if getattr(args, k) < 1]
    try:
        args.hosts = [int(h) for h in args.hosts.split(",")]
    except ValueError:
        problems.append(f"--hosts must be integers like 2,4, got {args.hosts!r}")
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    bad = [r for r in args.rates if r != "off" and not re.fullmatch(r"[0-9.]+(bit|kbit|mbit|gbit|tbit)", r)]
    if bad:
        problems.append(f"--rates {bad}: give tc rates like 500mbit, 2gbit, or off")
    if problems:
        p.error("; ".join(problems))
    args.strategies = parse_strategies(args.strategies)
    args.output_dir = args.output_dir or str(default_output())
    return args


def default_output() -> Path:
    """docs/benchmarks/<date>-cpu-<kind>-<cores>core-cluster, as the dated result folders are named."""
    kind = next((k for k in ("xeon", "epyc") if k in run_label()["machine"].lower()), "cpu")
    today = datetime.date.today().isoformat()
    return ROOT / "docs" / "benchmarks" / f"{today}-cpu-{kind}-{os.cpu_count()}core-cluster"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_results:
        return report_again(Path(args.from_results))
    measured = vars(args).copy()
    measured.pop("from_results")
    setup = ClusterSetup(**measured)
    check = subprocess.run(["bash", str(SIM), "check"], capture_output=True, text=True)
    if check.returncode != 0:
        raise ConfigError(f"cannot simulate hosts here: {(check.stdout + check.stderr).strip()}")
    started, loads = time.perf_counter(), [os.getloadavg()[0]]
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    calibration = calibrate(setup)
    rows, links = run_cluster(setup)
    loads.append(os.getloadavg()[0])
    command = "python scripts/bench_cluster.py " + " ".join(argv if argv is not None else sys.argv[1:])
    measured = {"setup": setup, "calibration": calibration, "rows": rows, "links": links, "command": command,
                "loads": loads, "seconds": time.perf_counter() - started, **run_label()}  # fmt: skip
    print(write(measured))
    return 0 if not any(r.get("error") for r in rows) else 1


def report_again(out: Path) -> int:
    """The planner's predictions, errors and orders for the measurements in `out`/results.json, again,
    with the commit and date they were recomputed at (results.md says so at its top)."""
    try:
        saved = json.loads((out / "results.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--from_results {out}: {e}; give a folder that bench_cluster.py wrote") from e
    setup = saved["setup"]
    setup["strategies"] = parse_strategies(",".join(s["name"] for s in setup["strategies"]))
    saved["setup"] = ClusterSetup(**{**setup, "output_dir": str(out)})
    saved["links"] = {int(h): link for h, link in saved["links"].items()}
    saved["replanned"] = {**run_label(), "command": f"python scripts/bench_cluster.py --from_results {out}"}
    print(write(saved))
    return 0


def write(measured: dict) -> str:
    """results.json (what was measured, and how; the planner's machine, predictions and verdict on top),
    results.md, link_rates.png, machine_h<N>.json; the markdown."""
    setup, rows, links = measured["setup"], measured["rows"], measured["links"]
    out = Path(setup.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    machines = {h: report.base_machine(setup, measured["calibration"], links[h]) for h in setup.hosts}
    report.predict(rows, setup, machines)
    verdict = report.verdict(rows)
    for h, machine in machines.items():
        (out / f"machine_h{h}.json").write_text(json.dumps(asdict(machine), indent=2) + "\n")
        for r in rows:
            if r["hosts"] == h:
                r["gbit"] = report.gbit_of(r["rate"], links[h])
    saved = {**measured, "setup": asdict(setup), "verdict": verdict}
    (out / "results.json").write_text(json.dumps(saved, indent=2, default=str) + "\n")
    label = {k: measured[k] for k in ("machine", "date", "commit")}
    footer = f"{label['machine']} | {label['date']} | {label['commit']}"
    if again := measured.get("replanned"):
        footer += f" | planner at {again['commit']}"
    plot_link_rates(rows, report.curves(setup, machines, links), out / "link_rates.png", footer)
    gathers = {"gathers": report.read_gathers(out)}  # linkprobe --gather's, where they were measured
    text = report.results_markdown(setup, {**measured, **gathers}, machines, verdict, label_line(label))
    (out / "results.md").write_text(text)
    return text


if __name__ == "__main__":
    run_script(main)
