"""One benchmark run: launched as users launch it, in its own process group; its numbers read back
from its metrics.jsonl, or its error from the last lines of its stderr."""

import json
import os
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

from llama_train import gpu
from llama_train.bench.breakdown import probe_cost, read_comm, read_timing
from llama_train.bench.matrix import Entry, Setup, trainer_command, trainer_flags
from llama_train.distributed.dist import free_port
from llama_train.errors import ConfigError
from llama_train.plan.planner import ROOT

STDERR_TAIL_LINES = 6  # lines of a failed run's stderr kept as its error
RUN_ARGS = (
    "batch_size",
    "max_seq_len",
    "accumulation_steps",
    "gradient_checkpointing",
    "optimizer",
)  # what the planner needs


def run_env(world: int, threads: int) -> dict:
    """The environment of a run with `world` ranks: `threads` per rank (0: CPU cores / world)."""
    env = dict(os.environ)
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.update(gpu.launcher_env(env.get("CUDA_VISIBLE_DEVICES")))  # hidden GPUs: DeepSpeed's ranks on CPU
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a benchmark started under a launcher must not leak its rank into runs
    return env


def stderr_tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    """The last meaningful lines: progress-bar redraws, blank lines, Python warnings (with the source
    line the warnings module echoes after each) and the copies every rank prints of one error dropped."""
    kept, skip_next = [], False
    for line in (part.strip() for chunk in text.splitlines() for part in chunk.split("\r")):
        if skip_next or "Warning: " in line:
            skip_next = not skip_next
            continue
        if line and "it/s]" not in line and "s/it]" not in line and line != "return func(*args, **kwargs)":
            kept.append(line)
    unique = list(dict.fromkeys(reversed(kept)))[:lines]  # the last occurrence of each line
    return "\n".join(reversed(unique))


def launch(cmd: list[str], env: dict, timeout: int) -> tuple[int, str, str]:
    """(exit code, stdout, stderr). The launcher and its ranks get their own process group, so a run
    past `timeout` is ended whole: killing only the launcher would leave its ranks running."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return -9, stdout, stderr + f"\nbenchmark: killed after --timeout {timeout} s"


def run_one(strategy: Entry, world: int, repeat: int, setup: Setup) -> dict:
    """Launch one run; its row (with `error` set when it failed)."""
    row = {"strategy": strategy.name, "world_size": world, "repeat": repeat, "load_1m": os.getloadavg()[0]}
    if strategy.error:
        return {**row, "error": strategy.error}
    run_dir = Path(setup.output_dir) / "runs" / f"{strategy.name}_w{world}_r{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale metrics.jsonl would be appended to
    run_dir.mkdir(parents=True)
    port = free_port()
    try:
        cmd = trainer_command(strategy, world, port) + trainer_flags(setup, run_dir)
    except ConfigError as e:  # e.g. more ranks than CUDA_VISIBLE_DEVICES names
        return {**row, "error": str(e)}
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    start = time.perf_counter()
    try:
        rc, stdout, stderr = launch(cmd, run_env(world, setup.threads), setup.timeout)
    except OSError as e:  # a launcher that is not there: this row's error, the others still run
        return {**row, "error": f"cannot start {cmd[0]}: {e}"}
    row["wall_s"] = time.perf_counter() - start
    (run_dir / "stdout.log").write_text(stdout)
    (run_dir / "stderr.log").write_text(stderr)
    shutil.rmtree(
        run_dir / "checkpoints", ignore_errors=True
    )  # none is written (--no_final_checkpoint) unless stopped
    if rc != 0:
        return {**row, "error": f"exit code {rc}: " + (stderr_tail(stderr) or stderr_tail(stdout))}
    try:
        return {**row, **read_run(run_dir / "metrics.jsonl", setup.warmup_steps)}
    except (OSError, ValueError, KeyError, StopIteration) as e:
        return {**row, "error": f"unreadable metrics.jsonl: {type(e).__name__}: {e}"}


def read_records(path: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict a line."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def peak_per_rank(memory: dict, last_probed: list | None, last_train: dict) -> list[int]:
    """Each rank's peak: the memory record has every rank's at step 2, the last timing record every
    rank's near the end, rank 0's last train record rank 0's at the end."""
    peaks = [max(p) for p in zip(memory["peak_mem_bytes"], last_probed or memory["peak_mem_bytes"])]
    peaks[0] = max(peaks[0], last_train["peak_mem_bytes"])
    return peaks


