"""DDP vs ZeRO-0/1/2/3 (+ CPU offload) on the same model, batch and data: speed, and memory
against the ZeRO paper.

    python scripts/benchmark.py                                  # 7 strategies, 2 ranks, 25m preset
    python scripts/benchmark.py --strategies ddp,zero1,zero3 --world_sizes 1,2 --preset 125m --steps 12
    python scripts/benchmark.py --strategies zero2,mine=path/to/my_zero.json   # your own ds config

Every configuration launches the real trainers as users do (`torchrun train_ddp.py`,
`deepspeed train_deepspeed.py`), with the same preset, sequence length, micro batch,
accumulation and data; only the strategy and the world size change. Each run logs every
optimizer step; the first `--warmup_steps` are dropped and the run's step time is the median of
the rest. Each configuration runs `--repeats` times, strategies interleaved (the order rotates
each round) so drift on a shared machine hits all of them alike, and the median run is reported.

Per configuration: tokens/s (total and per device), step time and its ratio to DDP at the same
world size, MFU (against the device peak: a GPU table; on CPU the median of the fp32 matmul
rates the runs measured at start-up), final loss, peak memory per rank (CUDA max allocated; peak RSS on CPU) and model-state bytes per
rank measured from the tensors each rank holds, next to the ZeRO paper's expectation. A gap over
10% is explained from the measured breakdown and the DeepSpeed config. A failed configuration
is a row with its error (the last lines of its stderr), not the end of the benchmark.

Writes results.json, results.csv, results.md, throughput.png and memory.png to --output_dir,
plus runs/<strategy>_w<N>_r<i>/ (each run's metrics.jsonl and logs; checkpoints are deleted).
"""

import argparse
import csv
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
if str(ROOT) not in sys.path:  # `python scripts/benchmark.py` from anywhere
    sys.path.insert(0, str(ROOT))

from llama_train.dist import free_port  # noqa: E402

# name -> DeepSpeed config (None: the DDP trainer). The order is the table's order.
STRATEGIES: dict[str, str | None] = {
    "ddp": None,
    "zero0": "ds_configs/zero0.json",
    "zero1": "ds_configs/zero1.json",
    "zero2": "ds_configs/zero2.json",
    "zero3": "ds_configs/zero3.json",
    "zero2_offload": "ds_configs/zero2_offload.json",
    "zero3_offload": "ds_configs/zero3_offload.json",
    "ddp_static": None,  # opt-in: DDP without the unused-parameter search (what find_unused_parameters costs)
}
EXTRA_FLAGS = {"ddp_static": ("--no-find_unused_parameters",)}
DEFAULT_STRATEGIES = list(STRATEGIES)[:7]  # DDP and the six DeepSpeed configs
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # model params and grads, by trainer dtype
GAP_TOLERANCE = 0.10  # measured vs expected model state: explain anything further apart
STDERR_TAIL_LINES = 6  # lines of a failed run's stderr kept as its error
# fields of a run that are medians over repeats in the summary row
NUMERIC = (
    "tokens_per_s", "tokens_per_s_per_device", "step_time_s", "mfu", "final_loss", "peak_mem_bytes",
    "model_state_bytes", "wall_s", "load_1m",
)  # fmt: skip


@dataclass
class Strategy:
    name: str
    ds_config: str | None  # None: torchrun train_ddp.py
    error: str | None = None  # set when the name cannot be run at all
    flags: tuple[str, ...] = ()  # the strategy's own trainer flags


