"""`make bench-cluster`: DDP, ZeRO-1/2/3 and FSDP2 on N simulated hosts (scripts/multinode_sim.sh:
network namespaces behind a bridge, one rank each) whose links are shaped to a few rates, launched as
users launch across hosts (`deepspeed --hostfile` over pdsh, `torchrun --nnodes N`).

One launch per (strategy, hosts) runs every rate: the links change between windows of steps while the
run goes on (the rates in order, then back: off, 2gbit, 1gbit, 500mbit, 500mbit, 1gbit, ...), so the
rates are interleaved repeats of each other in one warm process, and start-up (half a minute a launch
on 2 cores) is paid once per strategy and host count, not once per rate. The step after a change is
left out (it began under the old rate). Every step is probed (--probe_interval 1): its wall time, its
split (communication wait against the rest), the bytes the comm record counts (the paper's and the
wire's) and the bytes the kernel counted on each host's interface.
"""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from llama_train.bench.matrix import Entry, Setup, parse_strategies, trainer_flags
from llama_train.bench.runs import read_records, run_env, run_one, stderr_tail
from llama_train.plan.planner import ROOT

SIM = ROOT / "scripts" / "multinode_sim.sh"
UNSHAPED = "off"


@dataclass
class ClusterSetup(Setup):
    """What `scripts/bench_cluster.py` measures, and how (Setup's fields: the model, batch, data)."""

    strategies: list[Entry] = field(default_factory=lambda: parse_strategies("ddp,zero1,zero2,zero3,fsdp2"))
    hosts: list[int] = field(default_factory=lambda: [2, 4])  # simulated hosts, one rank each
    rates: list[str] = field(default_factory=lambda: [UNSHAPED, "2gbit", "1gbit", "500mbit"])
    window_steps: int = 2  # steps measured per window of one rate (after one left out)
    cycles: int = 3  # passes over the rates in each launch, alternating direction
    preset: str = "25m"
    trainer_args: str = "--dim 256 --n_layers 4 --n_heads 4"  # 7.6M parameters: comm shows at these rates
    max_seq_len: int = 64
    dtype: str = "float32"
    warmup_steps: int = 3  # the first steps after start-up run slow (allocator, first collectives)
    probe_interval: int = 1
    threads: int = 1  # OMP_NUM_THREADS: one a rank, as on the simulated hosts
    steps: int = 0  # 0: derived, warm-up + every window
    sim_dir: str = "/tmp/llama-train-bench-cluster"  # LLT_SIM_DIR of the simulation it brings up
    output_dir: str = ""  # default: docs/benchmarks/<date>-<machine>-cluster

    def __post_init__(self):
        self.steps = self.steps or self.warmup_steps + len(self.schedule()) * (self.window_steps + 1)

    def schedule(self) -> list[str]:
        """The rate of each window in order: the rates, then reversed, `cycles` passes."""
        passes = [self.rates if c % 2 == 0 else self.rates[::-1] for c in range(self.cycles)]
        return [rate for p in passes for rate in p]

    def rate_of(self, step: int) -> str | None:
        """The rate step `step` ran under; None for warm-up and the first step of a window."""
        k, offset = divmod(step - self.warmup_steps - 1, self.window_steps + 1)
        if step <= self.warmup_steps or offset == 0 or k >= len(self.schedule()):
            return None
        return self.schedule()[k]

    def boundaries(self) -> dict[int, str]:
        """Step -> the rate to set once that step is logged (the next window's)."""
        size = self.window_steps + 1
        return {self.warmup_steps + k * size: rate for k, rate in enumerate(self.schedule())}


