"""Throughput, MFU, the step log line and metrics.jsonl.

MFU = achieved model FLOP/s (PaLM-style count, `Transformer.flops_per_token`) / device peak.
The peak comes from a table of known GPUs (dense bf16/fp16 tensor-core, fp32 for fp32 runs),
or, on CPU, from a matmul in the run's dtype measured in this process -- reported with `peak_source`
so nobody mistakes one for the other.
"""

import json
import math
import os
import time

import torch
from tqdm.auto import tqdm

from llama_train.distributed.dist import all_gather_object, all_reduce_mean
from llama_train.optim.registry import optimizer_spec
from llama_train.plan.memory import expected_model_state_bytes, model_state_bytes, peak_memory_bytes
from llama_train.steps import due
from llama_train.telemetry.goodput import start_record
from llama_train.telemetry.reporting import Reporters

# Dense peak TFLOP/s per GPU from NVIDIA's datasheets (no sparsity): (bf16/fp16 tensor cores with
# fp32 accumulation, plain fp32). fp32 runs get the plain fp32 rate: TF32 stays off (PyTorch's
# default), so `--dtype float32` on a GPU computes what it computes on a CPU. Keys are
# torch.cuda.get_device_name() without its "NVIDIA " / "Tesla " prefix, matched exactly: "L40" is not
# "L4", "H100 NVL" is not the SXM part. LLAMA_TRAIN_PEAK_TFLOPS overrides (and covers the rest).
_H100_SXM, _H100_PCIE, _H_NVL, _A100 = (989.0, 67.0), (756.0, 51.0), (835.0, 60.0), (312.0, 19.5)
GPU_PEAK_TFLOPS = {
    "B200": (2250.0, 75.0),
    "H200": _H100_SXM,
    "H200 NVL": _H_NVL,
    "H100 80GB HBM3": _H100_SXM,
    "H100 SXM5 80GB": _H100_SXM,
    "H100 PCIe": _H100_PCIE,
    "H100 NVL": _H_NVL,
    "H800": _H100_SXM,
    "H800 PCIe": _H100_PCIE,
    "H20": (148.0, 44.0),
    "GH200 480GB": _H100_SXM,
    "A100-SXM4-80GB": _A100,
    "A100-SXM4-40GB": _A100,
    "A100-PCIE-40GB": _A100,
    "A100 80GB PCIe": _A100,
    "A10": (125.0, 31.2),
    "A10G": (125.0, 31.2),  # AWS's A10 variant; NVIDIA publishes A10's figures
    "L40S": (362.0, 91.6),
    "L40": (181.0, 90.5),
    "L4": (121.0, 30.3),
    "RTX A6000": (154.8, 38.7),
    "RTX 6000 Ada Generation": (364.2, 91.1),
    "GeForce RTX 5090": (209.5, 104.8),
    "GeForce RTX 4090": (165.2, 82.6),
    "GeForce RTX 3090": (71.0, 35.6),
    "V100-SXM2-16GB": (125.0, 15.7),
    "V100-SXM2-32GB": (125.0, 15.7),
    "V100-PCIE-16GB": (112.0, 14.0),
    "V100-PCIE-32GB": (112.0, 14.0),
    "T4": (65.0, 8.1),
}
PEAK_ENV = "LLAMA_TRAIN_PEAK_TFLOPS"
UNKNOWN_PEAK = f"MFU n/a (unknown peak; set {PEAK_ENV})"


def gpu_peak_flops(name: str, dtype: str, override: str | None = None) -> tuple[float, str]:
    """(peak FLOP/s, where it comes from) for a GPU named `name` (torch.cuda.get_device_name) training
    in `dtype`; NaN with UNKNOWN_PEAK for a GPU not in the table. `override`: LLAMA_TRAIN_PEAK_TFLOPS."""
    if override:
        return float(override) * 1e12, f"{PEAK_ENV}={override}"
    model = name.removeprefix("NVIDIA ").removeprefix("Tesla ").strip()
    if model not in GPU_PEAK_TFLOPS:
        return float("nan"), f"unknown GPU {name!r}: {UNKNOWN_PEAK}"
    half, fp32 = GPU_PEAK_TFLOPS[model]
    return (fp32 if dtype == "float32" else half) * 1e12, f"table:{model}:{dtype}"


