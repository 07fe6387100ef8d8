"""Time-to-loss: AdamW + cosine against Muon + cosine and Muon + WSD on the same model and data, each at
the best LR of a small sweep run here. Every run is `python train_ddp.py` (one process: on a CPU the
cores go to one rank's matmuls), read back from its metrics.jsonl; the AdamW half of a Muon run keeps
--adam_lr. The target is the best AdamW run's final eval loss unless given; tokens and training
seconds (sum of step times, evaluations left out) to first reach it are reported as AdamW's over
each contender's: above 1 is fewer tokens / less time than AdamW."""

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from llama_train.bench.label import label_line, run_label
from llama_train.bench.runs import launch, run_env, stderr_tail

CONTENDERS = {  # name -> (optimizer, schedule, the LR flag the sweep sets)
    "adamw+cosine": ("adamw", "cosine", "--learning_rate"),
    "muon+cosine": ("muon", "cosine", "--muon_lr"),
    "muon+wsd": ("muon", "wsd", "--muon_lr"),
}


@dataclass
class OptimSetup:
    output_dir: str = "outputs/bench_optim"
    preset: str = "25m"
    steps: int = 60
    batch_size: int = 4
    max_seq_len: int = 64
    eval_interval: int = 10
    eval_batches: int = 8
    warmup_steps: int = 6
    adamw_lrs: str = "1e-3,3e-3"
    muon_lrs: str = "0.01,0.03"
    adam_lr: float = 3e-3
    target_loss: float = 0.0  # 0: the best AdamW run's final eval loss
    threads: int = 0
    timeout: int = 1800


def run_flags(setup: OptimSetup, name: str, lr: str, run_dir: Path) -> list[str]:
    optimizer, schedule, lr_flag = CONTENDERS[name]
    flags = f"--preset {setup.preset} --max_steps {setup.steps} --batch_size {setup.batch_size} "
    flags += f"--max_seq_len {setup.max_seq_len} --eval_interval {setup.eval_interval} --log_interval 1 "
    flags += f"--eval_batches {setup.eval_batches} --warmup_steps {setup.warmup_steps} --dtype float32 "
    flags += (
        f"--optimizer {optimizer} --lr_schedule {schedule} --learning_rate {setup.adam_lr} {lr_flag} {lr} "
    )
    timed = ["--no_export", "--no_final_checkpoint", "--save_interval", "0"]  # no save inside a timed run
    return flags.split() + timed + ["--output_dir", str(run_dir)]


def one_run(setup: OptimSetup, name: str, lr: str) -> dict:
    """Train one contender at one LR; its eval curve (tokens, training seconds, eval loss) or its error."""
    run_dir = Path(setup.output_dir) / "runs" / f"{name}_lr{lr}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "train_ddp.py", *run_flags(setup, name, lr, run_dir)]
    rc, out, err = launch(cmd, run_env(1, setup.threads), setup.timeout)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    row = {"contender": name, "lr": float(lr), "command": " ".join(cmd[1:])}
    if rc != 0:
        return {**row, "error": stderr_tail(err) or stderr_tail(out)}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_step = records[0]["tokens_per_step"]
    seconds, elapsed = {}, 0.0
    for r in records:
        if r["event"] == "train":
            elapsed += r["step_time_s"]
            seconds[r["step"]] = elapsed
    curve = [
        (r["step"] * per_step, seconds[r["step"]], r["eval_loss"]) for r in records if r["event"] == "eval"
    ]
    return {**row, "curve": curve, "final_eval_loss": curve[-1][2]}


def reach(curve: list, target: float) -> tuple[float, float] | None:
    """(tokens, seconds) at the first evaluation at or below `target`; None if never."""
    return next(((tok, sec) for tok, sec, loss in curve if loss <= target), None)


def summarize(rows: list[dict], target: float) -> list[dict]:
    """Per contender: its best LR (lowest final eval loss), tokens and seconds to `target` and the
    ratios AdamW / it (from the best AdamW run)."""
    best = {}
    for r in rows:
        if "error" not in r and r["final_eval_loss"] < best.get(r["contender"], {}).get(
            "final_eval_loss", 1e9
        ):
            best[r["contender"]] = r
    base = reach(best["adamw+cosine"]["curve"], target) if "adamw+cosine" in best else None
    out = []
    for name in CONTENDERS:
        r = best.get(name)
        hit = reach(r["curve"], target) if r else None
        row = {"contender": name, "best_lr": r and r["lr"], "final_eval_loss": r and r["final_eval_loss"]}
        row |= {"tokens_to_target": hit and hit[0], "seconds_to_target": hit and hit[1]}
        row["token_ratio"] = base[0] / hit[0] if base and hit else None
        row["time_ratio"] = base[1] / hit[1] if base and hit else None
        out.append(row)
    return out


def markdown(summary: list[dict], target: float, label: str) -> str:
    def f(v, spec):
        return "—" if v is None else format(v, spec)

    lines = [
        f"Target eval loss {target:.4f}. {label}",
        "",
        "| contender | best LR | final eval loss | tokens to target | train s to target | AdamW tokens / these | AdamW s / these |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        cells = [
            s["contender"],
            f(s["best_lr"], "g"),
            f(s["final_eval_loss"], ".4f"),
            f(s["tokens_to_target"], ",.0f"),
        ]
        cells += [f(s["seconds_to_target"], ".1f"), f(s["token_ratio"], ".2f"), f(s["time_ratio"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], summary: list[dict], path: Path, footer: str):
    """Eval loss against tokens for every contender's best run (dashed: the other LRs of its sweep)."""
    from llama_train.bench.plots import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    best = {(s["contender"], s["best_lr"]) for s in summary}
    for r in (r for r in rows if "error" not in r):
        tokens, _, losses = zip(*r["curve"])
        chosen = (r["contender"], r["lr"]) in best
        ax.plot(
            tokens,
            losses,
            "-" if chosen else ":",
            alpha=1 if chosen else 0.5,
            label=f"{r['contender']} lr {r['lr']:g}",
        )
    ax.set_xlabel("training tokens")
    ax.set_ylabel("eval loss")
    ax.set_title("Eval loss vs tokens (solid: each contender's best LR)")
    ax.legend(fontsize=7)
    _save(fig, path, footer)
    plt.close(fig)


def run(setup: OptimSetup) -> str:
    """Every contender at every LR of its sweep, then the summary: results.json, optim.md, optim.png."""
    out = Path(setup.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweeps = {
        n: (setup.adamw_lrs if opt == "adamw" else setup.muon_lrs) for n, (opt, _, _) in CONTENDERS.items()
    }
    rows = [one_run(setup, name, lr) for name, lrs in sweeps.items() for lr in lrs.split(",")]
    adamw = [r["final_eval_loss"] for r in rows if r["contender"] == "adamw+cosine" and "error" not in r]
    target = setup.target_loss or (min(adamw) if adamw else 0.0)
    summary, label = summarize(rows, target), run_label()
    (out / "results.json").write_text(
        json.dumps({"label": label, "target": target, "summary": summary, "runs": rows}, indent=1)
    )
    plot(rows, summary, out / "optim.png", label_line(label))
    text = markdown(summary, target, label_line(label))
    (out / "optim.md").write_text(text + "\n")
    return (
        text
        + "\n\n"
        + "\n".join(f"error: {r['contender']} lr {r['lr']}: {r['error']}" for r in rows if "error" in r)
    )
