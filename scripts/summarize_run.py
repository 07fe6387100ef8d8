"""Summarise a run from its metrics.jsonl: loss curve plot, final numbers, where the outputs are.

python scripts/summarize_run.py outputs/demo
python scripts/summarize_run.py outputs/demo --goodput   # + goodput across restarts, plotted beside the loss
python scripts/summarize_run.py outputs/demo --ledger    # + which samples each step read; exit 1 unless each once
python scripts/summarize_run.py outputs/mix --mixture    # + each source's token share, configured -> delivered

--goodput (llama_train/telemetry/goodput.py): productive step time over wall-clock, across every restart in
the output_dir, and the badput split: start-up, data build, checkpoint load and save, compile,
evaluation, hangs, lost work (steps trained after the checkpoint the next process resumed from),
time between runs, other.

--ledger (llama_train/telemetry/ledger.py): the run's sample ledger read across every restart, move
and requeue: each process, the epochs with their boundaries, samples seen twice or skipped (by index
in the train set, with the steps), the steps recomputed after a kill, the samples of updates that were
skipped (read, not applied), where a new draw began; exit 0 when every sample up to the last step was
seen exactly once and applied but for the skipped updates' (named), 1 otherwise. A ledger that is damaged,
truncated or of another run is an `error:` line (exit 2).
"""

import argparse
import json
import os

from llama_train.checkpoint.store import saved_states
from llama_train.cli import run_script
from llama_train.errors import ConfigError
from llama_train.telemetry.goodput import goodput
from llama_train.telemetry.ledger import (
    LEDGER_FILE,
    check_against_checkpoints,
    ledger_report,
    read_ledger,
    report_lines,
)
from llama_train.telemetry.mixture_audit import audit_lines, mixture_audit

