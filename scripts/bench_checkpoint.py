"""Time a checkpoint's write, its sha256 manifest and its verification, serial vs threaded.

    python scripts/bench_checkpoint.py --checkpoint outputs/run/checkpoints/step_00000001 --repeats 3

Write: every file of the checkpoint loaded (by formats.safe_load, as every tool reads it) and
torch.save'd again into a scratch directory (what a save costs on this disk). Hash and verify:
llama_train.checkpoint.store's manifest and check, one thread (what every save and every rank's resume did
before: rank 0 hashed serially, each rank re-hashed everything) and LLAMA_TRAIN_HASH_THREADS threads
(default: the CPUs, at most 8). Best of --repeats, in one process; the page cache is warm after the
first read, as it is right after a save.

    python scripts/bench_checkpoint.py --stall 125m --repeats 3

--stall PRESET: the training stall per save, sync vs --async_save, side by side: a PRESET model with
AdamW state (the DDP trainer's files, one process) saved through llama_train.checkpoint.async_save.Saver as the
trainers do; the stall is the time until save() returns (sync: written, hashed, published; async: the
host copy), median of --repeats, and the async save's background time (written, hashed, published).
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from llama_train.checkpoint import store as ckpt
from llama_train.checkpoint.async_save import Saver
from llama_train.checkpoint.formats import safe_load
from llama_train.cli import run_script
from llama_train.model import PRESETS, Transformer


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def rewrite(src: str, scratch: str):
    for name in sorted(os.listdir(src)):
        if name.endswith(".pt"):
            torch.save(safe_load(os.path.join(src, name), mmap=False), os.path.join(scratch, name))


def hashing(threads: str, fn, repeats: int) -> float:
    os.environ["LLAMA_TRAIN_HASH_THREADS"] = threads  # read by llama_train.checkpoint.store at each call
    return best_of(fn, repeats)


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def stall(preset: str, repeats: int, root: str):
    """Print the stall per save, sync vs async, and their ratio (module docstring)."""
    model = Transformer(PRESETS[preset])
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # Adam's two moments exist, as in a checkpoint after step 1
    objects = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    rows = {}
    for mode in (False, True):
        saver, stalls, behind = Saver(mode, True, 1, 0, 1, 600.0), [], []
        for i in range(repeats):
            start = time.perf_counter()
            saver.save(root, ckpt.tag_for(i + 1), ckpt.ddp_files(objects, 0), {"step": i + 1})
            stalls.append(time.perf_counter() - start)
            saver.wait()  # async: the background part (training would go on meanwhile)
            behind.append(time.perf_counter() - start - stalls[-1])
        rows["async" if mode else "sync"] = (median(stalls), median(behind))
    size = sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file()) / 1e9
    print(f"{preset}: checkpoint {size:.2f} GB, median of {repeats} saves")
    for name, (stalled, background) in rows.items():
        print(f"  {name:<6} stall per save {stalled:7.2f} s   in the background {background:7.2f} s")
    print(f"  async / sync stall: {rows['async'][0] / rows['sync'][0]:.3f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="a complete checkpoint directory")
    p.add_argument("--repeats", type=int, default=3, help="best of this many timings each")
    p.add_argument("--stall", metavar="PRESET", help="instead: the stall per save, sync vs --async_save")
    args = p.parse_args(argv)
    if args.stall:
        with tempfile.TemporaryDirectory() as scratch:
            return stall(args.stall, args.repeats, scratch) or 0
    if not args.checkpoint:
        p.error("--checkpoint is required (or --stall PRESET)")
    path = ckpt.resolve_checkpoint(args.checkpoint)
    size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e9
    threads = str(min(8, os.cpu_count() or 1))
    manifest = lambda: ckpt._file_manifest(path, 0, 1, hashes=True)  # noqa: E731
    verify = lambda: ckpt.verify_checkpoint(path)  # noqa: E731
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as scratch:
        write = best_of(lambda: rewrite(path, scratch), args.repeats)
    rows = [
        ("write (torch.save of every file)", write),
        ("sha256 manifest, 1 thread", hashing("1", manifest, args.repeats)),
        (f"sha256 manifest, {threads} threads", hashing(threads, manifest, args.repeats)),
        ("verify, 1 thread", hashing("1", verify, args.repeats)),
        (f"verify, {threads} threads", hashing(threads, verify, args.repeats)),
    ]
    print(f"{path}: {len(os.listdir(path))} files, {size:.2f} GB")
    for what, seconds in rows:
        print(f"  {what:<36} {seconds:7.2f} s  {size / seconds:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    run_script(main)
