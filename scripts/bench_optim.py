"""Time-to-loss: AdamW + cosine vs Muon + cosine vs Muon + WSD, each at the best LR of a small sweep.

    python scripts/bench_optim.py                                   # 25m, 60 steps, 2 LRs each (~6 runs)
    python scripts/bench_optim.py --steps 300 --max_seq_len 256 --batch_size 8 --muon_lrs 0.01,0.02,0.04

Same model, data (the built-in corpus) and batches for all; every run is `python train_ddp.py`, one
process. Prints and writes to --output_dir: optim.md (the table: best LR, final eval loss, tokens and
training seconds to the target, AdamW's over each), results.json (every run's eval curve) and optim.png
(eval loss vs tokens). docs/optimizers.md has a measured table. llama_train/bench/optim.py holds the logic.
"""

import argparse

from llama_train.bench.flags import add_flags
from llama_train.bench.optim import OptimSetup, run
from llama_train.cli import run_script

HELPS = {
    "output_dir": "where runs/, results.json, optim.md and optim.png go (default {})",
    "preset": "model preset for every run (default {})",
    "steps": "optimizer steps per run (default {}); short on a CPU, raise it on a GPU",
    "batch_size": "micro batch (default {})",
    "max_seq_len": "tokens per sequence (default {})",
    "eval_interval": "steps between evaluations: the curve's resolution (default {})",
    "eval_batches": "eval batches per evaluation (default {})",
    "warmup_steps": "LR warmup steps (default {})",
    "adamw_lrs": "AdamW + cosine's sweep of --learning_rate, comma-separated (default {})",
    "muon_lrs": "the Muon contenders' sweep of --muon_lr (default {})",
    "adam_lr": "--learning_rate of the AdamW half of Muon runs (embeddings, norms, head) (default {})",
    "target_loss": "eval loss to reach (default {}: the best AdamW run's final eval loss)",
    "threads": "torch threads per run (default {}: all cores)",
    "timeout": "seconds before a run is killed (default {})",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(parser, OptimSetup(), HELPS)
    print(run(OptimSetup(**vars(parser.parse_args()))))
    return 0


if __name__ == "__main__":
    run_script(main)
