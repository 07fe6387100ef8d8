"""How close the trainers get to the machine's limit: three ratios, each measured side by side.

    python scripts/bench_overhead.py                                  # all three sections
    python scripts/bench_overhead.py --sections hf --hf_presets 25m --profile   # where the time goes

overhead  A minimal hand-written loop (our Transformer, fused torch AdamW as the trainers use
          it, gradient clipping at the trainers' --grad_clip, the same batches from the same
          dataset through the trainers' own data code: the same math as a trainer step, none of
          the plumbing) against `python train_deepspeed.py` (ZeRO-0) and `python train_ddp.py`,
          each one process with the same thread count: tokens/s of the trainer over tokens/s of
          the raw loop. Goal >= 0.97: the trainers add almost nothing.
hf        Our Transformer against transformers' LlamaForCausalLM at the same config
          (llama_train.hf.to_hf_config): forward + backward + AdamW step, fp32, same random batch,
          steps alternating between the two in one process: tokens/s ratio ours / HF. Goal >= 1.0.
mfu       A single-process ZeRO-0 run of `--mfu_preset`: model FLOP/s over the fp32 matmul rate
          the same process measured at start-up (the trainer's own `mfu`). Goal >= 0.8.

Every number is a median: of per-step times after `--warmup_steps`, then over `--repeats` runs
whose order rotates, so load from elsewhere on the machine hits all contenders alike. Writes
overhead.json and overhead.md to --output_dir and prints the table.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python scripts/bench_overhead.py` from anywhere
    sys.path.insert(0, str(ROOT))

from benchmark import run_env  # noqa: E402  (scripts/ is sys.path[0]): one process, no launcher

GOALS = {"overhead": 0.97, "hf": 1.0, "mfu": 0.8}
TRAINERS = {  # contender -> command (the raw loop is this script in child mode)
    "raw": [sys.executable, "scripts/bench_overhead.py", "--child_raw"],
    "deepspeed_zero0": [sys.executable, "train_deepspeed.py", "--deepspeed_config", "ds_configs/zero0.json"],
    "ddp": [sys.executable, "train_ddp.py"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sections", default="overhead,hf,mfu", help="which of overhead,hf,mfu to run (default: all)"
    )
    p.add_argument("--preset", default="25m", help="model preset of the overhead section (default: 25m)")
    p.add_argument(
        "--hf_presets", default="25m,125m", help="presets of the HF comparison (default: 25m,125m)"
    )
    p.add_argument("--mfu_preset", default="125m", help="preset of the MFU run (default: 125m)")
    p.add_argument("--max_seq_len", type=int, default=256, help="tokens per sequence (default: 256)")
    p.add_argument("--batch_size", type=int, default=4, help="sequences per step (default: 4)")
    p.add_argument(
        "--steps", type=int, default=8, help="optimizer steps per run, warm-up included (default: 8)"
    )
    p.add_argument(
        "--warmup_steps", type=int, default=2, help="first steps left out of each median (default: 2)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per contender, interleaved (default: 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads for every contender (default: all cores)",
    )
    p.add_argument(
        "--data_output_path",
        default=str(ROOT / "data_cache"),
        help="tokenizer + token cache (default: <repo>/data_cache)",
    )
    p.add_argument(
        "--output_dir",
        default="benchmark_results/overhead",
        help="overhead.json, overhead.md and run dirs go here",
    )
    p.add_argument(
        "--profile", action="store_true", help="hf section: print the top ops of one step of each model"
    )
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    if unknown := set(args.sections) - set(GOALS):
        p.error(f"unknown section(s) {sorted(unknown)}; choose from {list(GOALS)}")
    if not 0 <= args.warmup_steps < args.steps:
        p.error(f"--warmup_steps must be in [0, --steps={args.steps})")
    return args


def trainer_flags(args, preset: str, output_dir: Path) -> list[str]:
    """The trainers' flags, also parsed by the raw loop so that it sees the same data and batches."""
    return [
        "--preset", preset, "--max_seq_len", str(args.max_seq_len), "--batch_size", str(args.batch_size),
        "--max_steps", str(args.steps), "--log_interval", "1", "--dtype", "float32", "--no_export",
        "--eval_batches", "1", "--data_output_path", str(args.data_output_path), "--output_dir", str(output_dir),
    ]  # fmt: skip


def median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


# --- section 1: the trainers against a hand-written loop ---


