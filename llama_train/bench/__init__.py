"""The DDP-vs-ZeRO benchmark's logic; scripts/benchmark.py and scripts/bench_overhead.py are its
command lines.

matrix.py   what is compared: strategies (the registry is ../planner.py's), shared settings, launch lines
runs.py     one run: launched in its own process group, its numbers read from metrics.jsonl
breakdown.py a run's bytes per step and time split from its comm / timing records
summary.py  one row per configuration: medians over repeats, MFU, ratios to DDP and the paper,
            the planner's peak memory
gaps.py     why measured model state and communication differ from the ZeRO paper, term by term
report.py   results.json / results.csv / results.md
plots.py    throughput.png, memory.png and timing.png
overhead.py bench_overhead.py's sections: trainers vs a hand-written loop, ours vs HF, MFU
flags.py    the scripts' flags declared from these settings (one default each)
"""