def parse_strategies(spec: str) -> list[Strategy]:
    """`ddp,zero2,mine=path.json`: registry names, or NAME=CONFIG for any DeepSpeed config."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, path = item.partition("=")
        if path:
            out.append(Strategy(name, path))
        elif name in STRATEGIES:
            out.append(Strategy(name, STRATEGIES[name], flags=EXTRA_FLAGS.get(name, ())))
        else:
            out.append(Strategy(name, None, f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}"))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help="comma-separated: " + ", ".join(STRATEGIES) + ", or NAME=PATH to any DeepSpeed config "
        "(default: all but ddp_static, which is DDP with --no-find_unused_parameters)",
    )
    p.add_argument("--world_sizes", default="2", help="comma-separated ranks per run (default: 2)")
    p.add_argument("--preset", default="25m", help="model preset of llama_train/model.py (default: 25m)")
    p.add_argument(
        "--steps",
        type=int,
        default=7,
        help="optimizer steps per run, warm-up included (default: 7, i.e. 5 timed; with the other defaults "
        "the 14-run matrix takes about 7 minutes on 2 idle CPU cores: start-up dominates each run)",
    )
    p.add_argument(
        "--warmup_steps",
        type=int,
        default=2,
        help="first steps of each run left out of the timing (default: 2; keep it >= 2: the first step warms the "
        "allocator and step 2 also takes the memory record)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs per configuration; the median is reported (default: 2, to stay under 15 minutes on a busy "
        "2-core machine; use 3+ for numbers you publish)",
    )
    p.add_argument("--max_seq_len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--batch_size", type=int, default=4, help="micro batch per device (default: 4)")
    p.add_argument("--accumulation_steps", type=int, default=1, help="micro batches per step (default: 1)")
    p.add_argument(
        "--dtype", default="auto", help="trainer --dtype (default: auto = fp32 on CPU, bf16 on GPU)"
    )
    p.add_argument(
        "--data_output_path",
        default=str(ROOT / "data_cache"),
        help="tokenizer + token cache shared by all runs, built by the first (default: <repo>/data_cache)",
    )
    p.add_argument(
        "--output_dir",
        default="benchmark_results",
        help="results.{json,csv,md}, plots, runs/ (default: benchmark_results)",
    )
    p.add_argument(
        "--trainer_args",
        default="",
        help="extra flags for every run, one string in the = form: "
        "--trainer_args='--gradient_checkpointing --data_path my.jsonl'",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="OMP_NUM_THREADS per rank (default 0: CPU cores / world size, at least 1)",
    )
    p.add_argument(
        "--timeout", type=int, default=900, help="seconds before a run is killed and reported (default: 900)"
    )
    args = p.parse_args(argv)
    problems = [f"--{k} must be >= 1" for k in ("steps", "repeats") if getattr(args, k) < 1]
    if not 0 <= args.warmup_steps < args.steps:
        problems.append(f"--warmup_steps must be in [0, --steps={args.steps}), got {args.warmup_steps}")
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        problems.append(f"--world_sizes must be integers like 1,2, got {args.world_sizes!r}")
    if problems:
        p.error("; ".join(problems))
    args.strategies = parse_strategies(args.strategies)
    return args


# --- running one configuration ---


def trainer_command(strategy: Strategy, world: int, port: int) -> list[str]:
    """The launch line a user would type for this strategy and world size."""
    if strategy.ds_config is None:
        return [
            str(BIN / "torchrun"), "--nproc_per_node", str(world), "--master_port", str(port), "train_ddp.py",
            *strategy.flags,
        ]  # fmt: skip
    return [
        str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(port), "train_deepspeed.py",
        "--deepspeed_config", strategy.ds_config, *strategy.flags,
    ]  # fmt: skip


def trainer_flags(args, run_dir: Path) -> list[str]:
    """Identical for every strategy: the model, batch, data and step count being compared."""
    return [
        "--preset", args.preset, "--max_seq_len", str(args.max_seq_len), "--batch_size", str(args.batch_size),
        "--accumulation_steps", str(args.accumulation_steps), "--max_steps", str(args.steps),
        "--log_interval", "1", "--dtype", args.dtype, "--data_output_path", str(args.data_output_path),
        "--output_dir", str(run_dir), "--no_export", "--eval_batches", "1", *shlex.split(args.trainer_args),
    ]  # fmt: skip


def run_env(world: int, threads: int) -> dict:
    env = dict(os.environ)
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    env.update(OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a benchmark started under a launcher must not leak its rank into runs
    return env


def stderr_tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    """The last meaningful lines: progress-bar redraws, blank lines, Python warnings (with the source
    line the warnings module echoes after each) and the copies every rank prints of one error dropped."""
    kept, skip_next = [], False
    for line in (part.strip() for chunk in text.splitlines() for part in chunk.split("\r")):
        if skip_next or "Warning: " in line:
            skip_next = not skip_next
            continue
        if line and "it/s]" not in line and "s/it]" not in line and line != "return func(*args, **kwargs)":
            kept.append(line)
    unique = list(dict.fromkeys(reversed(kept)))[:lines]  # the last occurrence of each line
    return "\n".join(reversed(unique))


def launch(cmd: list[str], env: dict, timeout: int) -> tuple[int, str, str]:
    """(exit code, stdout, stderr). The launcher and its ranks get their own process group, so a run
    past `timeout` is ended whole: killing only the launcher would leave its ranks running."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return -9, stdout, stderr + f"\nbenchmark: killed after --timeout {timeout} s"


