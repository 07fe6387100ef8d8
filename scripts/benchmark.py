"""DDP vs ZeRO-0/1/2/3 (+ CPU offload) vs FSDP2 (+ CPU offload) on the same model, batch and data:
speed, whether they compute the same losses, memory and bytes against the ZeRO paper, and which to pick.

    python scripts/benchmark.py                                  # 9 strategies, 2 ranks, 25m preset
    python scripts/benchmark.py --strategies ddp,zero1,zero3 --world_sizes 1,2 --preset 125m --steps 12
    python scripts/benchmark.py --strategies zero2,mine=path/to/my_zero.json   # your own ds config
    python scripts/benchmark.py --strategies ddp,zero2 --compile              # + ddp_compiled, zero2_compiled

Every configuration launches the real trainers as users do (`torchrun train_ddp.py [--fsdp]`,
`deepspeed train_deepspeed.py`), with the same preset, sequence length, micro batch,
accumulation and data; only the strategy and the world size change. Each run logs every
optimizer step and probes every `--probe_interval`-th one (its time split and bytes moved); the first
`--warmup_steps` are dropped, the run's step time is the median of the unprobed steps among the rest,
and a probed step's own wall time against it is the probe's cost. Each configuration runs `--repeats` times, strategies interleaved (the order rotates
each round) so drift on a shared machine hits all of them alike, and the median run is reported.

Per configuration: tokens/s (total and per device), step time and its ratio to DDP at the same
world size, MFU (against the device peak: a GPU table; on CPU the median of the matmul
rates the runs measured at start-up), final loss and the largest per-step relative difference of the
loss from the DDP run's (the strategies should compute the same thing), peak memory per rank (CUDA max allocated; peak RSS on CPU) and model-state bytes per
rank measured from the tensors each rank holds, next to the ZeRO paper's expectation, and the memory
planner's prediction of the peak (llama_train/plan/planner.py, as scripts/plan_memory.py prints it).
Communication: bytes per rank per step by collective, counted as the ZeRO paper counts (DDP through a
comm hook, FSDP2 through its custom-collective hooks, DeepSpeed through deepspeed.comm), next to the
paper's 2 Psi / 3 Psi. Time: each rank's
step split into data wait, forward, backward, communication wait, optimizer and other; the slowest
rank is named. A memory or communication gap over 10% is explained, cause by cause, from the
measured breakdown, the model and the DeepSpeed config. Which to pick: the planner's ranking
(`scripts/plan_memory.py --recommend`) for this workload and this machine's memory, next to the
measured step times, and whether its pick was the fastest. A failed configuration is a row with its
error (the last lines of its stderr), not the end of the benchmark.

Writes results.json, results.csv, results.md (Markdown tables of at most 10 columns), throughput.png,
memory.png and timing.png (a stacked bar per rank and strategy), each labelled with the machine, the
date and the commit, to --output_dir,
plus runs/<strategy>_w<N>_r<i>/ (each run's metrics.jsonl and logs; checkpoints are deleted).
"""

import argparse
import os
import sys
import time

from llama_train.bench.flags import add_flags
from llama_train.bench.matrix import Setup, parse_strategies, with_compiled
from llama_train.bench.report import write_outputs
from llama_train.bench.runs import run_one
from llama_train.bench.summary import summarize
from llama_train.cli import run_script
from llama_train.distributed.strategies import DEFAULT_STRATEGIES, STRATEGIES
from llama_train.errors import ConfigError

D = Setup()  # the defaults
# flag -> help, "{}" standing for the default; each flag's type and default are Setup's
FLAGS = {
    "preset": "model preset of llama_train/model.py (default: {})",
    "steps": "optimizer steps per run, warm-up included (default: {}; with the other defaults start-up "
    "dominates each run: the matrix's measured time is in docs/benchmarks.md)",
    "probe_interval": "the trainers' --probe_interval: one step in this many is probed for its time split and "
    "bytes, the others give the step time (default: {}: alternate steps, so that both come from every run)",
    "warmup_steps": "first steps of each run left out of the timing (default: {}; keep it >= 2: the first "
    "step warms the allocator and step 2 also takes the memory record)",
    "repeats": "runs per configuration; the median is reported (default: {}: the time of `make bench` "
    "grows with it; use 3+ for numbers you publish)",
    "max_seq_len": "tokens per sequence (default: {})",
    "batch_size": "micro batch per device (default: {})",
    "accumulation_steps": "micro batches per step (default: {})",
    "dtype": "trainer --dtype (default: {} = fp32 on CPU, bf16 on GPU)",
    "data_output_path": "tokenizer + token cache shared by all runs, built by the first "
    "(default: <repo>/data_cache)",
    "output_dir": "results.{{json,csv,md}}, plots, runs/ (default: {})",
    "trainer_args": "extra flags for every run, one string in the = form: "
    "--trainer_args='--gradient_checkpointing --data_path my.jsonl'",
    "threads": "OMP_NUM_THREADS per rank (default {}: CPU cores / world size, at least 1)",
    "timeout": "seconds before a run is killed and reported (default: {})",
}


