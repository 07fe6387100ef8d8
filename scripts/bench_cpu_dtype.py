"""bf16 against fp32 training steps on this CPU, with the real trainers (DDP and ZeRO-2, 2 ranks):
the measurement `--dtype auto`'s CPU rule rests on (docs/performance.md).

    python scripts/bench_cpu_dtype.py                                   # 25m, 3 interleaved repeats
    python scripts/bench_cpu_dtype.py --preset 125m --repeats 5 --output_dir docs/benchmarks/DATE-cpu-dtype

Writes results.md (the table, with the machine, date and commit) and results.json (every run) to
--output_dir; llama_train/bench/dtype.py holds the logic.
"""

import argparse

from llama_train.bench.dtype import DtypeSetup, run
from llama_train.bench.flags import add_flags
from llama_train.cli import run_script

HELPS = {
    "output_dir": "where runs, results.json and results.md go (default {})",
    "preset": "model preset (default {})",
    "steps": "optimizer steps per run, warm-up included (default {})",
    "warmup_steps": "first steps of each run left out of the timing (default {})",
    "repeats": "runs per strategy and dtype, interleaved; the median is reported (default {})",
    "max_seq_len": "tokens per sequence (default {})",
    "batch_size": "micro batch per rank (default {})",
    "world_size": "ranks per run (default {})",
    "threads": "OMP threads per rank (default {}: cores / ranks)",
    "timeout": "seconds before a run is killed (default {})",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(parser, DtypeSetup(), HELPS)
    print(run(DtypeSetup(**vars(parser.parse_args()))))
    return 0


if __name__ == "__main__":
    run_script(main)
