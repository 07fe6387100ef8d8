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

from llama_train.bench.matrix import DATA_CACHE
from llama_train.bench.runs import read_records, run_env
from llama_train.plan.planner import ROOT

SECTION_NAMES = ("overhead", "hf", "mfu", "head")
# goal per row kind: trainers / raw loop, ours / HF, MFU eager and compiled, compiled / eager tokens/s,
# full-logits / chunked-head step time (the chunked head saves memory and must not cost speed)
GOALS = {"overhead": 0.97, "hf": 1.0, "mfu": 0.8, "mfu_compiled": 0.65, "compile": 1.2, "head": 0.97}
TRAINERS = {  # contender -> command (the raw loop is scripts/bench_overhead.py in child mode)
    "raw": [sys.executable, "scripts/bench_overhead.py", "--child_raw"],
    "deepspeed_zero0": [sys.executable, "train_deepspeed.py", "--deepspeed_config", "ds_configs/zero0.json"],
    "ddp": [sys.executable, "train_ddp.py"],
}


@dataclass
class OverheadSetup:
    """scripts/bench_overhead.py's flags, and their defaults."""

    sections: list[str] = field(default_factory=lambda: list(SECTION_NAMES[:3]))  # head: opt-in
    preset: str = "25m"  # the overhead section's model
    # the HF comparison's shapes, PRESET:BATCHxSEQ: the CPU benchmark models, small micro batches included
    hf_shapes: str = "25m:1x256,25m:4x256,125m:1x256,125m:2x256,125m:4x256"
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
    compile: bool = False  # hf and mfu sections: also our model compiled (--compile)


def trainer_flags(setup: OverheadSetup, preset: str, output_dir: Path) -> list[str]:
    """The trainers' flags, also parsed by the raw loop so that it sees the same data and batches."""
    return [
        "--preset", preset, "--max_seq_len", str(setup.max_seq_len), "--batch_size", str(setup.batch_size),
        "--max_steps", str(setup.steps), "--log_interval", "1", "--dtype", "float32", "--no_export", "--no_final_checkpoint",
        "--save_interval", "0", "--eval_batches", "1", "--data_output_path", str(setup.data_output_path), "--output_dir", str(output_dir),
    ]  # fmt: skip


def median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


# --- section 1: the trainers against a hand-written loop ---


def raw_loop(out_json: str, flags: list[str]):
    """Child mode: the minimal loop on the trainers' data; per-step wall times to `out_json`."""
    import torch

    from llama_train.config import build_parser, model_args, parse_args
    from llama_train.distributed.parallel import Layout
    from llama_train.model import Transformer
    from llama_train.steps import train_steps
    from llama_train.train.build import build_data

    targs = parse_args(build_parser("raw loop"), flags)
    margs = model_args(targs)
    torch.manual_seed(targs.seed)
    model = Transformer(margs)
    data = build_data(targs, margs, targs.tokenizer, Layout(1), rank=0, device=torch.device("cpu"))
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


def run_contender(name: str, setup: OverheadSetup, preset: str, run_dir: Path, extra=()) -> list[float]:
    """One single-process run (`extra`: more trainer flags); its per-step times."""
    shutil.rmtree(run_dir, ignore_errors=True)  # the trainers append to an existing metrics.jsonl
    run_dir.mkdir(parents=True)
    out_json = run_dir / "raw.json"
    cmd = TRAINERS[name] + ([str(out_json)] if name == "raw" else []) + trainer_flags(setup, preset, run_dir)
    cmd += list(extra)
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env(1, setup.threads), capture_output=True, text=True)
    (run_dir / "stderr.log").write_text(proc.stderr)
    shutil.rmtree(
        run_dir / "checkpoints", ignore_errors=True
    )  # none is written (--no_final_checkpoint) unless stopped
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
            "goal": GOALS["overhead"],
            "detail": f"{tokens / t:,.0f} vs {tokens / raw:,.0f} tokens/s; step {t * 1000:.0f} vs {raw * 1000:.0f} ms",
            "runs_s": {"raw": medians["raw"], name: medians[name]},
        })  # fmt: skip
    return rows


# --- section 2: our model against transformers' LlamaForCausalLM, per shape ---