def measure_cpu_matmul_flops(
    dtype: torch.dtype = torch.float32, repeats: int = 3, n_max: int = 1024
) -> float:
    """Best-of-`repeats` matmul FLOP/s in `dtype` with this process's thread count: the side doubles
    from 256 until a try takes 50 ms or reaches `n_max` (a bf16 matmul on a CPU without bf16 units
    stops early, being ~400x slower). Every run pays this at start-up: 1024 gives 2048's rate at an
    eighth of the cost (docs/monitoring.md has the measurement)."""
    n = 256
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        a @ b  # warm up the BLAS
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        if best >= 0.05 or n >= n_max:
            return 2 * n**3 / best
        n *= 2


def device_peak_flops(device: torch.device, dtype: str) -> tuple[float, str]:
    """(peak FLOP/s, where the number comes from): the GPU table, or on CPU a measured matmul in the
    run's dtype; LLAMA_TRAIN_PEAK_TFLOPS overrides both."""
    override = os.environ.get(PEAK_ENV)
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, override)
    if override:
        return float(override) * 1e12, f"{PEAK_ENV}={override}"
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    rate = measure_cpu_matmul_flops(getattr(torch, dtype))  # the dtype that runs: bf16 units count
    return rate, f"measured CPU {short} matmul ({torch.get_num_threads()} threads)"


def config_record(path: str) -> dict | None:
    """The run's `config` record in the metrics.jsonl at `path`: its first line, or its second in a branch
    (whose first process writes its `resume` record first). It comes before the first `train` record,
    so only the records up to that one are read; None without one (a branch from before it wrote one)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record["event"] in ("config", "train"):
                return record if record["event"] == "config" else None
    return None


class MetricsWriter:
    """Appends one JSON object per line to <output_dir>/metrics.jsonl (global rank 0 only)."""

    def __init__(self, output_dir: str, rank: int):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.enabled = rank == 0
        if self.enabled:
            os.makedirs(output_dir, exist_ok=True)

    def has_config(self) -> bool:
        """Whether the run's `config` record is written (rank 0; True elsewhere)."""
        return config_record(self.path) is not None if self.enabled else True

    def write(self, event: str, **fields):
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, **fields, "time": time.time()}) + "\n")


def format_step(rec: dict, total_steps: int) -> str:
    """One uniform log line: step | loss | lr | norm | ms | tok/s | MFU | memory."""
    norm = "n/a" if rec["grad_norm"] is None else f"{rec['grad_norm']:.3f}"
    mfu = "  n/a" if math.isnan(rec["mfu"]) else f"{rec['mfu'] * 100:5.1f}%"
    return (
        f"step {rec['step']:>6}/{total_steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | norm {norm}"
        f" | {rec['step_time_s'] * 1000:8.1f} ms | {rec['tokens_per_s']:>9,.0f} tok/s"
        f" | MFU {mfu} | mem {rec['peak_mem_bytes'] / 2**30:.2f} GiB"
    )


def eval_notes(rec: dict) -> list[str]:
    """The eval line's short parts: each task's accuracy (multiple choice: and acc_norm) and n, and each
    source's loss."""
    notes = []
    for name, t in (rec.get("tasks") or {}).items():
        norm = (
            f" norm {t['acc_norm']:.3f}" if "acc_norm" in t else f" ppl {t['ppl']:.1f}" if "ppl" in t else ""
        )
        notes.append(f"{name} acc {t['acc']:.3f}{norm} (n {t['n']})")
    if rec.get("sources"):
        notes.append(
            "by source: " + ", ".join(f"{n} {s['eval_loss']:.4f}" for n, s in rec["sources"].items())
        )
    return notes