def parse_args(argv=None) -> Setup:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help="comma-separated: " + ", ".join(STRATEGIES) + ", or NAME=PATH to any DeepSpeed config "
        "(default: "
        + ", ".join(DEFAULT_STRATEGIES)
        + "; fsdp2 is train_ddp.py --fsdp. Opt-in: ddp_static / ddp_unused, DDP with "
        "--no-find_unused_parameters (the trainer's default) and with --find_unused_parameters; tp2 / sp2 / pp2, "
        "model parallelism over 2 ranks; the *_compiled twins, which --compile adds; ddp_muon, zero0_muon .. zero3_muon, "
        "the same with --optimizer muon: docs/optimizers.md)",
    )
    world_sizes = ",".join(map(str, D.world_sizes))
    p.add_argument(
        "--world_sizes",
        default=world_sizes,
        help=f"comma-separated ranks per run (default: every GPU this process may use, 2 on CPU; here {world_sizes})",
    )
    add_flags(p, D, FLAGS)
    p.add_argument(
        "--compile",
        action="store_true",
        help="also run each strategy with the trainers' --compile (rows NAME_compiled, next to NAME; not ZeRO-3, "
        "which refuses it). Compile time is left out with the warm-up steps; a cold inductor cache makes the "
        "first compiled run of each shape ~1 min longer on CPU",
    )
    return validated(p, p.parse_args(argv))


def validated(p: argparse.ArgumentParser, args: argparse.Namespace) -> Setup:
    """Every problem with the flags at once, as one usage error; else the benchmark's Setup."""
    problems = [f"--{k} must be >= 1" for k in ("steps", "repeats") if getattr(args, k) < 1]
    if args.probe_interval < 1:
        problems.append(
            f"--probe_interval must be >= 1 (the time split and bytes come from probed steps), got {args.probe_interval}"
        )
    if not 0 <= args.warmup_steps < args.steps:
        problems.append(f"--warmup_steps must be in [0, --steps={args.steps}), got {args.warmup_steps}")
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        problems.append(f"--world_sizes must be integers like 1,2, got {args.world_sizes!r}")
    if problems:
        p.error("; ".join(problems))
    args.strategies = parse_strategies(args.strategies)
    given = [s for s in args.strategies if s.ds_config and s.name not in STRATEGIES]
    if missing := [f"{s.name}={s.ds_config}" for s in given if not os.path.isfile(s.ds_config)]:
        raise ConfigError(f"--strategies {', '.join(missing)}: no such DeepSpeed config file")
    if args.compile:
        args.strategies = with_compiled(args.strategies)
    return Setup(**vars(args))


def run_matrix(setup: Setup) -> list[dict]:
    """Every (strategy, world size) `--repeats` times, interleaved; one row per run."""
    from tqdm.auto import tqdm

    configs = [(s, w) for w in setup.world_sizes for s in setup.strategies]
    rows = []
    with tqdm(total=len(configs) * setup.repeats, desc="benchmark", unit="run", dynamic_ncols=True) as bar:
        for repeat in range(setup.repeats):
            shift = repeat % len(configs)  # rotate: no strategy always runs first (or after a quiet spell)
            for strategy, world in configs[shift:] + configs[:shift]:
                bar.set_postfix_str(f"{strategy.name} x{world} #{repeat + 1}")
                row = run_one(strategy, world, repeat, setup)
                rows.append(row)
                if row.get("error"):
                    first_line = row["error"].splitlines()[0]
                    bar.write(f"{strategy.name} x{world} #{repeat + 1} failed: {first_line}", file=sys.stderr)
                bar.update(1)
    return rows


def main(argv=None):
    setup = parse_args(argv)
    started = time.perf_counter()
    rows = run_matrix(setup)
    summary = summarize(rows, setup.strategies)
    table = write_outputs(rows, summary, setup)
    print(table)
    print(f"\n{len(rows)} runs in {time.perf_counter() - started:.0f} s; results in {setup.output_dir}/")
    return 0 if all(not s["error"] for s in summary) else 1


if __name__ == "__main__":
    run_script(main)