def run_one(strategy: Strategy, world: int, repeat: int, args) -> dict:
    """Launch one run; its row (with `error` set when it failed)."""
    row = {"strategy": strategy.name, "world_size": world, "repeat": repeat, "load_1m": os.getloadavg()[0]}
    if strategy.error:
        return {**row, "error": strategy.error}
    run_dir = Path(args.output_dir) / "runs" / f"{strategy.name}_w{world}_r{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a stale metrics.jsonl would be appended to
    run_dir.mkdir(parents=True)
    port = free_port()
    cmd = trainer_command(strategy, world, port) + trainer_flags(args, run_dir)
    (run_dir / "command.txt").write_text(" ".join(cmd) + "\n")
    start = time.perf_counter()
    rc, stdout, stderr = launch(cmd, run_env(world, args.threads), args.timeout)
    row["wall_s"] = time.perf_counter() - start
    (run_dir / "stdout.log").write_text(stdout)
    (run_dir / "stderr.log").write_text(stderr)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the final checkpoint: hundreds of MB
    if rc != 0:
        return {**row, "error": f"exit code {rc}: " + (stderr_tail(stderr) or stderr_tail(stdout))}
    try:
        return {**row, **read_run(run_dir / "metrics.jsonl", args.warmup_steps)}
    except (OSError, ValueError, KeyError, StopIteration) as e:
        return {**row, "error": f"unreadable metrics.jsonl: {type(e).__name__}: {e}"}


