"""How close the trainers get to the machine's limit (scripts/bench_overhead.py): the trainers
against a hand-written loop, our model against transformers' LlamaForCausalLM, and MFU. Each ratio
is a median of medians over interleaved runs; see the script's docstring for what each measures."""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from llama_train.bench.matrix import DATA_CACHE, ROOT
from llama_train.bench.runs import read_records, run_env

GOALS = {"overhead": 0.97, "hf": 1.0, "mfu": 0.8}
TRAINERS = {  # contender -> command (the raw loop is scripts/bench_overhead.py in child mode)
    "raw": [sys.executable, "scripts/bench_overhead.py", "--child_raw"],
    "deepspeed_zero0": [sys.executable, "train_deepspeed.py", "--deepspeed_config", "ds_configs/zero0.json"],
    "ddp": [sys.executable, "train_ddp.py"],
}


@dataclass
class OverheadSetup:
    """scripts/bench_overhead.py's flags, and their defaults."""

    sections: list[str] = field(default_factory=lambda: list(GOALS))
    preset: str = "25m"  # the overhead section's model
    hf_presets: str = "25m,125m"  # the HF comparison's models, comma-separated
    mfu_preset: str = "125m"
    max_seq_len: int = 256
    batch_size: int = 4  # sequences per step
    steps: int = 8  # optimizer steps per run, warm-up included
    warmup_steps: int = 2  # first steps left out of each median
    repeats: int = 3  # runs per contender, interleaved
    threads: int = os.cpu_count() or 1  # torch threads for every contender
    data_output_path: str = str(DATA_CACHE)
    output_dir: str = "benchmark_results/overhead"
    profile: bool = False  # hf section: print the top ops of one step of each model