def raw_loop(out_json: str, flags: list[str]):
    """Child mode: the minimal loop on the trainers' data; per-step wall times to `out_json`."""
    import torch

    from llama_train.build import build_data
    from llama_train.config import build_parser, model_args, parse_args
    from llama_train.model import Transformer
    from llama_train.steps import train_steps

    targs = parse_args(build_parser("raw loop"), flags)
    margs = model_args(targs)
    torch.manual_seed(targs.seed)
    model = Transformer(margs)
    data = build_data(targs, margs, rank=0, world=1)
    betas = (targs.beta1, targs.beta2)
    opt = torch.optim.AdamW(
        model.parameters(), targs.learning_rate, betas, targs.adam_eps, targs.weight_decay, fused=True
    )
    times, last = [], time.perf_counter()
    for _step, micro_batches in train_steps(data, targs.batch_size):
        for batch in micro_batches:
            _, loss = model(**batch)
            (loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), targs.grad_clip)  # the same math as the trainers
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        now = time.perf_counter()
        times.append(now - last)  # like the trainers: data fetch included, one step to the next
        last = now
    Path(out_json).write_text(json.dumps({"step_time_s": times}))


def run_contender(name: str, args, preset: str, run_dir: Path) -> list[float]:
    """One single-process run; its per-step times."""
    shutil.rmtree(run_dir, ignore_errors=True)  # the trainers append to an existing metrics.jsonl
    run_dir.mkdir(parents=True)
    out_json = run_dir / "raw.json"
    cmd = TRAINERS[name] + ([str(out_json)] if name == "raw" else []) + trainer_flags(args, preset, run_dir)
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(1, args.threads), capture_output=True, text=True)
    (run_dir / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if name == "raw":
        return json.loads(out_json.read_text())["step_time_s"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in metrics if r["event"] == "train"]


def section_overhead(args) -> list[dict]:
    """raw vs deepspeed_zero0 vs ddp, interleaved; tokens/s ratios to the raw loop."""
    names, medians = list(TRAINERS), {name: [] for name in TRAINERS}
    root = Path(args.output_dir) / "runs"
    for r in range(args.repeats):
        for name in names[r % 3 :] + names[: r % 3]:
            times = run_contender(name, args, args.preset, root / f"{name}_r{r}")
            medians[name].append(median_after_warmup(times, args.warmup_steps))
            print(f"  overhead {name:16s} run {r + 1}: {medians[name][-1] * 1000:.0f} ms/step", flush=True)
    raw = statistics.median(medians["raw"])
    tokens = args.batch_size * args.max_seq_len
    rows = []
    for name in names[1:]:
        t = statistics.median(medians[name])
        rows.append({
            "section": "overhead", "what": f"{name} / raw loop ({args.preset})", "ratio": raw / t,
            "detail": f"{tokens / t:,.0f} vs {tokens / raw:,.0f} tokens/s; step {t * 1000:.0f} vs {raw * 1000:.0f} ms",
            "runs_s": {"raw": medians["raw"], name: medians[name]},
        })  # fmt: skip
    return rows


# --- section 2: our model against transformers' LlamaForCausalLM ---


def build_pair(preset_name: str, max_seq_len: int):
    """Our Transformer and LlamaForCausalLM at the same config, each with its own torch AdamW."""
    import torch
    from transformers import LlamaForCausalLM

    from llama_train.hf import to_hf_config
    from llama_train.model import Transformer, preset

    margs = preset(preset_name, max_seq_len=max_seq_len)
    torch.manual_seed(0)
    ours = Transformer(margs)
    config = to_hf_config(margs)
    config.use_cache = False  # training: no KV cache (as with HF Trainer)
    theirs = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    models = {"ours": ours.train(), "hf": theirs.train()}
    opts = {
        k: torch.optim.AdamW(m.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        for k, m in models.items()
    }
    return models, opts, margs


def train_step(kind: str, model, opt, tokens) -> None:
    """forward + backward + AdamW. Ours takes pre-shifted labels; HF shifts its labels itself."""
    if kind == "ours":
        _, loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    else:
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def section_hf(args) -> list[dict]:
    """Per preset: steps alternate ours/HF (the order flips each step); medians per model."""
    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for preset_name in args.hf_presets.split(","):
        models, opts, margs = build_pair(preset_name, args.max_seq_len)
        tokens = torch.randint(0, margs.vocab_size, (args.batch_size, args.max_seq_len + 1))
        times = {k: [] for k in models}
        total = args.warmup_steps + (args.steps - args.warmup_steps) * args.repeats
        for i in range(total):
            for kind in list(models)[:: 1 if i % 2 == 0 else -1]:
                t0 = time.perf_counter()
                train_step(kind, models[kind], opts[kind], tokens)
                times[kind].append(time.perf_counter() - t0)
        if args.profile:
            for kind in models:
                print(
                    f"\n== {kind} ({preset_name}): top ops of one step ==\n"
                    + profile_step(kind, models, opts, tokens)
                )
        ours, hf = (median_after_warmup(times[k], args.warmup_steps) for k in ("ours", "hf"))
        n = args.batch_size * args.max_seq_len
        rows.append({
            "section": "hf", "what": f"ours / LlamaForCausalLM ({preset_name})", "ratio": hf / ours,
            "detail": f"{n / ours:,.0f} vs {n / hf:,.0f} tokens/s; step {ours * 1000:.0f} vs {hf * 1000:.0f} ms",
            "steps_s": times,
        })  # fmt: skip
        print(f"  hf {preset_name}: ours {ours * 1000:.0f} ms, HF {hf * 1000:.0f} ms per step", flush=True)
        del models, opts
    return rows


def profile_step(kind: str, models, opts, tokens, top: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(kind, models[kind], opts[kind], tokens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40)


# --- section 3: MFU of a single-process ZeRO-0 run ---


def section_mfu(args) -> list[dict]:
    """Model FLOP/s of single-process ZeRO-0 runs over the fp32 matmul rate the trainer measures at
    start-up (its `mfu` record). A busy machine can only make that matmul look slower, so the
    ratio uses the fastest rate any run measured (and the median model FLOP/s); the trainer's own
    per-run MFU values, each against its own start-up measurement, are kept beside it."""
    flops, peaks, own_mfu = [], [], []
    for r in range(args.repeats):
        run_dir = Path(args.output_dir) / "runs" / f"mfu_{args.mfu_preset}_r{r}"
        run_contender("deepspeed_zero0", args, args.mfu_preset, run_dir)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        config = next(x for x in records if x["event"] == "config")
        train = [x for x in records if x["event"] == "train"][args.warmup_steps :]
        step = statistics.median(x["step_time_s"] for x in train)
        flops.append(config["flops_per_token"] * config["tokens_per_step"] / step)
        peaks.append(config["peak_flops"])
        own_mfu.append(statistics.median(x["mfu"] for x in train))
        print(f"  mfu {args.mfu_preset} run {r + 1}: {flops[-1] / 1e9:.1f} GFLOP/s model, matmul "
              f"{peaks[-1] / 1e9:.1f} GFLOP/s, trainer's mfu {own_mfu[-1]:.1%}", flush=True)  # fmt: skip
    achieved, peak = statistics.median(flops), max(peaks)
    return [{
        "section": "mfu", "what": f"MFU, ZeRO-0, 1 process ({args.mfu_preset})", "ratio": achieved / peak,
        "detail": f"{achieved / 1e9:.1f} GFLOP/s model vs {peak / 1e9:.1f} GFLOP/s fp32 matmul (fastest of the runs' "
        f"start-up measurements; {config['peak_source']}); trainer-reported MFU per run: "
        + ", ".join(f"{m:.1%}" for m in own_mfu),
        "model_flops": flops, "peak_flops": peaks, "trainer_mfu": own_mfu,
    }]  # fmt: skip


SECTIONS = {"overhead": section_overhead, "hf": section_hf, "mfu": section_mfu}


def markdown(rows: list[dict], args) -> str:
    lines = ["| measurement | ratio | goal | detail |", "|---|---|---|---|"]
    for r in rows:
        goal = GOALS[r["section"]]
        mark = "met" if r["ratio"] >= goal else "**not met**"
        lines.append(f"| {r['what']} | {r['ratio']:.3f} | >= {goal} ({mark}) | {r['detail']} |")
    setup = (
        f"seq {args.max_seq_len}, batch {args.batch_size}, fp32, {args.threads} threads, {args.steps} steps per run "
        f"({args.warmup_steps} warm-up), {args.repeats} repeats; load (1 min) at the end: {os.getloadavg()[0]:.1f}"
    )
    return setup + "\n\n" + "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child_raw"]:  # internal: the raw loop, given OUT_JSON and the trainers' flags
        return raw_loop(argv[1], argv[2:])
    args = parse_args(argv)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    for section in args.sections:
        print(f"== {section}", flush=True)
        rows += SECTIONS[section](args)
    out = Path(args.output_dir)
    (out / "overhead.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = markdown(rows, args)
    (out / "overhead.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
