"""What the sample ledger costs: time per step next to a training step, bytes per step, and what an epoch
of 10^8 samples adds (its order's sha256), measured here.

    python scripts/bench_ledger.py                      # 10^8 samples, 512 sequences a step
    python scripts/bench_ledger.py --samples 1e6 --presets debug

Prints one table; nothing is written outside a temporary directory.
"""

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch

from llama_train.cli import HelpFormatter, run_script
from llama_train.model import PRESETS, Transformer
from llama_train.telemetry.ledger import LEDGER_FILE, Ledger, ledger_report, order_digest, read_ledger
from utils.data import epoch_order


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--samples", type=float, default=1e8, help="train samples (sequences) of the epoch")
    p.add_argument("--global_batch", type=int, default=512, help="sequences per optimizer step")
    p.add_argument("--steps", type=int, default=20000, help="ledger step records to time (and read back)")
    p.add_argument(
        "--presets",
        default="debug,25m",
        help="the models whose training step is the yardstick (comma-separated)",
    )
    p.add_argument("--batch_size", type=int, default=8, help="micro batch of the yardstick step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence of the yardstick step")
    return p.parse_args(argv)


def time_steps(path: str, n: int, samples: int, batch: int) -> tuple[float, int]:
    """Median seconds of Ledger.step over `n` steps at the end of an epoch of `samples` (the longest
    numbers), and the file's bytes per step record."""
    first = (samples // batch - n) * batch  # a process resumed near the epoch's end: the longest numbers
    header = {"done": first // batch, "position": {"epoch": 0, "consumed": first}, "num_samples": samples}
    ledger = Ledger(
        path, 0, None, {**header, "seed": 0, "global_batch": batch, "world_size": 8, "trainer": "bench"}
    )
    ledger.epoch(0, epoch_order(1000, 0, 0))  # a small order: this times the step records
    times = []
    size = os.path.getsize(os.path.join(path, LEDGER_FILE))
    for k in range(n):
        t0 = time.perf_counter()
        step = first // batch + k + 1
        ledger.handed(step, 0, first + k * batch, first + (k + 1) * batch)
        ledger.trained(step)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (os.path.getsize(os.path.join(path, LEDGER_FILE)) - size) // n


def time_train_step(preset: str, batch: int, seq: int) -> float:
    """Median seconds of a forward + backward + AdamW step of `preset` on this machine's CPU."""
    torch.manual_seed(0)
    model = Transformer(replace(PRESETS[preset], max_seq_len=seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.args.vocab_size, (batch, seq))
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        model(ids, ids)[1].backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv=None) -> int:
    args = parse_args(argv)
    n = int(args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        per_step, step_bytes = time_steps(tmp, args.steps, n, args.global_batch)
        t0 = time.perf_counter()
        records = read_ledger(os.path.join(tmp, LEDGER_FILE))
        ledger_report(records, records[0]["run"])
        read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    order = epoch_order(n, 0, 0)
    order_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    order_digest(order)
    digest_s = time.perf_counter() - t0
    steps_per_epoch = n // args.global_batch
    rows = [("ledger write per step", f"{per_step * 1e6:.1f} us")]
    for preset in args.presets.split(","):
        train_s = time_train_step(preset, args.batch_size, args.seq)
        rows.append(
            (f"{preset} train step (batch {args.batch_size} x {args.seq}, CPU)", f"{train_s * 1e3:.1f} ms")
        )
        rows.append(("  the ledger's share of it", f"{per_step / train_s * 100:.3g} %"))
    rows += [
        (f"bytes per step record at {n:.0e} samples", f"{step_bytes}"),
        (f"ledger of one epoch ({steps_per_epoch:,} steps of {args.global_batch})", f"{step_bytes * steps_per_epoch / 2**20:.1f} MiB"),
        (f"epoch order of {n:.0e} samples (the trainer draws it anyway)", f"{order_s:.2f} s"),
        ("its sha256 (once an epoch, rank 0)", f"{digest_s:.2f} s = {digest_s / steps_per_epoch * 1e6:.2f} us a step"),
        (f"reading back {args.steps:,} step records (summarize_run --ledger)", f"{read_s:.2f} s"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return 0


if __name__ == "__main__":
    run_script(main)
