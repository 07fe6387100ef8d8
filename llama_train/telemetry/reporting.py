"""Where a run's scalars go besides metrics.jsonl: TensorBoard, Weights & Biases, a CSV.

`--report_to none|tensorboard|wandb|csv[,...]`. Every writer gets the same scalars under the same
names (`SCALARS`) from the StepLogger (llama_train/telemetry/metrics.py), so the DDP and the DeepSpeed trainer
write the same curves; only global rank 0 writes. Each writer has three methods: `log(step,
scalars)`, `flush()` (at every log step) and `close()` (on every way out of the run: the trainers
hold the StepLogger in a `with`). A resumed run (`done` > 0 steps already trained) continues the
same curves: TensorBoard purges events at or after the next step (`purge_step`), the CSV drops its
rows past `done`, W&B resumes the run id kept in <output_dir>/wandb_run_id.

`tensorboard` and `wandb` are optional extras (`.venv/bin/pip install -e '.[tensorboard]' (in the checkout)`); asking
for one that is not installed is a flag error before any work. W&B runs offline with
WANDB_MODE=offline (then `wandb sync <output_dir>/wandb/offline-run-*` uploads it later).
"""

import csv
import importlib.util
import io
import os
import uuid

from llama_train.fileio import atomic_write
from utils.data import parse_mixture, task_entries, task_name

# metrics.jsonl event -> {record field: scalar name}; the names every writer uses
SCALARS = {
    "train": {
        "loss": "train/loss",
        "lr": "train/lr",
        "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_s",
        "mfu": "train/mfu",
        "step_time_s": "train/step_time_s",
        "peak_mem_bytes": "train/peak_mem_bytes",
        "skipped_steps": "train/skipped_steps",
    },
    "eval": {"eval_loss": "eval/loss", "eval_ppl": "eval/ppl", "eval_bpb": "eval/bpb"},
}
SCALAR_NAMES = [name for fields in SCALARS.values() for name in fields.values()]
# an eval record's nested scores: `tasks` {task: {metric: x}} -> eval/tasks/TASK/METRIC,
# `sources` {source: {eval_loss, eval_bpb}} -> eval/sources/SOURCE/loss, .../bpb
TASK_METRICS = ("acc", "acc_norm", "acc_bytes", "stderr", "ppl")
SOURCE_SCALARS = {"eval_loss": "loss", "eval_bpb": "bpb"}


def nested_scalars(record: dict) -> dict:
    """The scalar names and values of an eval record's `tasks` and `sources`."""
    out = {
        f"eval/tasks/{task}/{m}": scores[m]
        for task, scores in (record.get("tasks") or {}).items()
        for m in TASK_METRICS
        if m in scores
    }
    for source, scores in (record.get("sources") or {}).items():
        out |= {f"eval/sources/{source}/{short}": scores[k] for k, short in SOURCE_SCALARS.items()}
    return out


def nested_names(tasks: list[str], sources: list[str]) -> list[str]:
    """The CSV columns a run's tasks and mixture sources add (known from its flags when it starts)."""
    names = [f"eval/tasks/{t}/{m}" for t in tasks for m in TASK_METRICS]
    return names + [f"eval/sources/{s}/{short}" for s in sources for short in SOURCE_SCALARS.values()]


# writer name -> (module it needs, pip extra)
OPTIONAL = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
REPORT_TO = ("none", "tensorboard", "wandb", "csv")


def report_targets(report_to: str) -> list[str]:
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    return [] if names == ["none"] else names


def watch_problems(args) -> list[str]:
    """What is wrong with the watch flags (config.validate collects these with the rest)."""
    problems, names = [], [n.strip() for n in args.report_to.split(",") if n.strip()]
    unknown = [n for n in names if n not in REPORT_TO]
    if unknown or not names or ("none" in names and len(names) > 1):
        problems.append(
            f"--report_to {args.report_to!r}: use none or a comma-separated list of {', '.join(REPORT_TO[1:])}"
        )
    for name in names:
        module, extra = OPTIONAL.get(name, (None, None))
        if module and importlib.util.find_spec(module) is None:
            problems.append(
                f"--report_to {name} needs the {module} package: .venv/bin/pip install -e '.[{extra}]' (in the checkout)"
            )
    for flag in ("skip_loss_zscore", "skip_grad_zscore"):
        if getattr(args, flag) < 0:
            problems.append(f"--{flag} must be >= 0 (0 = off), got {getattr(args, flag)}")
    if args.spike_window < 2:
        problems.append(
            f"--spike_window must be >= 2 (a standard deviation needs two values), got {args.spike_window}"
        )
    return problems