class Simulation:
    """scripts/multinode_sim.sh for one host count, owned by this process (a crash leaves nothing the
    next run does not take down)."""

    def __init__(self, sim_dir: str, hosts: int):
        self.sim_dir, self.hosts = sim_dir, hosts

    def env(self) -> dict:
        env = run_env(self.hosts, 1)
        env.update(LLT_SIM_DIR=self.sim_dir, LLT_SIM_HOSTS=str(self.hosts), LLT_SIM_OWNER=str(os.getpid()))
        return env

    def run(self, *args: str, check: bool = True, timeout: int = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["bash", str(SIM), *args],
            cwd=ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"multinode_sim.sh {' '.join(args)}: {stderr_tail(proc.stderr)}")
        return proc

    def __enter__(self):
        self.run("up")
        return self

    def __exit__(self, *exc):
        self.run("down", check=False)

    def launch_command(self, strategy: Entry) -> list[str]:
        """The launch a user types on a cluster, through the simulation (one rank a host)."""
        if strategy.ds_config is None:
            return ["bash", str(SIM), "torchrun", "train_ddp.py", *strategy.flags]
        return ["bash", str(SIM), "deepspeed", "train_deepspeed.py", "--deepspeed_config", strategy.ds_config,
                *strategy.flags]  # fmt: skip


def follow(proc: subprocess.Popen, metrics: Path, setup: ClusterSetup, sim: Simulation):
    """Until `proc` exits: set each window's rate once the step before it is logged; TimeoutError
    past --timeout."""
    changes, offset, deadline = setup.boundaries(), 0, time.monotonic() + setup.timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"killed after --timeout {setup.timeout} s")
        time.sleep(0.05)
        if not metrics.exists():
            continue
        with open(metrics, "rb") as f:
            f.seek(offset)
            lines = [line for line in f.readlines() if line.endswith(b"\n")]  # whole lines only
        offset += sum(map(len, lines))
        for record in map(json.loads, lines):
            if record.get("event") == "train" and record["step"] in changes:
                sim.run("shape", changes.pop(record["step"]))


