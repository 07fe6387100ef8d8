"""Summarise a run from its metrics.jsonl: loss curve plot, final numbers, where the outputs are.

python scripts/summarize_run.py outputs/demo
"""

import argparse
import json
import os

from llama_train.cli import run_script
from llama_train.errors import ConfigError

# what a run may leave in its output_dir, listed when present
OUTPUTS = (
    "metrics.jsonl",
    "metrics.csv",
    "loss.png",
    "tensorboard/",
    "wandb/",
    "checkpoints/",
    "hf/",
    "profile/",
)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("output_dir", help="a trainer's --output_dir")
    p.add_argument("--elapsed", type=int, help="wall seconds to report")
    args = p.parse_args(argv)

    path = os.path.join(args.output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file; give a trainer's --output_dir")
    with open(path) as f:
        records = [json.loads(line) for line in f]
    config = next(r for r in records if r["event"] == "config")
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    plot = os.path.join(args.output_dir, "loss.png")
    _plot(train, evals, plot)

    steady = sorted(train[1:] or train, key=lambda r: r["tokens_per_s"])  # the first interval warms up
    median = steady[len(steady) // 2]  # its tokens/s and its MFU: the same interval
    lines = [
        f"strategy        {config['strategy']} x {config['world_size']} ({config['dtype']}, {config['num_params'] / 1e6:.2f}M params)",
        f"loss            {train[0]['loss']:.3f} (step {train[0]['step']}) -> {train[-1]['loss']:.3f} (step {train[-1]['step']})",
        f"eval            loss {evals[-1]['eval_loss']:.3f}, perplexity {evals[-1]['eval_ppl']:.1f}"
        if evals
        else "eval            none",
        f"throughput      {median['tokens_per_s']:,.0f} tokens/s (median of logged intervals), MFU {median['mfu'] * 100:.1f}% vs {config['peak_source']}",
        f"outputs         {args.output_dir}/ ({', '.join(o for o in OUTPUTS if os.path.exists(os.path.join(args.output_dir, o)))})",
    ]
    if args.elapsed is not None:
        lines.append(f"wall time       {args.elapsed} s")
    print("\n== summary ==\n" + "\n".join(lines))
    return 0


def _plot(train, evals, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    run_script(main)
