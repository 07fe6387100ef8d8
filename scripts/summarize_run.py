"""Summarise a run from its metrics.jsonl: loss curve plot, final numbers, where the outputs are.

python scripts/summarize_run.py outputs/demo
"""

import argparse
import json
import os


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("output_dir", help="a trainer's --output_dir")
    p.add_argument("--elapsed", type=int, help="wall seconds to report")
    args = p.parse_args(argv)

    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    config = next(r for r in records if r["event"] == "config")
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    plot = os.path.join(args.output_dir, "loss.png")
    _plot(train, evals, plot)

    tok_s = sorted(r["tokens_per_s"] for r in train[1:] or train)[len(train[1:] or train) // 2]
    lines = [
        f"strategy        {config['strategy']} x {config['world_size']} ({config['dtype']}, {config['num_params'] / 1e6:.2f}M params)",
        f"loss            {train[0]['loss']:.3f} (step {train[0]['step']}) -> {train[-1]['loss']:.3f} (step {train[-1]['step']})",
        f"eval            loss {evals[-1]['eval_loss']:.3f}, perplexity {evals[-1]['eval_ppl']:.1f}"
        if evals
        else "eval            none",
        f"throughput      {tok_s:,.0f} tokens/s (median of logged intervals), MFU {train[-1]['mfu'] * 100:.1f}% vs {config['peak_source']}",
        f"outputs         {args.output_dir}/ (metrics.jsonl, loss.png, checkpoints/, hf/)",
    ]
    if args.elapsed is not None:
        lines.append(f"wall time       {args.elapsed} s")
    print("\n== summary ==\n" + "\n".join(lines))


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
    main()
