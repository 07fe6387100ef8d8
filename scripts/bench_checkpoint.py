"""Time a checkpoint's write, its sha256 manifest and its verification, serial vs threaded.

    python scripts/bench_checkpoint.py --checkpoint outputs/run/checkpoints/step_00000001 --repeats 3

Write: every file of the checkpoint loaded (by weights.safe_load, as every tool reads it) and
torch.save'd again into a scratch directory (what a save costs on this disk). Hash and verify:
llama_train.checkpoint's manifest and check, one thread (what every save and every rank's resume did
before: rank 0 hashed serially, each rank re-hashed everything) and LLAMA_TRAIN_HASH_THREADS threads
(default: the CPUs, at most 8). Best of --repeats, in one process; the page cache is warm after the
first read, as it is right after a save.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from llama_train import checkpoint as ckpt
from llama_train.cli import run_script
from llama_train.weights import safe_load


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
    os.environ["LLAMA_TRAIN_HASH_THREADS"] = threads  # read by llama_train.checkpoint at each call
    return best_of(fn, repeats)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a complete checkpoint directory")
    p.add_argument("--repeats", type=int, default=3, help="best of this many timings each")
    args = p.parse_args(argv)
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
