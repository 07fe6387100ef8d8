"""bf16 against fp32 on a CPU, with the real trainers: the measurement behind `--dtype auto`'s CPU rule
(llama_train.distributed.dist.choose_dtype). DDP and ZeRO-2 each run in both dtypes, the four
configurations interleaved (the order rotates each round, so drift on a shared machine hits all alike);
a configuration's step time is the median over its repeats of each run's median step after warm-up.
Reported per strategy: bf16's step time over fp32's, and whether the twins still agree in bf16 within
the tolerance the suite holds them to (BF16_TWIN_RTOL, docs/correctness.md)."""

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from llama_train import cpu
from llama_train.bench.label import label_line, run_label
from llama_train.bench.matrix import Setup, parse_strategies
from llama_train.bench.runs import run_one

DTYPES = ("float32", "bfloat16")
STRATEGIES = ("ddp", "zero2")
BF16_TWIN_RTOL = 1e-3  # DDP vs ZeRO-2 per-step losses in bf16: the suite's tolerance (tests/trainer_utils.py)


@dataclass
class DtypeSetup:
    output_dir: str = "outputs/bench_cpu_dtype"
    preset: str = "25m"
    steps: int = 8
    warmup_steps: int = 2
    repeats: int = 3
    max_seq_len: int = 256
    batch_size: int = 4
    world_size: int = 2
    threads: int = 0
    timeout: int = 1800


def matrix_setup(setup: DtypeSetup, dtype: str) -> Setup:
    fields = ("preset", "steps", "warmup_steps", "max_seq_len", "batch_size", "threads", "timeout")
    return replace(Setup(), dtype=dtype, output_dir=f"{setup.output_dir}/{dtype}", repeats=setup.repeats,
                   **{f: getattr(setup, f) for f in fields})  # fmt: skip


def run_all(setup: DtypeSetup) -> list[dict]:
    """Every (strategy, dtype) `repeats` times, rotated each round."""
    configs = [(s, d) for d in DTYPES for s in parse_strategies(",".join(STRATEGIES))]
    rows = []
    for r in range(setup.repeats):
        for strategy, dtype in configs[r % len(configs) :] + configs[: r % len(configs)]:
            row = run_one(strategy, setup.world_size, r, matrix_setup(setup, dtype))
            rows.append({**row, "dtype": dtype})
            print(
                f"{strategy.name} {dtype} r{r}: " + (row.get("error") or f"{row['step_time_s']:.3f} s/step")
            )
    return rows


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def summarize(rows: list[dict]) -> dict:
    """Per strategy and dtype: the median step time; per strategy: bf16 / fp32; per dtype: the twins'
    largest per-step relative loss difference (first repeat: every repeat trains the same steps)."""
    bad = [r for r in rows if "error" in r]
    if bad:
        raise RuntimeError(f"{bad[0]['strategy']} {bad[0]['dtype']}: {bad[0]['error']}")
    step = {
        (s, d): statistics.median(r["step_time_s"] for r in rows if (r["strategy"], r["dtype"]) == (s, d))
        for s in STRATEGIES
        for d in DTYPES
    }
    first = {(r["strategy"], r["dtype"]): r["losses"] for r in rows if r["repeat"] == 0}
    return {
        "step_time_s": {f"{s}/{d}": t for (s, d), t in step.items()},
        "bf16_over_fp32": {s: step[s, "bfloat16"] / step[s, "float32"] for s in STRATEGIES},
        "twin_loss_rel_diff": {d: max_rel_diff(first["zero2", d], first["ddp", d]) for d in DTYPES},
        "tokens_per_step": rows[0]["tokens_per_s"] * rows[0]["step_time_s"],
    }


def report(setup: DtypeSetup, summary: dict, label: dict) -> str:
    lines = [
        f"# bf16 vs fp32 training step on a CPU ({setup.preset}, {setup.world_size} ranks)",
        "",
        label_line(label) + f" CPU: {cpu.describe()}.",
        "",
        f"Command: `python scripts/bench_cpu_dtype.py --preset {setup.preset} --steps {setup.steps} "
        f"--repeats {setup.repeats} --max_seq_len {setup.max_seq_len} --batch_size {setup.batch_size}`",
        "",
        "| strategy | fp32 step (s) | bf16 step (s) | bf16 / fp32 |",
        "|---|---|---|---|",
    ]
    for s in STRATEGIES:
        fp32, bf16 = summary["step_time_s"][f"{s}/float32"], summary["step_time_s"][f"{s}/bfloat16"]
        lines.append(f"| {s} | {fp32:.3f} | {bf16:.3f} | {summary['bf16_over_fp32'][s]:.2f} |")
    diff = summary["twin_loss_rel_diff"]
    lines += [
        "",
        f"DDP vs ZeRO-2, largest per-step relative loss difference: fp32 {diff['float32']:.1e}, "
        f"bf16 {diff['bfloat16']:.1e} (the suite's bf16 tolerance: {BF16_TWIN_RTOL:.0e}).",
    ]
    return "\n".join(lines) + "\n"


def run(setup: DtypeSetup) -> str:
    rows = run_all(setup)
    summary, label = summarize(rows), run_label()
    out = Path(setup.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    strip = ("losses", "breakdown", "model", "comm", "timing")
    kept = [{k: v for k, v in r.items() if k not in strip} for r in rows]
    (out / "results.json").write_text(
        json.dumps({"label": label, "summary": summary, "runs": kept}, indent=1)
    )
    text = report(setup, summary, label)
    (out / "results.md").write_text(text)
    return text