def parse_shapes(spec: str) -> list[tuple[str, int, int]]:
    """`25m:4x256,125m:1x256` -> [(preset, batch, seq), ...]; ValueError naming a bad item."""
    shapes = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, bt = item.partition(":")
        b, _, t = bt.partition("x")
        if not (b.isdigit() and t.isdigit() and int(b) > 0 and int(t) > 0):
            raise ValueError(f"bad shape {item!r}: write PRESET:BATCHxSEQ, e.g. 125m:4x256")
        shapes.append((name, int(b), int(t)))
    return shapes


def build_models(preset_name: str, max_seq_len: int, compiled: bool):
    """Our Transformer, LlamaForCausalLM at the same config (and our model compiled), each with its
    own fused torch AdamW; the same initial weights for ours and ours compiled."""
    import torch
    from transformers import LlamaForCausalLM

    from llama_train.distributed.compile import compile_model
    from llama_train.hf import to_hf_config
    from llama_train.model import Transformer, preset

    margs = preset(preset_name, max_seq_len=max_seq_len)
    torch.manual_seed(0)
    models = {"ours": Transformer(margs)}
    config = to_hf_config(margs)
    config.use_cache = False  # training: no KV cache (as with HF Trainer)
    models["hf"] = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    if compiled:
        torch.manual_seed(0)
        models["ours_compiled"] = compile_model(Transformer(margs), "cpu")
    opts = {
        k: torch.optim.AdamW(m.train().parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        for k, m in models.items()
    }
    return models, opts, margs


def train_step(kind: str, model, opt, tokens) -> None:
    """forward + backward + AdamW. Ours takes pre-shifted labels; HF shifts its labels itself."""
    if kind == "hf":
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss
    else:
        _, loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_shape(setup: OverheadSetup, preset_name: str, batch: int, seq: int):
    """Per-step times of each contender at one shape: the contenders take turns, step by step, in an
    order that rotates every step, so drift on the machine hits them alike."""
    import torch

    models, opts, margs = build_models(preset_name, seq, setup.compile)
    tokens = torch.randint(0, margs.vocab_size, (batch, seq + 1))
    names, times = list(models), {k: [] for k in models}
    for i in range(setup.warmup_steps + (setup.steps - setup.warmup_steps) * setup.repeats):
        for kind in names[i % len(names) :] + names[: i % len(names)]:
            t0 = time.perf_counter()
            train_step(kind, models[kind], opts[kind], tokens)
            times[kind].append(time.perf_counter() - t0)
    if setup.profile:
        for kind in names:
            print(f"\n== {kind} ({preset_name}, {batch}x{seq}): top ops of one step ==\n"
                  + profile_step(kind, models, opts, tokens))  # fmt: skip
    return {k: v[setup.warmup_steps :] for k, v in times.items()}


def ratio_row(what: str, mine: list[float], theirs: list[float], tokens: int) -> dict:
    """HF's step time over ours, step pair by step pair: the median and its spread (min-max)."""
    pairs = sorted(t / m for m, t in zip(mine, theirs))
    ours, hf = statistics.median(mine), statistics.median(theirs)
    return {
        "section": "hf", "what": what, "ratio": statistics.median(pairs), "goal": GOALS["hf"],
        "spread": [pairs[0], pairs[-1]],
        "detail": f"{tokens / ours:,.0f} vs {tokens / hf:,.0f} tokens/s; step {ours * 1000:.0f} vs {hf * 1000:.0f} ms; "
        f"per step pair {pairs[0]:.3f}-{pairs[-1]:.3f} over {len(pairs)}",
        "steps_s": {"ours": mine, "hf": theirs},
    }  # fmt: skip


def section_hf(setup: OverheadSetup) -> list[dict]:
    """Per shape of --hf_shapes: ours (and, with --compile, ours compiled) against HF."""
    import torch

    torch.set_num_threads(setup.threads)
    rows = []
    for preset_name, batch, seq in parse_shapes(setup.hf_shapes):
        times = time_shape(setup, preset_name, batch, seq)
        shape = f"{preset_name}, {batch}x{seq}"
        for kind in [k for k in times if k != "hf"]:
            label = "ours" if kind == "ours" else "ours compiled"
            rows.append(
                ratio_row(f"{label} / LlamaForCausalLM ({shape})", times[kind], times["hf"], batch * seq)
            )
            print(
                f"  hf {shape}: {rows[-1]['what']} {rows[-1]['ratio']:.3f} ({rows[-1]['detail']})", flush=True
            )
    return rows


def profile_step(kind: str, models, opts, tokens, top: int = 18) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(kind, models[kind], opts[kind], tokens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=50)


# --- section 3: MFU of single-process ZeRO-0 runs, eager and compiled ---


def mfu_run(setup: OverheadSetup, r: int, compiled: bool) -> dict:
    """One single-process ZeRO-0 run of --mfu_preset: model FLOP/s (median step after warm-up), the
    matmul rate it measured at start-up, its own median MFU."""
    tag = "compiled" if compiled else "eager"
    run_dir = Path(setup.output_dir) / "runs" / f"mfu_{setup.mfu_preset}_{tag}_r{r}"
    run_contender("deepspeed_zero0", setup, setup.mfu_preset, run_dir, ["--compile"] if compiled else [])
    records = read_records(run_dir / "metrics.jsonl")
    config = next(x for x in records if x["event"] == "config")
    train = [x for x in records if x["event"] == "train"][setup.warmup_steps :]
    step = statistics.median(x["step_time_s"] for x in train)
    compile_s = [x["compile_s"] for x in records if x["event"] == "compile"]
    out = {
        "flops": config["flops_per_token"] * config["tokens_per_step"] / step, "peak": config["peak_flops"],
        "mfu": statistics.median(x["mfu"] for x in train), "tokens_per_s": config["tokens_per_step"] / step,
        "source": config["peak_source"], "compile_s": compile_s[0] if compile_s else None,
    }  # fmt: skip
    print(f"  mfu {setup.mfu_preset} {tag} run {r + 1}: {out['flops'] / 1e9:.1f} GFLOP/s model, matmul "
          f"{out['peak'] / 1e9:.1f} GFLOP/s, trainer's mfu {out['mfu']:.1%}"
          + (f", compile {out['compile_s']:.1f} s" if compiled else ""), flush=True)  # fmt: skip
    return out


def mfu_row(preset_name: str, compiled: bool, got: list[dict], peak: float) -> dict:
    achieved = statistics.median(x["flops"] for x in got)
    detail = (
        f"{achieved / 1e9:.1f} GFLOP/s model vs {peak / 1e9:.1f} GFLOP/s fp32 matmul (fastest of the runs' "
        f"start-up measurements; {got[0]['source']}); trainer-reported MFU per run: "
        + ", ".join(f"{x['mfu']:.1%}" for x in got)
    )
    if compiled:
        detail += "; compile time per run: " + ", ".join(f"{x['compile_s']:.1f} s" for x in got)
    return {
        "section": "mfu", "what": f"MFU, ZeRO-0, 1 process, {'compiled' if compiled else 'eager'} ({preset_name})",
        "ratio": achieved / peak, "goal": GOALS["mfu_compiled" if compiled else "mfu"], "detail": detail,
        "runs": got,
    }  # fmt: skip


def section_mfu(setup: OverheadSetup) -> list[dict]:
    """Model FLOP/s of single-process ZeRO-0 runs over the fp32 matmul rate the trainer measures at
    start-up (its `mfu` record), eager and (with --compile) compiled, runs interleaved. A busy machine
    can only make that matmul look slower, so the ratio uses the fastest rate any run measured (and
    the median model FLOP/s); the trainer's own per-run MFU values are kept beside it."""
    kinds = [False, True] if setup.compile else [False]
    runs = {k: [] for k in kinds}
    for r in range(setup.repeats):
        for compiled in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            runs[compiled].append(mfu_run(setup, r, compiled))
    peak = max(x["peak"] for v in runs.values() for x in v)
    rows = [mfu_row(setup.mfu_preset, compiled, got, peak) for compiled, got in runs.items()]
    if setup.compile:
        eager, comp = (statistics.median(x["tokens_per_s"] for x in runs[k]) for k in kinds)
        rows.append({
            "section": "mfu", "what": f"compiled / eager tokens/s, ZeRO-0, 1 process ({setup.mfu_preset})",
            "ratio": comp / eager, "goal": GOALS["compile"], "detail": f"{comp:,.0f} vs {eager:,.0f} tokens/s",
        })  # fmt: skip
    return rows


# --- section 4: the loss head, chunked against the full logits ---


def head_child(out_json: str, preset_name: str, batch: int, seq: int, chunk: int, steps: int):
    """Child mode: `steps` fwd + bwd + AdamW steps of `preset_name` with `loss_chunk_tokens=chunk`;
    peak RSS (run under MALLOC_MMAP_THRESHOLD_, so freed buffers leave RSS at once and the peak is
    that of live memory) and the RSS before the first step (weights loaded) to `out_json`."""
    import resource

    import torch

    from llama_train.model import Transformer, preset

    torch.manual_seed(0)
    model = Transformer(preset(preset_name, max_seq_len=seq, loss_chunk_tokens=chunk)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq + 1))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for _ in range(steps):
        train_step("ours", model, opt, tokens)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out_json).write_text(json.dumps({"peak_rss": peak, "rss_before": before}))


