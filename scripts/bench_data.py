"""Benchmark the data pipeline: tokenization throughput by worker count, peak RSS, cached open,
and the train sampler's memory per rank.

    python scripts/bench_data.py                      # builtin corpus, 1 vs 2 workers, 5 repeats
    python scripts/bench_data.py --workers 1,2,4 --repeats 7 --rss_scales 0.25,1,8
    python scripts/bench_data.py --cases sampler      # sampler RSS at 10^8 blocks (no corpus needed)

The builtin corpus is first written to a .jsonl (assembling it parses the standard library with
`ast` in the main process, which would hide the workers' scaling), optionally repeated `--scale`
times. Throughput builds run in one child process (imports once), each into an empty cache
directory, worker counts interleaved so that other load on the machine hits them alike; they
include starting the pool, reading, tokenizing and writing. Throughput = text bytes / build
seconds, median of `--repeats`. Peak RSS is measured in a fresh child per corpus size, since
ru_maxrss is a high-water mark. A CPU check before and after says whether other work shared the
cores (then the speedup is not the pipeline's).

The sampler case measures, in a fresh child per form, the RSS growth of one rank's epoch order: the
permutation of `--sampler_blocks` blocks plus the rank's first steps of it, as the trainers read it
(array: utils.data's EpochSampler + llama_train.steps.RankOrder), beside the Python-list form the
trainers used before (measured at `--sampler_list_blocks`, since it needs ~36 bytes a block).
"""

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SPLIT, SEED = "98,2", 1234


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts to compare")
    p.add_argument("--repeats", type=int, default=5, help="builds per worker count; the median is reported")
    p.add_argument("--scale", type=float, default=1.0, help="corpus = builtin repeated this many times")
    p.add_argument("--rss_scales", default="0.25,1,4", help="corpus scales for the peak-RSS comparison")
    p.add_argument("--vocab_size", type=int, default=8192, help="vocab of the tokenizer trained on builtin")
    p.add_argument("--tokenizer", help="use this tokenizer instead of training one")
    p.add_argument("--max_seq_len", type=int, default=256, help="block length of the built datasets")
    p.add_argument("--work_dir", help="keep corpora, tokenizer and caches here (default: a temp dir)")
    p.add_argument("--cases", default="build", help="comma-separated: build (throughput, RSS), sampler")
    p.add_argument("--sampler_blocks", type=float, default=1e8, help="blocks of the sampler case's epoch")
    p.add_argument("--sampler_list_blocks", type=float, default=1e7, help="blocks for the list form")
    p.add_argument("--sampler_child", nargs=2, metavar=("FORM", "BLOCKS"), help=argparse.SUPPRESS)
    p.add_argument("--child", nargs=4, metavar=("KIND", "DATA", "TOKENIZER", "CACHE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# child side


def cpu_seconds() -> float:
    """User + system CPU time of this process and its joined children (the pool workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def timed_build(data: str, tok, cache: Path, max_seq_len: int) -> dict:
    from utils.data import create_pretrain_dataset, read_manifest

    shutil.rmtree(cache, ignore_errors=True)  # always a build, never a cache hit
    cpu, start = cpu_seconds(), time.perf_counter()
    train, _ = create_pretrain_dataset(-1, data, SPLIT, cache, SEED, tok, max_seq_len)
    result = {
        "build_s": time.perf_counter() - start,
        "cpu_s": cpu_seconds() - cpu,
        "cache": str(train.path.parent),
    }
    splits = read_manifest(train.path.parent)["splits"].values()
    return result | {k: sum(s[k] for s in splits) for k in ("text_bytes", "tokens", "documents")}


def child_throughput(data: str, tok, cache: Path, args) -> dict:
    from utils.data import create_pretrain_dataset, open_pretrain_datasets

    runs, counts = [], [int(x) for x in args.workers.split(",")]
    for _ in range(args.repeats):
        for w in counts:  # interleaved
            os.environ["LLAMA_TRAIN_DATA_WORKERS"] = str(w)
            runs.append({"workers": w, **timed_build(data, tok, cache / f"w{w}", args.max_seq_len)})
    cached, opened = [], []
    for _ in range(5):
        start = time.perf_counter()
        train, _ = create_pretrain_dataset(
            -1, data, SPLIT, cache / f"w{counts[0]}", SEED, tok, args.max_seq_len
        )
        cached.append(time.perf_counter() - start)  # a hit: fingerprint sources + tokenizer, open memmaps
        start = time.perf_counter()
        open_pretrain_datasets(train.path.parent)
        opened.append(time.perf_counter() - start)
    return {"runs": runs, "cached_call_s": statistics.median(cached), "open_s": statistics.median(opened)}


def child_rss(data: str, tok, cache: Path, args) -> dict:
    os.environ["LLAMA_TRAIN_DATA_WORKERS"] = str(max(int(w) for w in args.workers.split(",")))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # after imports and tokenizer load
    result = timed_build(data, tok, cache, args.max_seq_len)
    return result | {
        "rss_before_kb": before,
        "rss_peak_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "worker_rss_peak_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,  # joined workers
    }


class Blocks:
    """A dataset of `n` blocks that holds nothing: the sampler only asks for its length."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def child_sampler(form: str, n: int, world: int = 8, global_batch: int = 1024, steps: int = 100) -> dict:
    """RSS growth of rank 0's epoch order over `n` blocks: the array form the trainers use, or the
    Python-list form they used before issue 25."""
    import torch

    from llama_train.steps import RankOrder
    from utils.data import make_sampler

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if form == "array":
        order = make_sampler(Blocks(n), 0, True, SEED, rank=0, world_size=world).permutation()
        mine = RankOrder(order, 0, n // global_batch, global_batch, 0, world)
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(SEED)).tolist()
        mine = [
            i
            for k in range(n // global_batch)
            for i in order[k * global_batch : (k + 1) * global_batch][::world]
        ]
    taken = sum(1 for _, _ in zip(range(steps * global_batch // world), iter(mine)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "form": form,
        "blocks": n,
        "taken": taken,
        "s": time.perf_counter() - start,
        "growth_bytes": (peak - before) * 1024,
    }


def report_sampler(args) -> None:
    print("\ntrain sampler, one rank of 8 (ru_maxrss growth: the epoch's order and the first 100 steps)")
    print(f"{'form':>6} {'blocks':>12} {'RSS growth':>12} {'bytes/block':>12} {'time s':>7}")
    for form, n in (("list", args.sampler_list_blocks), ("array", args.sampler_blocks)):
        cmd = [sys.executable, __file__, "--sampler_child", form, str(int(n))]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"sampler child {form} failed:\n{out.stderr[-3000:]}")
        x = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{form:>6} {x['blocks']:>12,} {x['growth_bytes'] / 2**20:>9.0f} MiB "
            f"{x['growth_bytes'] / x['blocks']:>12.2f} {x['s']:>7.1f}"
        )


def child_main(args) -> None:
    from utils.data import load_tokenizer

    kind, data, tokenizer, cache = args.child
    run = {"throughput": child_throughput, "rss": child_rss}[kind]
    print(json.dumps(run(data, load_tokenizer(tokenizer), Path(cache), args)))


# ---------------------------------------------------------------------------------------------
# parent side


def run_child(kind: str, data: Path, tokenizer: Path, cache: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--workers", args.workers, "--repeats", str(args.repeats)]
    cmd += ["--max_seq_len", str(args.max_seq_len), "--child", kind, str(data), str(tokenizer), str(cache)]
    out = subprocess.run(cmd, env={**os.environ, "TQDM_DISABLE": "1"}, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"child {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_corpus(docs: list[str], scale: float, path: Path) -> Path:
    """`docs` repeated int(scale) times, then the first fraction of them for the rest."""
    whole, part = divmod(scale, 1)
    chosen = docs * int(whole) + docs[: round(len(docs) * part)]
    with open(path, "w", encoding="utf-8") as f:
        for doc in chosen:
            f.write(json.dumps({"text": doc}) + "\n")
    return path


def _burn(n: int) -> None:
    while n:
        n -= 1


def cpu_parallelism(procs: int = 2, n: int = 5_000_000) -> float:
    """How much faster `procs` processes of pure Python finish `procs` units of work than one
    process finishes them: ~procs on an idle machine, less when other work shares the cores."""

    def timed(k: int) -> float:
        ps = [multiprocessing.get_context("fork").Process(target=_burn, args=(n,)) for _ in range(k)]
        start = time.perf_counter()
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        return time.perf_counter() - start

    return procs * timed(1) / timed(procs)


def mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def report_throughput(res: dict, args) -> None:
    runs, counts = res["runs"], [int(w) for w in args.workers.split(",")]
    first = runs[0]
    print(
        f"\ncorpus: builtin x{args.scale:g} as .jsonl, {mb(first['text_bytes'])}, {first['documents']} documents, "
        f"{first['tokens']:,} tokens; median of {args.repeats} builds"
    )
    print(f"{'workers':>8} {'build s':>9} {'MB/s':>7} {'CPU s':>7}   runs (s)")
    rate = {}
    for w in counts:
        secs = [r["build_s"] for r in runs if r["workers"] == w]
        cpu = statistics.median(r["cpu_s"] for r in runs if r["workers"] == w)  # all processes together
        rate[w] = first["text_bytes"] / statistics.median(secs) / 1e6
        print(
            f"{w:>8} {statistics.median(secs):>9.3f} {rate[w]:>7.2f} {cpu:>7.3f}   {' '.join(f'{s:.3f}' for s in secs)}"
        )
    for w in counts[1:]:
        print(f"speedup {w} vs {counts[0]} workers: {rate[w] / rate[counts[0]]:.2f}x")
    print(
        f"cached: create_pretrain_dataset {res['cached_call_s'] * 1e3:.1f} ms (fingerprints + open), "
        f"open_pretrain_datasets {res['open_s'] * 1e3:.2f} ms"
    )


def report_rss(work: Path, docs: list[str], tokenizer: Path, args) -> None:
    workers = max(int(w) for w in args.workers.split(","))
    print(
        f"\npeak RSS of a build with {workers} workers (ru_maxrss; forked workers share the parent's pages)"
    )
    print(
        f"{'corpus':>14} {'text':>10} {'before build':>13} {'build peak':>11} {'growth':>8} {'worker peak':>12}"
    )
    for scale in (float(s) for s in args.rss_scales.split(",")):
        data = write_corpus(docs, scale, work / f"builtin_x{scale:g}.jsonl")
        x = run_child("rss", data, tokenizer, work / f"cache-rss-{scale:g}", args)
        before, peak = x["rss_before_kb"] / 1024, x["rss_peak_kb"] / 1024
        print(
            f"{f'builtin x{scale:g}':>14} {mb(x['text_bytes']):>10} {before:>10.0f} MB {peak:>8.0f} MB "
            f"{peak - before:>5.0f} MB {x['worker_rss_peak_kb'] / 1024:>9.0f} MB"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tokenizer and not Path(args.tokenizer).exists():
        from llama_train.errors import ConfigError

        raise ConfigError(f"--tokenizer {args.tokenizer}: no such tokenizer directory or .model file")
    if args.child:
        child_main(args)
        return 0
    if args.sampler_child:
        print(json.dumps(child_sampler(args.sampler_child[0], int(args.sampler_child[1]))))
        return 0
    cases = args.cases.split(",")
    if not cases or set(cases) - {"build", "sampler"}:
        from llama_train.errors import ConfigError

        raise ConfigError(f"--cases {args.cases!r}: use build, sampler or build,sampler")
    if "sampler" in cases:
        report_sampler(args)
    if "build" not in cases:
        return 0
    from utils.data import iter_documents, resolve_sources, train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        docs = list(iter_documents(resolve_sources("builtin")))
        tokenizer = Path(args.tokenizer) if args.tokenizer else work / "tokenizer"
        if not args.tokenizer and not (tokenizer / "tokenizer.model").is_file():
            train_tokenizer("builtin", args.vocab_size, tokenizer)
        print(f"machine: {os.cpu_count()} CPUs; python {sys.version.split()[0]}; tokenizer {tokenizer}")
        data = write_corpus(docs, args.scale, work / f"builtin_x{args.scale:g}.jsonl")
        print(f"CPU check before: 2 busy processes run {cpu_parallelism():.2f}x one (2.00 = two free cores)")
        res = run_child("throughput", data, tokenizer, work / "cache-throughput", args)
        print(f"CPU check after: {cpu_parallelism():.2f}x")
        report_throughput(res, args)
        report_rss(work, docs, tokenizer, args)
    return 0


if __name__ == "__main__":
    from llama_train.cli import run_script

    run_script(main)