def step_times(records: list[dict], warmup: int) -> tuple[list[float], str]:
    """The step times after warm-up, and what they are: the unprobed steps' (each train record that
    timed any: the mean of its window's unprobed steps, --log_interval steps, one with --log_interval
    1), or with every step probed (--probe_interval 1) the probed steps' own wall time, the probe's
    work included (timing records)."""
    train = [r for r in records if r["event"] == "train" and r["step"] > warmup]
    timed = [r["step_time_s"] for r in train if r.get("timed_steps", 1) > 0]
    if timed:
        return timed, "unprobed steps"
    probed = [r["wall_s"] + r["probe_s"] for r in records if r["event"] == "timing" and r["step"] > warmup]
    if not probed:
        raise ValueError(f"no train records after the {warmup} warm-up steps")
    return probed, "probed steps"


def read_run(path: Path, warmup: int) -> dict:
    """One run's numbers from its metrics.jsonl: median step time after warm-up (step_times), memory
    record, time split and bytes of the probed steps."""
    records = read_records(path)
    config = next(r for r in records if r["event"] == "config")
    train = [r for r in records if r["event"] == "train"]
    memory = next(r for r in records if r["event"] == "memory")
    timed, source = step_times(records, warmup)
    step_time, world = statistics.median(timed), config["world_size"]
    tok_s = config["tokens_per_step"] / step_time
    split = {**read_timing(records, warmup), "probe_cost": probe_cost(records, warmup)}
    peaks = peak_per_rank(memory, split.pop("peak_mem_bytes_per_rank", None), train[-1])
    states = memory["model_state_bytes"]
    worst = max(range(len(states)), key=states.__getitem__)  # the rank that holds the most
    layout = config.get("layout") or {}
    return {
        "trainer_strategy": config["strategy"],
        "dtype": config["dtype"],
        "num_params": config["num_params"],
        "zero_stage": memory["zero_stage"],
        "tokens_per_s": tok_s,
        "tokens_per_s_per_device": tok_s / world,
        "step_time_s": step_time,
        "flops_per_token": config["flops_per_token"],
        "peak_flops": config["peak_flops"],  # this run's (on CPU: a matmul timed at its start)
        "peak_source": config["peak_source"],
        "final_loss": train[-1]["loss"],
        "losses": [r["loss"] for r in train],  # every step's, for the divergence from DDP
        "peak_mem_bytes": max(peaks),
        "peak_mem_bytes_per_rank": peaks,
        "model_state_bytes": states[worst],
        "model_state_bytes_per_rank": states,
        "breakdown": memory["breakdown"][worst],
        "expected_model_state_bytes": memory.get("expected_model_state_bytes_per_rank", [None] * len(states))[
            worst
        ]
        or memory["expected_model_state_bytes"],
        "expected_model_state_bytes_per_rank": memory.get("expected_model_state_bytes_per_rank"),
        "params_per_rank": memory.get("params_per_rank"),
        "layout": layout or None,
        # model parallel: the worst rank's share of the weights, partitioned by ZeRO over this many ranks
        "local_params": (memory.get("params_per_rank") or [config["num_params"]] * len(states))[worst],
        "zero_world": world // (layout.get("tp", 1) * layout.get("pp", 1)),
        "timed_steps": len(timed),
        "timed_from": source,
        "largest_param_numel": config["model"]["vocab_size"] * config["model"]["dim"],  # embedding / output
        "model": config["model"],
        "device": config["device"],
        "run_args": {k: config["args"].get(k) for k in RUN_ARGS},
        **read_comm(records, warmup),
        **split,
    }