class StepLogger:
    """tqdm bar, one log line per `log_interval` steps, and metrics.jsonl records (rank 0), plus the
    same scalars to every `--report_to` writer (llama_train/telemetry/reporting.py), flushed at log steps.

    Step time is averaged over the steps since the last log that the probe left alone (timing.StepProbe:
    a probed step is listed in the record, `probed_steps`, and counted out), so only log steps synchronise.
    `record` is the run's `config` record (build.run_record): world size, FLOPs, peak, the flags.
    Use it in a `with` (or call close()): the writers are closed on every way out of the run."""

    def __init__(
        self, output_dir: str, rank: int, record: dict, total_steps: int, done: int, log_interval: int
    ):
        self.rank, self.record, self.total, self.log_interval = rank, record, total_steps, log_interval
        self.world = record["world_size"]
        self.writer = MetricsWriter(output_dir, rank)
        self.probe = None  # timing.StepProbe: a probed step's time split and communication
        self.notes, self.last_dt = [], None  # the probe's notes for the next log line; the last step time
        if done == 0 or not self.writer.has_config():  # a branch: its first process resumed
            self.writer.write("config", **record)
        self.writer.write("start", **start_record(done))  # every process: goodput across restarts
        flags = record["args"]
        self.reporters = Reporters(
            flags.get("report_to", "none"), output_dir, rank, done, flags.get("wandb_project"), record
        )
        # disable=None: no bar when stderr is not a terminal (a log file gets the log lines only)
        self.bar = tqdm(
            total=total_steps,
            initial=done,
            disable=True if rank != 0 else None,
            desc="train",
            dynamic_ncols=True,
        )
        if rank == 0 and math.isnan(record["peak_flops"]):
            self.bar.write(record["peak_source"])  # an unknown GPU: MFU n/a, and how to set its peak
        self.reset_timer(done)

    def reset_timer(self, step: int):
        """Exclude evaluation/checkpoint time from the next throughput figure."""
        self.t0, self.last_step = time.perf_counter(), step
        self.mark = self.t0  # where the next evaluation or checkpoint save is timed from
        self.probed, self.probed_s = [], 0.0  # steps of this window the probe measured, their seconds

    def due(self, step: int) -> bool:
        """Whether step `step` is logged: every `log_interval` steps and the last."""
        return due(step, self.log_interval, self.total)

    def step(
        self, step: int, loss: torch.Tensor, lr: float, grad_norm, device, skipped: int = 0
    ) -> dict | None:
        """Record optimizer step `step`; logs every `log_interval` steps and the last."""
        self.bar.update(1)
        if self.probe is not None and self.probe.measuring == step:  # collective: `timing`, `comm` records
            seconds, note = self.probe.finish(step, self.writer)
            self.probed.append(step)
            self.probed_s += seconds
            self.notes += [note] if note else []
        self.mark = time.perf_counter()
        if not self.due(step):
            return None
        (loss_val,) = all_reduce_mean([loss.item()], device)  # mean over ranks; syncs the device
        dt, timed = self.step_time(step)
        tok_s = self.record["tokens_per_step"] / dt
        rec = {
            "step": step,
            "loss": loss_val,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "tokens_per_s": tok_s,
            "mfu": tok_s * self.record["flops_per_token"] / (self.record["peak_flops"] * self.world),
            "step_time_s": dt,
            "peak_mem_bytes": peak_memory_bytes(device),
            "skipped_steps": skipped,
            "timed_steps": timed,
            "probed_steps": self.probed,
        }
        self.writer.write("train", **rec)
        self.reporters.log("train", step, rec)
        self.reporters.flush()
        if self.rank == 0:
            probed = ["probed: ms, tok/s, MFU of the last unprobed steps"] if timed == 0 else []
            self.bar.write(" | ".join([format_step(rec, self.total), *probed, *self.notes]))
        self.notes = []
        self.reset_timer(step)
        return rec

    def step_time(self, step: int) -> tuple[float, int]:
        """(seconds per step, steps timed): the mean over this window's steps the probe left alone. A
        window of probed steps only (e.g. --log_interval 1) repeats the last such figure (0 steps
        timed); before there is one, the probed steps' own time stands in."""
        timed = max(1, step - self.last_step) - len(self.probed)  # a step at the window's start: one
        if timed > 0:
            self.last_dt = (time.perf_counter() - self.t0 - self.probed_s) / timed
        elif self.last_dt is None:
            return self.probed_s / max(1, len(self.probed)), 0
        return self.last_dt, timed

    def eval(self, step: int, loss: float, ppl: float, bpb: float, **extra):
        """An evaluation just made: loss, perplexity, bits per byte (its `seconds`: since the step, timed
        here); `extra`: a mixture's `sources` ({name: {eval_loss, eval_bpb}}), --eval_tasks' `tasks`
        ({name: {acc, acc_norm, n, stderr, ...}}) and `tasks_seconds`, recorded as given."""
        seconds = time.perf_counter() - self.mark
        rec = {"eval_loss": loss, "eval_ppl": ppl, "eval_bpb": bpb, **extra}
        self.writer.write("eval", step=step, **rec, seconds=seconds)
        self.reporters.log("eval", step, rec)
        self.reporters.flush()
        if self.rank == 0:
            line = f"eval   {step:>6}/{self.total} | loss {loss:.4f} | ppl {ppl:.2f} | bpb {bpb:.4f}"
            self.bar.write(line + "".join(f" | {part}" for part in eval_notes(rec)))
        self.reset_timer(step)

    def saved(self, step: int):
        """A checkpoint just written after step `step`: a `save` record of its seconds; the next
        throughput figure leaves it out."""
        self.writer.write("save", step=step, seconds=time.perf_counter() - self.mark)
        self.reset_timer(step)

    def memory(self, step: int, engine, device):
        """Collective: every rank's model-state bytes (memory.model_state_bytes) and peak memory,
        next to the ZeRO paper's expectation; one `memory` record. Call between backward and the
        optimizer step. `engine`: the run's (llama_train/train/engines/)."""
        held = model_state_bytes(engine.held_tensors(), engine.optimizer)
        shapes = engine.param_shapes()  # full shapes: ZeRO-3's partitions count whole
        local = sum(math.prod(s) for s in shapes.values())
        held = all_gather_object((held, peak_memory_bytes(device), local))
        stage = engine.strategy.stage
        num_params, dtype = self.record["num_params"], self.record["dtype"]
        optimizer = optimizer_spec(self.record["args"].get("optimizer", "adamw"))
        # the parameters it steps by its own rule (the rest: AdamW), whole sizes
        taken = sum(math.prod(shape) for n, shape in shapes.items() if optimizer.takes(n, shape))
        other_state = optimizer.state_difference(taken)
        expected = [expected_model_state_bytes(stage, num_params, self.world, dtype, other_state)] * len(held)
        layout = self.record.get("layout") or {}
        if (
            layout.get("tp", 1) * layout.get("pp", 1) > 1
        ):  # a share of the weights each, ZeRO over the replicas
            expected = [expected_model_state_bytes(stage, n, layout["dp"], dtype) for _, _, n in held]
        self.writer.write(
            "memory",
            step=step,
            zero_stage=stage,
            num_params=num_params,
            optimizer=optimizer.name,
            optimizer_params=taken,
            dtype=dtype,
            model_state_bytes=[sum(h.values()) for h, _, _ in held],
            breakdown=[h for h, _, _ in held],
            peak_mem_bytes=[p for _, p, _ in held],
            expected_model_state_bytes=max(expected),
            expected_model_state_bytes_per_rank=expected,
            params_per_rank=[n for _, _, n in held],
        )

    def close(self, failed: bool = False):
        self.bar.close()
        self.reporters.close(failed)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(failed=exc_type is not None)