def record_names(record: dict) -> list[str]:
    """The nested scalar names of a run from its `config` record's flags: its --eval_tasks and the
    sources of its --data_path mixture."""
    flags = record.get("args") or {}
    mixture = parse_mixture(flags.get("data_path") or ["builtin"]) or []
    return nested_names(
        [task_name(e) for e in task_entries(flags.get("eval_tasks"))], [s for _, s in mixture]
    )


class CSVWriter:
    """<output_dir>/metrics.csv: a `step` column and one per scalar name; one row per log call."""

    def __init__(self, output_dir: str, done: int, extra: list[str] = ()):
        self.path = os.path.join(output_dir, "metrics.csv")
        fields = ["step", *SCALAR_NAMES, *extra]  # extra: nested_names, the run's tasks and sources
        kept = []
        if done > 0 and os.path.isfile(self.path):  # resume: keep what the checkpoint covers
            with open(self.path, newline="") as f:
                kept = [row for row in csv.DictReader(f) if int(row["step"]) <= done]
        # the kept rows replace the file whole (temp file, fsync, rename): a crash right after a
        # resume leaves them all, never a truncated file; new rows are appended after it
        text = io.StringIO()
        table = csv.DictWriter(text, fieldnames=fields, extrasaction="ignore")  # a resume may drop a task
        table.writeheader()
        table.writerows(kept)
        atomic_write(self.path, text.getvalue())
        self.file = open(self.path, "a", newline="")
        self.csv = csv.DictWriter(self.file, fieldnames=fields, extrasaction="ignore")

    def log(self, step: int, scalars: dict):
        self.csv.writerow({"step": step, **scalars})  # str(float) round-trips exactly

    def flush(self):
        self.file.flush()

    def close(self, failed: bool = False):
        self.file.close()


class TensorBoardWriter:
    """<output_dir>/tensorboard: torch's SummaryWriter. `purge_step`: TensorBoard drops the events at
    or after the first step this process writes, left by the run before a resume (or by an earlier
    run in the same directory), so a resumed curve has no duplicated steps."""

    def __init__(self, output_dir: str, done: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"), purge_step=done + 1)

    def log(self, step: int, scalars: dict):
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def flush(self):
        self.writer.flush()

    def close(self, failed: bool = False):
        self.writer.close()


class WandbWriter:
    """A W&B run in <output_dir>/wandb, named after the output dir, with the `config` record as its
    config. Its id is kept in <output_dir>/wandb_run_id so `--resume` continues the same run."""

    def __init__(self, output_dir: str, done: int, project: str, record: dict):
        import wandb

        id_file = os.path.join(output_dir, "wandb_run_id")
        if done > 0 and os.path.isfile(id_file):
            with open(id_file) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
        settings = wandb.Settings(quiet=True, console="off", x_disable_stats=True, x_save_requirements=False)
        self.run = wandb.init(
            project=project,
            name=os.path.basename(os.path.abspath(output_dir)),
            id=run_id,
            resume="allow",
            dir=output_dir,
            config=record,
            settings=settings,
        )

    def log(self, step: int, scalars: dict):
        self.run.log(scalars, step=step)

    def flush(self):
        pass  # the W&B service writes as it receives

    def close(self, failed: bool = False):
        self.run.finish(exit_code=1 if failed else 0)


class Reporters:
    """The writers `--report_to` asks for, on global rank 0 (none elsewhere), behind one interface."""

    def __init__(self, report_to: str, output_dir: str, rank: int, done: int, project: str, record: dict):
        self.writers = []
        if rank != 0:
            return
        os.makedirs(output_dir, exist_ok=True)
        makers = {
            "tensorboard": lambda: TensorBoardWriter(output_dir, done),
            "wandb": lambda: WandbWriter(output_dir, done, project, record),
            "csv": lambda: CSVWriter(output_dir, done, record_names(record)),
        }
        self.writers = [makers[name]() for name in report_targets(report_to)]

    def log(self, event: str, step: int, record: dict):
        """The scalars of a metrics.jsonl record (None values, e.g. an unknown grad norm, left out)."""
        scalars = {name: record[k] for k, name in SCALARS[event].items() if record.get(k) is not None}
        scalars |= nested_scalars(record)
        for w in self.writers:
            w.log(step, scalars)

    def flush(self):
        for w in self.writers:
            w.flush()

    def close(self, failed: bool = False):
        writers, self.writers = self.writers, []  # closing twice (error after close) is a no-op
        for w in writers:
            w.close(failed)