def trainer_flags(setup: OverheadSetup, preset: str, output_dir: Path) -> list[str]:
    """The trainers' flags, also parsed by the raw loop so that it sees the same data and batches."""
    return [
        "--preset", preset, "--max_seq_len", str(setup.max_seq_len), "--batch_size", str(setup.batch_size),
        "--max_steps", str(setup.steps), "--log_interval", "1", "--dtype", "float32", "--no_export",
        "--eval_batches", "1", "--data_output_path", str(setup.data_output_path), "--output_dir", str(output_dir),
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


def run_contender(name: str, setup: OverheadSetup, preset: str, run_dir: Path) -> list[float]:
    """One single-process run; its per-step times."""
    shutil.rmtree(run_dir, ignore_errors=True)  # the trainers append to an existing metrics.jsonl
    run_dir.mkdir(parents=True)
    out_json = run_dir / "raw.json"
    cmd = TRAINERS[name] + ([str(out_json)] if name == "raw" else []) + trainer_flags(setup, preset, run_dir)
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(1, setup.threads), capture_output=True, text=True)
    (run_dir / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if name == "raw":
        return json.loads(out_json.read_text())["step_time_s"]
    metrics = read_records(run_dir / "metrics.jsonl")
    return [r["step_time_s"] for r in metrics if r["event"] == "train"]


def section_overhead(setup: OverheadSetup) -> list[dict]:
    """raw vs deepspeed_zero0 vs ddp, interleaved; tokens/s ratios to the raw loop."""
    names, medians = list(TRAINERS), {name: [] for name in TRAINERS}
    root = Path(setup.output_dir) / "runs"
    for r in range(setup.repeats):
        for name in names[r % 3 :] + names[: r % 3]:
            times = run_contender(name, setup, setup.preset, root / f"{name}_r{r}")
            medians[name].append(median_after_warmup(times, setup.warmup_steps))
            print(f"  overhead {name:16s} run {r + 1}: {medians[name][-1] * 1000:.0f} ms/step", flush=True)
    raw = statistics.median(medians["raw"])
    tokens = setup.batch_size * setup.max_seq_len
    rows = []
    for name in names[1:]:
        t = statistics.median(medians[name])
        rows.append({
            "section": "overhead", "what": f"{name} / raw loop ({setup.preset})", "ratio": raw / t,
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


def section_hf(setup: OverheadSetup) -> list[dict]:
    """Per preset: steps alternate ours/HF (the order flips each step); medians per model."""
    import torch

    torch.set_num_threads(setup.threads)
    rows = []
    for preset_name in setup.hf_presets.split(","):
        models, opts, margs = build_pair(preset_name, setup.max_seq_len)
        tokens = torch.randint(0, margs.vocab_size, (setup.batch_size, setup.max_seq_len + 1))
        times = {k: [] for k in models}
        total = setup.warmup_steps + (setup.steps - setup.warmup_steps) * setup.repeats
        for i in range(total):
            for kind in list(models)[:: 1 if i % 2 == 0 else -1]:
                t0 = time.perf_counter()
                train_step(kind, models[kind], opts[kind], tokens)
                times[kind].append(time.perf_counter() - t0)
        if setup.profile:
            for kind in models:
                print(
                    f"\n== {kind} ({preset_name}): top ops of one step ==\n"
                    + profile_step(kind, models, opts, tokens)
                )
        ours, hf = (median_after_warmup(times[k], setup.warmup_steps) for k in ("ours", "hf"))
        n = setup.batch_size * setup.max_seq_len
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


def section_mfu(setup: OverheadSetup) -> list[dict]:
    """Model FLOP/s of single-process ZeRO-0 runs over the fp32 matmul rate the trainer measures at
    start-up (its `mfu` record). A busy machine can only make that matmul look slower, so the
    ratio uses the fastest rate any run measured (and the median model FLOP/s); the trainer's own
    per-run MFU values, each against its own start-up measurement, are kept beside it."""
    flops, peaks, own_mfu = [], [], []
    for r in range(setup.repeats):
        run_dir = Path(setup.output_dir) / "runs" / f"mfu_{setup.mfu_preset}_r{r}"
        run_contender("deepspeed_zero0", setup, setup.mfu_preset, run_dir)
        records = read_records(run_dir / "metrics.jsonl")
        config = next(x for x in records if x["event"] == "config")
        train = [x for x in records if x["event"] == "train"][setup.warmup_steps :]
        step = statistics.median(x["step_time_s"] for x in train)
        flops.append(config["flops_per_token"] * config["tokens_per_step"] / step)
        peaks.append(config["peak_flops"])
        own_mfu.append(statistics.median(x["mfu"] for x in train))
        print(f"  mfu {setup.mfu_preset} run {r + 1}: {flops[-1] / 1e9:.1f} GFLOP/s model, matmul "
              f"{peaks[-1] / 1e9:.1f} GFLOP/s, trainer's mfu {own_mfu[-1]:.1%}", flush=True)  # fmt: skip
    achieved, peak = statistics.median(flops), max(peaks)
    return [{
        "section": "mfu", "what": f"MFU, ZeRO-0, 1 process ({setup.mfu_preset})", "ratio": achieved / peak,
        "detail": f"{achieved / 1e9:.1f} GFLOP/s model vs {peak / 1e9:.1f} GFLOP/s fp32 matmul (fastest of the runs' "
        f"start-up measurements; {config['peak_source']}); trainer-reported MFU per run: "
        + ", ".join(f"{m:.1%}" for m in own_mfu),
        "model_flops": flops, "peak_flops": peaks, "trainer_mfu": own_mfu,
    }]  # fmt: skip


SECTIONS = {"overhead": section_overhead, "hf": section_hf, "mfu": section_mfu}


def markdown(rows: list[dict], setup: OverheadSetup) -> str:
    lines = ["| measurement | ratio | goal | detail |", "|---|---|---|---|"]
    for r in rows:
        goal = GOALS[r["section"]]
        mark = "met" if r["ratio"] >= goal else "**not met**"
        lines.append(f"| {r['what']} | {r['ratio']:.3f} | >= {goal} ({mark}) | {r['detail']} |")
    described = (
        f"seq {setup.max_seq_len}, batch {setup.batch_size}, fp32, {setup.threads} threads, {setup.steps} steps per run "
        f"({setup.warmup_steps} warm-up), {setup.repeats} repeats; load (1 min) at the end: {os.getloadavg()[0]:.1f}"
    )
    return described + "\n\n" + "\n".join(lines)


def run(setup: OverheadSetup) -> str:
    """The chosen sections; writes overhead.json and overhead.md to --output_dir, returns the table."""
    out = Path(setup.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for section in setup.sections:
        print(f"== {section}", flush=True)
        rows += SECTIONS[section](setup)
    (out / "overhead.json").write_text(json.dumps(rows, indent=2) + "\n")
    table = markdown(rows, setup)
    (out / "overhead.md").write_text(table + "\n")
    return table