def read_run(path: Path, warmup: int) -> dict:
    """One run's numbers from its metrics.jsonl: median step time after warm-up, memory record."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    config = next(r for r in records if r["event"] == "config")
    train = [r for r in records if r["event"] == "train"]
    memory = next(r for r in records if r["event"] == "memory")
    timed = [r["step_time_s"] for r in train if r["step"] > warmup]
    if not timed:
        raise ValueError(f"no train records after the {warmup} warm-up steps")
    step_time, world = statistics.median(timed), config["world_size"]
    tok_s = config["tokens_per_step"] / step_time
    # rank 0's last train record saw the whole run; the memory record has every rank at step 2
    peaks = list(memory["peak_mem_bytes"])
    peaks[0] = max(peaks[0], train[-1]["peak_mem_bytes"])
    states = memory["model_state_bytes"]
    worst = max(range(len(states)), key=states.__getitem__)  # the rank that holds the most
    return {
        "trainer_strategy": config["strategy"],
        "dtype": config["dtype"],
        "num_params": config["num_params"],
        "zero_stage": memory["zero_stage"],
        "tokens_per_s": tok_s,
        "tokens_per_s_per_device": tok_s / world,
        "step_time_s": step_time,
        "flops_per_token": config["flops_per_token"],
        "peak_flops": config["peak_flops"],  # this run's (on CPU: a matmul timed at its start)
        "peak_source": config["peak_source"],
        "final_loss": train[-1]["loss"],
        "peak_mem_bytes": max(peaks),
        "peak_mem_bytes_per_rank": peaks,
        "model_state_bytes": states[worst],
        "model_state_bytes_per_rank": states,
        "breakdown": memory["breakdown"][worst],
        "expected_model_state_bytes": memory["expected_model_state_bytes"],
        "timed_steps": len(timed),
        "largest_param_numel": config["model"]["vocab_size"] * config["model"]["dim"],  # embedding / output
    }


# --- the matrix ---


def run_matrix(args) -> list[dict]:
    """Every (strategy, world size) `--repeats` times, interleaved; one row per run."""
    from tqdm.auto import tqdm

    configs = [(s, w) for w in args.world_sizes for s in args.strategies]
    rows = []
    with tqdm(total=len(configs) * args.repeats, desc="benchmark", unit="run", dynamic_ncols=True) as bar:
        for repeat in range(args.repeats):
            shift = repeat % len(configs)  # rotate: no strategy always runs first (or after a quiet spell)
            for strategy, world in configs[shift:] + configs[:shift]:
                bar.set_postfix_str(f"{strategy.name} x{world} #{repeat + 1}")
                row = run_one(strategy, world, repeat, args)
                rows.append(row)
                if row.get("error"):
                    first_line = row["error"].splitlines()[0]
                    bar.write(f"{strategy.name} x{world} #{repeat + 1} failed: {first_line}", file=sys.stderr)
                bar.update(1)
    return rows


def median_run(runs: list[dict]) -> dict:
    """The summary of one configuration's runs: medians of the numbers over the runs that worked;
    `error` when any failed (all numbers None when none worked)."""
    ok = [r for r in runs if not r.get("error")]
    errors = [f"run {r['repeat'] + 1}: {r['error']}" for r in runs if r.get("error")]
    out = {"strategy": runs[0]["strategy"], "world_size": runs[0]["world_size"], "runs": len(ok)}
    if ok:
        # the non-median fields (breakdown, per-rank lists) come from the run with the median step time
        mid = sorted(ok, key=lambda r: r["step_time_s"])[(len(ok) - 1) // 2]
        out.update({k: v for k, v in mid.items() if k not in ("repeat", "error")})
        out.update({k: statistics.median(r[k] for r in ok) for k in NUMERIC})
        out["step_time_s_runs"] = [r["step_time_s"] for r in ok]
    else:
        out.update(dict.fromkeys(NUMERIC + ("expected_model_state_bytes",)))
    out["error"] = f"{len(errors)}/{len(runs)} runs failed; " + "\n".join(errors) if errors else None
    return out


def set_mfu(rows: list[dict]):
    """MFU of each run against one peak per world size: the median of the peaks its runs measured.
    On CPU each run times a matmul at start-up, under whatever else runs then; one shared peak
    keeps the strategies' MFU comparable (it is the same machine and thread count)."""
    for world in {r["world_size"] for r in rows}:
        ok = [r for r in rows if r["world_size"] == world and not r.get("error")]
        if ok:
            peak = statistics.median(r["peak_flops"] for r in ok)
            for r in ok:
                r["mfu"] = r["tokens_per_s"] * r["flops_per_token"] / (peak * world)
                r["mfu_peak_flops"] = peak