def run_launch(strategy: Entry, sim: Simulation, setup: ClusterSetup) -> dict:
    """One launch of `strategy` across the simulation's hosts: its records, or its error."""
    run_dir = Path(setup.output_dir) / "runs" / f"{strategy.name}_h{sim.hosts}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "ledger.jsonl"):  # an earlier run's: a trainer refuses to start beside them
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    cmd = sim.launch_command(strategy) + trainer_flags(setup, run_dir) + ["--save_interval", "0"]
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    sim.run("shape", setup.schedule()[0])
    with open(run_dir / "output.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=sim.env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            follow(proc, run_dir / "metrics.jsonl", setup, sim)
        except TimeoutError as e:
            return {"error": str(e)}
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
    if proc.returncode != 0:
        tail = stderr_tail((run_dir / "output.log").read_text())
        return {"error": f"exit code {proc.returncode}: {tail}"}
    return {"records": read_records(run_dir / "metrics.jsonl")}


def steps_by_rate(records: list[dict], setup: ClusterSetup) -> dict[str, list[dict]]:
    """Each measured step's numbers, grouped by the rate it ran under: wall time, the mean rank's
    communication wait, the bytes each rank sent by the kernel's count and by the comm record's."""
    timing = {r["step"]: r for r in records if r["event"] == "timing"}
    comm = {r["step"]: r for r in records if r["event"] == "comm"}
    out: dict[str, list[dict]] = {}
    for step in sorted(timing.keys() & comm.keys()):
        rate = setup.rate_of(step)
        if rate is None:
            continue
        t, c = timing[step], comm[step]
        kernel = c.get("link_tx_bytes") or []
        out.setdefault(rate, []).append(
            {
                "step": step,
                "step_time_s": t["wall_s"],
                "comm_wait_s": statistics.fmean(t["comm_wait_s"]),
                "kernel_bytes": statistics.fmean(kernel) if kernel and None not in kernel else None,
                "wire_bytes": statistics.fmean(c["wire_bytes_total"]),
                "paper_bytes": statistics.fmean(c["bytes_total"]),
            }
        )
    return out


MEDIANS = ("step_time_s", "comm_wait_s", "kernel_bytes", "wire_bytes", "paper_bytes")


def measured_row(strategy: str, hosts: int, rate: str, steps: list[dict]) -> dict:
    """One row: the medians over its steps (every window of the rate), and the fastest and slowest."""
    row = {"strategy": strategy, "hosts": hosts, "rate": rate, "steps": len(steps), "error": None}
    for key in MEDIANS:
        values = [s[key] for s in steps if s[key] is not None]
        row[key] = statistics.median(values) if values else None
    row["compute_s"] = row["step_time_s"] - row["comm_wait_s"]
    row["step_time_range_s"] = [min(s["step_time_s"] for s in steps), max(s["step_time_s"] for s in steps)]
    return row


def error_rows(strategy: str, hosts: int, setup: ClusterSetup, error: str) -> list[dict]:
    return [{"strategy": strategy, "hosts": hosts, "rate": rate, "error": error} for rate in setup.rates]


def launch_rows(strategy: Entry, sim: Simulation, setup: ClusterSetup) -> list[dict]:
    """One launch's rows, a row per rate (each with `error` when the launch failed)."""
    if strategy.error:
        return error_rows(strategy.name, sim.hosts, setup, strategy.error)
    result = run_launch(strategy, sim, setup)
    if result.get("error"):
        return error_rows(strategy.name, sim.hosts, setup, result["error"])
    by_rate = steps_by_rate(result["records"], setup)
    return [
        measured_row(strategy.name, sim.hosts, rate, by_rate[rate])
        if by_rate.get(rate)
        else error_rows(strategy.name, sim.hosts, setup, f"no measured step at {rate}")[0]
        for rate in setup.rates
    ]


def run_cluster(setup: ClusterSetup, say=print) -> tuple[list[dict], dict[int, dict]]:
    """Every strategy on every host count (one simulation per host count, up for its launches), and
    each host count's unshaped link (probe_link). DeepSpeed's JIT ops are built into, and loaded from,
    one place for every launch (the venv's, as the tests do, unless TORCH_EXTENSIONS_DIR says)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    rows, links = [], {}
    for hosts in setup.hosts:
        with Simulation(setup.sim_dir, hosts) as sim:
            links[hosts] = probe_link(sim, Path(setup.output_dir))
            for strategy in setup.strategies:
                started = time.perf_counter()
                rows += launch_rows(strategy, sim, setup)
                failed = rows[-1].get("error")
                say(f"{strategy.name} on {hosts} hosts: {time.perf_counter() - started:.0f} s"
                    + (f", failed: {failed.splitlines()[0]}" if failed else ""))  # fmt: skip
    return rows, links


def probe_link(sim: Simulation, out_dir: Path) -> dict:
    """The unshaped links' gloo throughput and latency between the simulation's hosts (linkprobe.py)."""
    out = out_dir / f"link_h{sim.hosts}.json"
    sim.run("shape", UNSHAPED)
    sim.run("torchrun", "-m", "llama_train.bench.linkprobe", str(out), timeout=300)
    return json.loads(out.read_text())


def calibrate(setup: ClusterSetup) -> dict[str, dict]:
    """Each strategy on one rank without a link, one thread, as many copies at once as the machine has
    cores (make bench's run_one, every step probed): the median seconds of its phases over every copy's
    steps after warm-up, the machine's compute as each engine runs it with every core busy (as the
    simulated hosts' ranks do: neighbours share the memory bus and the caches); or its error."""
    from concurrent.futures import ThreadPoolExecutor

    one = replace(setup, steps=setup.warmup_steps + 8, probe_interval=1, repeats=1,
                  output_dir=str(Path(setup.output_dir) / "calibration"))  # fmt: skip
    copies = os.cpu_count() or 1
    out = {}
    for strategy in setup.strategies:
        with ThreadPoolExecutor(copies) as pool:
            rows = list(pool.map(run_one, [strategy] * copies, [1] * copies, range(copies), [one] * copies))
        if failed := [r["error"] for r in rows if r.get("error")]:
            out[strategy.name] = {"error": failed[0]}
            continue
        timing = []
        for k in range(copies):
            path = Path(one.output_dir) / "runs" / f"{strategy.name}_w1_r{k}" / "metrics.jsonl"
            timing += [
                r for r in read_records(path) if r["event"] == "timing" and r["step"] > setup.warmup_steps
            ]
        phases = {key: statistics.median(r[key][0] for r in timing) for key in CALIBRATED}
        out[strategy.name] = {**phases, "num_params": rows[0]["num_params"], "copies": copies}
    return out


CALIBRATED = ("forward_s", "backward_s", "comm_wait_s", "optimizer_s", "step_time_s")