# what a run may leave in its output_dir, listed when present
OUTPUTS = (
    "metrics.jsonl",
    "metrics.csv",
    "loss.png",
    "tensorboard/",
    "wandb/",
    "checkpoints/",
    "hf/",
    "eval_tasks/",
    "profile/",
)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("output_dir", help="a trainer's --output_dir")
    p.add_argument("--elapsed", type=int, help="wall seconds to report")
    p.add_argument("--goodput", action="store_true", help="goodput across restarts; plotted beside the loss")
    p.add_argument(
        "--ledger", nargs="?", const="", metavar="PATH",
        help="which train samples each step read, across restarts and moves, and which skipped updates left "
        "unapplied; exit 1 unless every sample up to the last step was seen exactly once. PATH: a copy of the "
        f"run's ledger (default <output_dir>/{LEDGER_FILE})",
    )  # fmt: skip
    p.add_argument(
        "--mixture", action="store_true",
        help="each source's share of the train tokens, configured against delivered (from the sample ledger, "
        "across resumes, moves and --allow_data_change re-mixes)",
    )  # fmt: skip
    args = p.parse_args(argv)

    path = os.path.join(args.output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file; give a trainer's --output_dir")
    with open(path) as f:
        records = [json.loads(line) for line in f]
    config = next((r for r in records if r["event"] == "config"), None)  # older branches: none
    train = [r for r in records if r["event"] == "train"]
    evals = [r for r in records if r["event"] == "eval"]
    plot = os.path.join(args.output_dir, "loss.png")
    split = goodput(records) if args.goodput else None
    _plot(train, evals, plot, split)

    steady = sorted(train[1:] or train, key=lambda r: r["tokens_per_s"])  # the first interval warms up
    median = steady[len(steady) // 2]  # its tokens/s and its MFU: the same interval
    peak = config["peak_source"] if config else "an unknown peak (no config record)"
    lines = [
        f"strategy        {config['strategy']} x {config['world_size']} ({config['dtype']}, {config['num_params'] / 1e6:.2f}M params)"
        if config
        else "strategy        unknown (no config record: the run's first process resumed another run's checkpoint)",
        f"loss            {train[0]['loss']:.3f} (step {train[0]['step']}) -> {train[-1]['loss']:.3f} (step {train[-1]['step']})",
        eval_line(evals[-1]) if evals else "eval            none",
        *task_lines(evals),
        *source_lines(evals[-1] if evals else {}),
        f"throughput      {median['tokens_per_s']:,.0f} tokens/s (median of logged intervals), MFU {median['mfu'] * 100:.1f}% vs {peak}",
        *save_plan_lines(records),
        f"outputs         {args.output_dir}/ ({', '.join(o for o in OUTPUTS if os.path.exists(os.path.join(args.output_dir, o)))})",
    ]
    if args.elapsed is not None:
        lines.append(f"wall time       {args.elapsed} s")
    if split:
        lines += goodput_lines(split)
    more, code = ledger_lines(args)
    print("\n== summary ==\n" + "\n".join(lines + more))
    return code


def save_plan_lines(records: list[dict]) -> list[str]:
    """--save_interval auto's last decision (train/cadence.py) and what the saves cost."""
    plans = [r for r in records if r["event"] == "save_plan"]
    saves = [r["seconds"] for r in records if r["event"] == "save"]
    if not plans:
        return []
    cost = f"; {len(saves)} saves, {sum(saves):.1f} s in all" if saves else ""
    return [f"checkpoints     auto: every {plans[-1]['interval']} steps ({plans[-1]['reason']}){cost}"]


def ledger_lines(args) -> tuple[list[str], int]:
    """--ledger's report (exit 1 unless every sample was read once) and --mixture's audit."""
    lines, code, path = [], 0, args.ledger or os.path.join(args.output_dir, LEDGER_FILE)
    if args.ledger is not None:
        report = ledger_of(args.output_dir, path)
        lines += report_lines(report)
        code = 0 if report["ok"] else 1
    if args.mixture:
        records = read_ledger(path)
        run = check_against_checkpoints(path, records, saved_states(args.output_dir))
        lines += audit_lines(mixture_audit(records, run))
    return lines, code


def eval_line(ev: dict) -> str:
    """The last evaluation: loss, perplexity and bits per byte (runs from before bpb: without it)."""
    bpb = f", bits per byte {ev['eval_bpb']:.3f}" if ev.get("eval_bpb") is not None else ""
    return f"eval            loss {ev['eval_loss']:.3f}, perplexity {ev['eval_ppl']:.1f}{bpb}"


def task_lines(evals: list[dict]) -> list[str]:
    """Each --eval_tasks task's accuracy at the first evaluation that scored it and at the last, with
    its item count and standard error (cloze: perplexity too)."""
    scored = [e for e in evals if e.get("tasks")]
    if not scored:
        return []
    first, last = scored[0], scored[-1]
    lines = []
    for name, t in last["tasks"].items():
        a = first["tasks"].get(name, t)
        more = f", acc_norm {a['acc_norm']:.3f} -> {t['acc_norm']:.3f}" if "acc_norm" in t else ""
        more += f", ppl {a['ppl']:.1f} -> {t['ppl']:.1f}" if "ppl" in t else ""
        lines.append(
            f"{'tasks' if not lines else '':<16}{name} acc {a['acc']:.3f} (step {first['step']}) -> {t['acc']:.3f} "
            f"(step {last['step']}){more}; n {t['n']}, stderr {t['stderr']:.3f}"
        )
    return lines


def source_lines(ev: dict) -> list[str]:
    """A mixture's last evaluation per source: loss and bits per byte."""
    return [
        f"{'eval by source' if i == 0 else '':<16}{name}: loss {s['eval_loss']:.3f}, bits per byte {s['eval_bpb']:.3f}"
        for i, (name, s) in enumerate((ev.get("sources") or {}).items())
    ]


def ledger_of(output_dir: str, path: str) -> dict:
    """The report of the ledger at `path` for the run in `output_dir`, checked against its checkpoints."""
    records = read_ledger(path)
    run = check_against_checkpoints(path, records, saved_states(output_dir))
    return ledger_report(records, run)


def goodput_lines(g: dict) -> list[str]:
    wall = g["wall_s"]
    lines = [
        f"goodput         {g['goodput'] * 100:.1f}% ({g['productive_s']:.1f} s of training steps in {wall:.1f} s "
        f"wall-clock, {g['restarts']} restart(s))",
        f"lost work       {g['lost_steps']} steps recomputed ({g['badput_s']['lost_work']:.1f} s)",
    ]
    lines += [f"  {k:<14}{v:>9.1f} s {v / wall * 100:5.1f}%" for k, v in g["badput_s"].items() if wall > 0]
    return lines


def _plot(train, evals, path, split=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 if split else 1, figsize=(11 if split else 6, 3.5), squeeze=False)
    ax = axes[0][0]
    if split:
        _plot_goodput(axes[0][1], split)
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_goodput(ax, g: dict):
    """One horizontal bar per kind of time, productive first, as a share of the wall-clock."""
    parts = {"productive": g["productive_s"], **g["badput_s"]}
    names = [k for k, v in parts.items() if v > 0]
    ax.barh(names[::-1], [parts[k] / g["wall_s"] * 100 for k in names[::-1]])
    ax.set_xlabel("% of wall-clock")
    ax.set_title(f"goodput {g['goodput'] * 100:.1f}%, {g['restarts']} restart(s)")


if __name__ == "__main__":
    run_script(main)