def head_memory(setup: OverheadSetup, chunk: int) -> dict:
    out = Path(setup.output_dir) / "runs" / f"head_{setup.mfu_preset}_chunk{chunk}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    shape = [setup.mfu_preset, str(setup.batch_size), str(setup.max_seq_len), str(chunk), "2"]
    env = {**run_env(1, setup.threads), "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [sys.executable, "scripts/bench_overhead.py", "--child_head", str(out), *shape]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def section_head(setup: OverheadSetup) -> list[dict]:
    """Peak memory of a --mfu_preset step (own processes), then step times in one process: the same
    model switching between the full logits (loss_chunk_tokens 0) and the chunked head step by step."""
    import torch

    from llama_train.model import PRESETS, Transformer, preset

    chunk = PRESETS[setup.mfu_preset].loss_chunk_tokens
    mem = {c: head_memory(setup, c) for c in (0, chunk)}
    torch.set_num_threads(setup.threads)
    torch.manual_seed(0)
    model = Transformer(preset(setup.mfu_preset, max_seq_len=setup.max_seq_len)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    tokens = torch.randint(0, model.args.vocab_size, (setup.batch_size, setup.max_seq_len + 1))
    times = {0: [], chunk: []}
    for i in range(setup.warmup_steps + (setup.steps - setup.warmup_steps) * setup.repeats):
        for c in (0, chunk) if i % 2 == 0 else (chunk, 0):
            model.output.chunk = c
            t0 = time.perf_counter()
            train_step("ours", model, opt, tokens)
            times[c].append(time.perf_counter() - t0)
    if setup.profile:
        for c in (0, chunk):
            model.output.chunk = c
            label = "full logits" if c == 0 else f"chunked head ({c} tokens a chunk)"
            print(f"\n== {label} ({setup.mfu_preset}): top ops of one step ==\n"
                  + profile_step("ours", {"ours": model}, {"ours": opt}, tokens))  # fmt: skip
    full, chunked = (statistics.median(times[c][setup.warmup_steps :]) for c in (0, chunk))
    saved = mem[0]["peak_rss"] - mem[chunk]["peak_rss"]
    shape = f"{setup.mfu_preset}, {setup.batch_size}x{setup.max_seq_len}"
    logits = setup.batch_size * setup.max_seq_len * model.args.vocab_size * 4
    return [{
        "section": "head", "what": f"step time, full logits / chunked head ({shape}, chunk {chunk})",
        "ratio": full / chunked, "goal": GOALS["head"],
        "detail": f"peak RSS of a step {mem[0]['peak_rss'] / 2**20:,.0f} MiB with the full logits, "
        f"{mem[chunk]['peak_rss'] / 2**20:,.0f} MiB chunked ({saved / 2**20:,.0f} MiB less; the fp32 logits are "
        f"{logits / 2**20:,.0f} MiB; weights loaded: {mem[0]['rss_before'] / 2**20:,.0f} MiB); "
        f"step {full * 1000:.0f} vs {chunked * 1000:.0f} ms",
        "memory": mem, "steps_s": {str(c): v for c, v in times.items()},
    }]  # fmt: skip


SECTIONS = {"overhead": section_overhead, "hf": section_hf, "mfu": section_mfu, "head": section_head}


def markdown(rows: list[dict], setup: OverheadSetup) -> str:
    lines = ["| measurement | ratio | goal | detail |", "|---|---|---|---|"]
    for r in rows:
        mark = "met" if r["ratio"] >= r["goal"] else "**not met**"
        lines.append(f"| {r['what']} | {r['ratio']:.3f} | >= {r['goal']} ({mark}) | {r['detail']} |")
    described = (
        f"seq {setup.max_seq_len}, batch {setup.batch_size} (hf: per shape), fp32, {setup.threads} threads, "
        f"{setup.steps} steps per run ({setup.warmup_steps} warm-up), {setup.repeats} repeats; "
        f"load (1 min) at the end: {os.getloadavg()[0]:.1f}"
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