def summarize(rows: list[dict], strategies: list[Strategy]) -> list[dict]:
    """One row per (strategy, world size), in the order asked for, with ratios to DDP and to the
    ZeRO paper's model-state bytes."""
    set_mfu(rows)
    order = {s.name: i for i, s in enumerate(strategies)}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["world_size"], order[r["strategy"]], r["strategy"]), []).append(r)
    summary = [median_run(runs) for _, runs in sorted(groups.items(), key=lambda kv: kv[0][:2])]
    configs = {s.name: s.ds_config for s in strategies}
    ddp_time = {s["world_size"]: s["step_time_s"] for s in summary if s["strategy"] == "ddp"}
    for s in summary:
        base = ddp_time.get(s["world_size"])
        s["step_time_vs_ddp"] = s["step_time_s"] / base if base and s["step_time_s"] else None
        measured, expected = s["model_state_bytes"], s["expected_model_state_bytes"]
        s["state_vs_expected"] = measured / expected if measured and expected else None
        s["gap_explanation"] = explain_gap(s, load_config(configs[s["strategy"]]))
    return summary


# --- memory: why measured model state differs from the ZeRO paper ---


def load_config(path: str | None) -> dict:
    """A DeepSpeed config as a dict ({} for DDP or when it cannot be read: the run reports that)."""
    try:
        return json.loads((ROOT / path).read_text()) if path else {}
    except (OSError, ValueError):
        return {}


MASTER_COPY = (
    "an fp32 master copy of the rank's partition (the optimizer's own parameters: DeepSpeed keeps it even "
    "for an fp32 model, where the paper counts the fp32 params as the master)"
)
CPU_GRAD_COPY = (
    "the partition's fp32 gradient in (pinned) CPU memory for the CPU optimizer, beside the engine's"
)
STAGE1_GRADS = (
    "gradients reduced into the rank's partition in backward (the paper's ZeRO-1 keeps all of them)"
)
OTHER = (
    "other engine buffers (e.g. gradient-buffer slack: a parameter straddling a partition edge is held whole)"
)


def known_extras(row: dict, config: dict) -> list[tuple[str, float]]:
    """What DeepSpeed holds beyond (or instead of) the paper's terms, sized from the run's numbers
    and its config: (why, bytes per rank). Read off DeepSpeed 0.19's ZeRO optimizers."""
    zero = config.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {}).get("device", "none") not in ("none", None)
    stage, dtype, elem = row["zero_stage"], row["dtype"], ELEMENT_BYTES[row["dtype"]]
    num_params, shard, largest = (
        row["num_params"],
        row["num_params"] / row["world_size"],
        row["largest_param_numel"],
    )
    extras = []
    if stage >= 1 and dtype == "float32":
        extras.append((MASTER_COPY, 4 * shard))
    if stage == 1 and row["breakdown"].get("params_and_grads", 0) < 1.01 * elem * num_params:  # no param.grad
        extras.append((STAGE1_GRADS, -elem * (num_params - shard)))
    if offload and stage == 3:
        extras.append((CPU_GRAD_COPY, 4 * shard))
    if offload and stage in (1, 2):
        extras.append(
            (f"a copy-back buffer of the updated partition, {elem} B/param (CPU offload)", elem * shard)
        )
        staging = f"two gradient staging buffers for the CPU copy, each the largest parameter ({largest:,})"
        extras.append((staging, 2 * elem * largest))
    if stage == 3:
        bucket = float(zero.get("reduce_bucket_size", 5e8))  # DeepSpeed's default when the config has none
        why = f"the gradient reduce bucket, allocated whole: reduce_bucket_size {bucket:.3g} elements x {elem} B"
        extras.append((why, bucket * elem))
    return extras


