"""What a benchmark compares: the strategies (their records: llama_train/distributed/strategies.py,
which the planner plans too), the settings every run shares, and the launch line a user would type for
each configuration."""

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from llama_train import gpu
from llama_train.distributed.strategies import DEFAULT_STRATEGIES, STRATEGIES
from llama_train.plan.planner import ROOT

DATA_CACHE = ROOT / "data_cache"  # tokenizer + token cache shared by the runs, built by the first


@dataclass
class Entry:
    """One strategy the benchmark runs: a record's name and launch (distributed/strategies.py), or
    NAME=CONFIG for any DeepSpeed config; `error` when it cannot be run at all."""

    name: str
    ds_config: str | None  # None: torchrun train_ddp.py
    error: str | None = None  # set when the name cannot be run at all
    flags: tuple[str, ...] = ()  # the strategy's own trainer flags


def parse_strategies(spec: str) -> list[Entry]:
    """`ddp,zero2,mine=path.json`: registry names, or NAME=CONFIG for any DeepSpeed config."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, path = item.partition("=")
        if path:
            out.append(Entry(name, path))
        elif name in STRATEGIES:
            out.append(Entry(name, STRATEGIES[name].ds_config, flags=STRATEGIES[name].flags))
        else:
            out.append(Entry(name, None, f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}"))
    return out


def with_compiled(strategies: list[Entry]) -> list[Entry]:
    """Each registry strategy followed by its compiled twin (the record's compiled_twin), unless it is
    listed already."""
    names, out = {s.name for s in strategies}, []
    for s in strategies:
        out.append(s)
        record, twin = STRATEGIES.get(s.name), f"{s.name}_compiled"
        if record and record.compiled_twin and twin not in names and s.ds_config == record.ds_config:
            out += parse_strategies(twin)
    return out


@dataclass
class Setup:
    """One benchmark: the matrix (strategies x world sizes x repeats), what every run shares (model,
    batch, data, step count) and how runs are launched. scripts/benchmark.py's flags, and defaults."""

    strategies: list[Entry] = field(default_factory=lambda: parse_strategies(",".join(DEFAULT_STRATEGIES)))
    world_sizes: list[int] = field(default_factory=lambda: machine_ranks())  # every GPU; 2 on CPU
    preset: str = "25m"
    steps: int = 8  # optimizer steps per run, warm-up included
    warmup_steps: int = 2  # first steps of each run left out of the timing
    probe_interval: int = 2  # every other step probed (time split, bytes), the others timed
    log_interval: int = 1  # steps per train record; the host waits for the device at each (bench-gpu: a few)
    repeats: int = 2  # runs per configuration, interleaved; the median is reported
    max_seq_len: int = 128
    batch_size: int = 4  # micro batch per device
    accumulation_steps: int = 1
    dtype: str = "auto"  # the trainers' --dtype: fp32 on CPU, bf16 on GPU
    data_output_path: str = str(DATA_CACHE)
    output_dir: str = "benchmark_results"
    trainer_args: str = ""  # extra flags for every run, one shell-quoted string
    threads: int = 0  # OMP_NUM_THREADS per rank; 0: CPU cores / world size, at least 1
    timeout: int = 900  # seconds before a run is killed and reported
    compile: bool = False  # add each strategy's compiled twin (the record's compiled_twin)


def machine_ranks() -> list[int]:
    """The default world sizes: what this machine has (llama_train.gpu.default_world_sizes)."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = gpu.visible_gpu_count(gpu.nvidia_smi_gpus(), visible) if torch.cuda.is_available() else 0
    return gpu.default_world_sizes(gpus, os.cpu_count() or 1)


def trainer_command(strategy: Entry, world: int, port: int) -> list[str]:
    """The launch line a user would type for this strategy and world size."""
    if strategy.ds_config is None:
        return [
            *gpu.launcher("torchrun"), "--nproc_per_node", str(world), "--master_port", str(port), "train_ddp.py",
            *strategy.flags,
        ]  # fmt: skip
    return [
        *gpu.deepspeed_command(world), "--master_port", str(port), "train_deepspeed.py",  # honours CUDA_VISIBLE_DEVICES
        "--deepspeed_config", strategy.ds_config, *strategy.flags,
    ]  # fmt: skip


def trainer_flags(setup: Setup, run_dir: Path) -> list[str]:
    """Identical for every strategy: the model, batch, data and step count being compared."""
    return [
        "--preset", setup.preset, "--max_seq_len", str(setup.max_seq_len), "--batch_size", str(setup.batch_size),
        "--accumulation_steps", str(setup.accumulation_steps), "--max_steps", str(setup.steps),
        "--log_interval", str(setup.log_interval), "--probe_interval", str(setup.probe_interval), "--dtype", setup.dtype, "--data_output_path", str(setup.data_output_path),
        "--output_dir", str(run_dir), "--no_export", "--no_final_checkpoint", "--save_interval", "0", "--eval_batches", "1",
        *shlex.split(setup.trainer_args),
    ]  # fmt: skip