def explain_gap(row: dict, config: dict) -> str | None:
    """Why measured model-state bytes differ from the ZeRO paper's by more than GAP_TOLERANCE, from
    the run's breakdown (params+grads, optimizer state, engine buffers) and its DeepSpeed config;
    what the known causes leave over is reported as such."""
    measured, expected = row.get("model_state_bytes"), row.get("expected_model_state_bytes")
    if not measured or not expected or abs(measured / expected - 1) <= GAP_TOLERANCE:
        return None
    P = row["num_params"]

    def size(b: float) -> str:
        return f"{b / P:+.2f} B/param ({b / 2**20:+,.1f} MiB)"

    parts = ", ".join(f"{k.replace('_', ' ')} {v / P:.2f}" for k, v in row["breakdown"].items())
    head = (
        f"measured {measured / P:.2f} B/param ({parts}) vs the paper's {expected / P:.2f} for stage "
        f"{row['zero_stage']}, {row['dtype']}, N={row['world_size']}: {size(measured - expected)}."
    )
    extras = [] if row["strategy"] == "ddp" else known_extras(row, config)
    rest = measured - expected - sum(b for _, b in extras)
    if abs(rest) > 0.01 * expected or not extras:
        extras.append((OTHER, rest))
    return head + " " + "; ".join(f"{size(b)}: {why}" for why, b in extras) + "."


# --- outputs ---

CSV_FIELDS = (
    "strategy", "world_size", "runs", "tokens_per_s", "tokens_per_s_per_device", "step_time_s",
    "step_time_vs_ddp", "mfu", "final_loss", "peak_mem_bytes", "model_state_bytes",
    "expected_model_state_bytes", "state_vs_expected", "zero_stage", "dtype", "num_params", "wall_s",
    "load_1m", "gap_explanation", "error",
)  # fmt: skip


def write_csv(summary: list[dict], path: Path):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summary)


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, spec)


def markdown_table(summary: list[dict], args) -> str:
    """The results table, then the explanations of memory gaps and the errors of failed runs."""
    head = (
        "| strategy | ranks | tokens/s | tokens/s/rank | step (ms) | vs DDP | MFU | final loss "
        "| peak mem/rank (MiB) | model state/rank (MiB) | ZeRO paper (MiB) | measured/paper |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    mib = 1 / 2**20
    for s in summary:
        cells = [
            s["strategy"], str(s["world_size"]), _fmt(s["tokens_per_s"], ",.0f"),
            _fmt(s["tokens_per_s_per_device"], ",.0f"), _fmt(s["step_time_s"], ",.0f", 1000),
            _fmt(s["step_time_vs_ddp"], ".2f") + ("x" if s["step_time_vs_ddp"] else ""),
            _fmt(s["mfu"], ".1%"), _fmt(s["final_loss"], ".3f"), _fmt(s["peak_mem_bytes"], ",.0f", mib),
            _fmt(s["model_state_bytes"], ",.0f", mib), _fmt(s["expected_model_state_bytes"], ",.0f", mib),
            _fmt(s["state_vs_expected"], ".2f") + ("x" if s["state_vs_expected"] else ""),
        ]  # fmt: skip
        if s["error"] and not s["runs"]:
            cells[2] = "**failed**"
        lines.append("| " + " | ".join(cells) + " |")
    gaps = [
        f"- **{s['strategy']} x{s['world_size']}**: {s['gap_explanation']}"
        for s in summary
        if s["gap_explanation"]
    ]
    errors = [f"- **{s['strategy']} x{s['world_size']}**: {s['error']}" for s in summary if s["error"]]
    out = "\n".join(lines)
    if gaps:
        out += f"\n\nModel state more than {GAP_TOLERANCE:.0%} away from the ZeRO paper:\n\n" + "\n".join(
            gaps
        )
    if errors:
        out += "\n\nFailed:\n\n" + "\n".join(e.replace("\n", "\n  ") for e in errors)
    return out


def plot_throughput(summary: list[dict], path: Path):
    """Tokens/s by strategy, one bar per world size; a failed configuration has no bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(s["strategy"] for s in summary))
    worlds = sorted({s["world_size"] for s in summary})
    width = 0.8 / len(worlds)
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 2, 4))
    for j, world in enumerate(worlds):
        by_name = {s["strategy"]: s["tokens_per_s"] for s in summary if s["world_size"] == world}
        xs = [i + (j - (len(worlds) - 1) / 2) * width for i in range(len(names))]
        ax.bar(xs, [by_name.get(n) or 0 for n in names], width, label=f"{world} rank(s)")
    ax.set_xticks(range(len(names)), names, rotation=20)
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title("Throughput by strategy (median of repeats)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_memory(summary: list[dict], path: Path):
    """Model-state bytes per rank, measured vs the ZeRO paper, one panel per world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({s["world_size"] for s in summary})
    fig, axes = plt.subplots(1, len(worlds), figsize=(7 * len(worlds), 4), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        rows = [s for s in summary if s["world_size"] == world]
        xs = range(len(rows))
        for offset, key, label in (
            (-0.2, "model_state_bytes", "measured"),
            (0.2, "expected_model_state_bytes", "ZeRO paper"),
        ):
            ax.bar([x + offset for x in xs], [(s[key] or 0) / 2**20 for s in rows], 0.4, label=label)
        ax.set_xticks(list(xs), [s["strategy"] for s in rows], rotation=20)
        ax.set_ylabel("model state per rank (MiB)")
        ax.set_title(f"Params + grads + optimizer state, {world} rank(s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(rows: list[dict], summary: list[dict], args) -> str:
    """results.json (summary rows, each with its runs), results.csv, results.md, the plots."""
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for s in summary:
        s["repeats"] = [
            r for r in rows if (r["strategy"], r["world_size"]) == (s["strategy"], s["world_size"])
        ]
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_csv(summary, out / "results.csv")
    table = markdown_table(summary, args)
    (out / "results.md").write_text(describe_setup(rows, args) + "\n\n" + table + "\n")
    plot_throughput(summary, out / "throughput.png")
    plot_memory(summary, out / "memory.png")
    return table


def describe_setup(rows: list[dict], args) -> str:
    """What was measured, on what, under which load, and the command that reproduces it."""
    loads = [r["load_1m"] for r in rows]
    peaks = {r["world_size"]: (r["mfu_peak_flops"], r["peak_source"]) for r in rows if not r.get("error")}
    mfu = "; ".join(
        f"{w} rank(s): {p / 1e9:,.1f} GFLOP/s per rank ({src})" for w, (p, src) in sorted(peaks.items())
    )
    names = ",".join(
        s.name if s.ds_config == STRATEGIES.get(s.name) else f"{s.name}={s.ds_config}"
        for s in args.strategies
    )
    command = (
        f"python scripts/benchmark.py --strategies {names} --world_sizes {','.join(map(str, args.world_sizes))} "
        f"--preset {args.preset} --steps {args.steps} --warmup_steps {args.warmup_steps} --repeats {args.repeats} "
        f"--max_seq_len {args.max_seq_len} --batch_size {args.batch_size} --accumulation_steps {args.accumulation_steps}"
        + (f" --trainer_args={shlex.quote(args.trainer_args)}" if args.trainer_args else "")
    )
    return (
        f"Preset `{args.preset}`, sequence length {args.max_seq_len}, micro batch {args.batch_size} per rank, "
        f"accumulation {args.accumulation_steps}, dtype {args.dtype}; {args.steps} steps per run, the first "
        f"{args.warmup_steps} not timed, median step time per run; median of {args.repeats} interleaved runs. "
        f"MFU against the median of the runs' peaks: {mfu or 'none'}. Machine load (1-minute average) at run "
        f"starts: median {statistics.median(loads):.1f}, max {max(loads):.1f}, on {os.cpu_count()} cores.\n\n"
        f"`{command}`"
    )


def main(argv=None):
    args = parse_args(argv)
    started = time.perf_counter()
    rows = run_matrix(args)
    summary = summarize(rows, args.strategies)
    table = write_outputs(rows, summary, args)
    print(table)
    print(f"\n{len(rows)} runs in {time.perf_counter() - started:.0f} s; results in {args.output_dir}/")
    return 0 if all(not s["error"] for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
