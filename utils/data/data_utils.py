"""Pretraining datasets: tokenized once into a memory-mapped cache, read as fixed-length blocks.

    train_ds, eval_ds = create_pretrain_dataset(local_rank, ["builtin"], "98,2", "data_cache",
                                                seed=1234, tokenizer=tok, max_seq_len=256)
    sampler = make_sampler(train_ds, local_rank, train=True, seed=1234, rank=rank, world_size=world)

What is built, once per content key, under `data_output_path/pretrain-<key16>/`:

    train.bin, eval.bin   token streams, uint16 (vocab <= 65536) or uint32:
                          doc1 </s> doc2 </s> ... (no BOS: EOS alone marks document boundaries)
    manifest.json         counts, dtype and the key's inputs; written last, so its presence
                          means the directory is complete

Documents are split into train/eval before packing (see `document_splits`), so no document
straddles the two. Block i of a stream is tokens[i*L : i*L + L + 1] for L = max_seq_len: blocks
overlap by one token so that every next-token prediction in the stream is made exactly once;
the tail shorter than a block is dropped. Items are {"input_ids": block[:-1], "labels": block[1:]},
int64: LABELS ARE PRE-SHIFTED, the model must not shift them again.

Robustness, for multi-process launches: the key is a sha256 of the content's inputs (never
`hash()`); local rank 0 (or -1) builds in a temp directory renamed into place, under a file lock
so two builders of one key end with one cache; other local ranks poll for the manifest (no
collective that can time out). A builder killed mid-way leaves only a temp directory, which
no reader opens and the next builder on that host removes.
"""

import functools
import hashlib
import itertools
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, SequentialSampler
from tqdm.auto import tqdm

from llama_train.errors import CacheError, DataSourceError, EmptySplitError
from utils.data.cache import build_once, read_manifest, sha256_json
from utils.data.mixture import build_mixture
from utils.data.sources import Source, iter_documents, parse_mixture, resolve_sources
from utils.data.tokenizer import EncoderSpec, encoder_spec, make_encoder, spec_fingerprint

FORMAT_VERSION = 1  # bump when the cache layout or tokenization changes
CHUNK_CHARS = 1 << 16  # text per worker task: small enough to balance 2 workers on a 2 MB corpus
MAX_SPLIT_WINDOW = 1000  # eval fractions are rounded to k/n with n <= this
# fork: workers start instantly and do not re-import the trainer's __main__ (torch, deepspeed).
# They only run the tokenizer, never CUDA or locks shared with the parent. Elsewhere: spawn.
MP_CONTEXT = "fork" if sys.platform.startswith("linux") else "spawn"


def token_dtype(vocab_size: int) -> str:
    """uint16 while every id fits (vocab <= 65536): half the disk and page cache of uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def num_workers() -> int:
    """Tokenizer processes: $LLAMA_TRAIN_DATA_WORKERS, else the usable CPUs capped at 8."""
    value = os.environ.get("LLAMA_TRAIN_DATA_WORKERS")
    if value is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return max(1, min(cpus or 1, 8))
    if not value.isdigit() or int(value) < 1:
        raise DataSourceError(f"LLAMA_TRAIN_DATA_WORKERS must be a positive integer, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# train/eval split


def parse_split(data_split: str) -> tuple[int, int]:
    """'98,2' -> (49, 1): train and eval documents per window, in lowest terms.

    Weights may be decimals ('99.5,0.5'); the eval fraction is rounded to k/n with n <= 1000."""
    parts = str(data_split).split(",")
    try:
        weights = [Fraction(p.strip()) for p in parts]
    except (ValueError, ZeroDivisionError):
        weights = []
    if len(parts) != 2 or len(weights) != 2 or min(weights) < 0 or sum(weights) == 0:
        raise DataSourceError(
            f"data_split must be two non-negative weights TRAIN,EVAL like '98,2', got {data_split!r}"
        )
    ratio = (weights[1] / sum(weights)).limit_denominator(MAX_SPLIT_WINDOW)
    if ratio == 0:
        raise EmptySplitError(
            f"data_split {data_split!r} leaves the eval split empty (eval weight 0 or below 1/{MAX_SPLIT_WINDOW}); "
            "give eval a positive weight, e.g. '98,2'"
        )
    if ratio == 1:
        raise EmptySplitError(f"data_split {data_split!r} leaves the train split empty")
    return ratio.denominator - ratio.numerator, ratio.numerator


def document_splits(split: tuple[int, int], seed: int) -> Iterator[str]:
    """'train' or 'eval' for document 0, 1, 2, ... (an endless stream).

    Documents are taken in windows of train+eval; in each window, the `eval` positions with the
    smallest sha256(seed, window, position) go to eval. So every window has the exact proportion
    (a stratified sample of an ordered corpus), the choice depends on the seed, and no count of
    all documents is needed first. A corpus shorter than one window may get no eval document."""
    n_train, n_eval = split
    window = n_train + n_eval
    for w in itertools.count():
        order = sorted(range(window), key=lambda j: hashlib.sha256(f"{seed}:{w}:{j}".encode()).digest())
        eval_slots = set(order[:n_eval])
        for j in range(window):
            yield "eval" if j in eval_slots else "train"


# ---------------------------------------------------------------------------------------------
# tokenizing in worker processes

_worker: dict = {}  # per worker process: its encoder, EOS id and dtype


def _init_worker(spec: EncoderSpec, eos_id: int, dtype: str) -> None:
    _worker.update(encode=make_encoder(spec), eos=eos_id, dtype=np.dtype(dtype))


def _encode_chunk(task: tuple[str, list[str]]) -> tuple[str, np.ndarray, int, int]:
    """(split, texts) -> (split, tokens of every text each followed by EOS, documents, UTF-8 bytes)."""
    split, texts = task
    ids = _worker["encode"](texts)
    out = np.empty(sum(len(x) for x in ids) + len(ids), dtype=_worker["dtype"])
    pos = 0
    for x in ids:
        out[pos : pos + len(x)] = x
        out[pos + len(x)] = _worker["eos"]
        pos += len(x) + 1
    return split, out, len(texts), sum(len(t.encode("utf-8")) for t in texts)


def _chunks(
    documents: Iterable[str], splits: Iterator[str], chunk_chars: int
) -> Iterator[tuple[str, list[str]]]:
    """Group documents into (split, texts) tasks of about `chunk_chars` characters; order kept per split."""
    buffers: dict[str, list[str]] = {"train": [], "eval": []}
    sizes = {"train": 0, "eval": 0}
    for doc, split in zip(documents, splits):
        buffers[split].append(doc)
        sizes[split] += len(doc)
        if sizes[split] >= chunk_chars:
            yield split, buffers[split]
            buffers[split], sizes[split] = [], 0
    for split, docs in buffers.items():
        if docs:
            yield split, docs


def _ordered_map(pool, fn, tasks: Iterable, max_in_flight: int) -> Iterator:
    """pool.imap with backpressure: imap would read `tasks` to the end into memory if the reader
    outpaces the workers; here at most `max_in_flight` tasks exist at a time."""
    pending: deque = deque()
    for task in tasks:
        pending.append(pool.apply_async(fn, (task,)))
        if len(pending) >= max_in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _tokenize_to_files(
    tmp: Path, documents: Iterable[str], splits: Iterator[str], spec, eos_id, dtype
) -> dict:
    """Stream tokenized documents into tmp/train.bin and tmp/eval.bin; return per-split counts."""
    workers = num_workers()
    delay = float(os.environ.get("LLAMA_TRAIN_TEST_BUILD_DELAY", 0))  # tests: make a kill land mid-build
    stats = {s: {"file": f"{s}.bin", "documents": 0, "tokens": 0, "text_bytes": 0} for s in ("train", "eval")}
    files = {s: open(tmp / stats[s]["file"], "wb") for s in stats}
    ctx = multiprocessing.get_context(MP_CONTEXT)
    bar = tqdm(
        unit="B", unit_scale=True, desc=f"tokenizing ({workers} workers)", mininterval=1.0, disable=None
    )
    try:
        with ctx.Pool(workers, _init_worker, (spec, eos_id, dtype)) as pool, bar:
            tasks = _chunks(documents, splits, CHUNK_CHARS)
            for split, tokens, n_docs, n_bytes in _ordered_map(pool, _encode_chunk, tasks, 2 * workers + 2):
                files[split].write(tokens.data)
                stats[split]["documents"] += n_docs
                stats[split]["tokens"] += len(tokens)
                stats[split]["text_bytes"] += n_bytes
                bar.update(n_bytes)
                if delay:
                    time.sleep(delay)
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    return stats


def _check_splits(stats: dict, max_seq_len: int, data_split: str, split: tuple[int, int]) -> None:
    block = max_seq_len + 1
    if stats["eval"]["documents"] == 0:
        raise EmptySplitError(
            f"the eval split is empty: all {stats['train']['documents']} documents went to train. "
            f"data_split {data_split!r} puts {split[1]} of every {sum(split)} documents in eval, so it needs at "
            f"least {sum(split)} documents; give more documents or a larger eval weight (e.g. '90,10')"
        )
    for name, s in stats.items():
        if s["tokens"] < block:
            raise EmptySplitError(
                f"the {name} split has {s['tokens']} tokens ({s['documents']} documents), fewer than one block "
                f"of max_seq_len + 1 = {block}: give more text, a lower max_seq_len or a larger {name} weight"
            )


# ---------------------------------------------------------------------------------------------
# datasets over the cache


class PackedBlockDataset(Dataset):
    """Blocks of `max_seq_len` + 1 tokens, stride `max_seq_len`, over a memory-mapped token file.

    Item i: {"input_ids": t[i*L : i*L+L], "labels": t[i*L+1 : i*L+L+1]} as int64 (pre-shifted
    labels). The file is mapped lazily, so pickling the dataset into DataLoader workers sends a
    path, not the data; opening is O(1) in the file's size."""

    def __init__(self, path: str | os.PathLike, num_tokens: int, dtype: str, max_seq_len: int):
        self.path = Path(path)
        self.num_tokens, self.dtype, self.max_seq_len = num_tokens, np.dtype(dtype), max_seq_len
        expected = num_tokens * self.dtype.itemsize
        if self.path.stat().st_size != expected:
            raise CacheError(
                f"{self.path} has {self.path.stat().st_size} bytes, its manifest says {expected}: "
                "the cache was modified; delete its directory to rebuild it"
            )
        if num_tokens < max_seq_len + 1:
            raise EmptySplitError(
                f"{self.path}: {num_tokens} tokens, fewer than one block of {max_seq_len + 1}"
            )
        self._tokens: np.memmap | None = None

    @property
    def tokens(self) -> np.memmap:
        """The whole token stream (read-only memmap)."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.max_seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"block {i} out of range for {len(self)} blocks")
        start = (i % len(self)) * self.max_seq_len
        block = torch.from_numpy(self.tokens[start : start + self.max_seq_len + 1].astype(np.int64))
        return {"input_ids": block[:-1], "labels": block[1:]}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def open_pretrain_datasets(cache_dir: str | os.PathLike) -> tuple[PackedBlockDataset, PackedBlockDataset]:
    """(train, eval) datasets of a complete cache directory; O(1) in its size."""
    cache_dir = Path(cache_dir)
    m = read_manifest(cache_dir)
    if m.get("format") != FORMAT_VERSION:
        raise CacheError(
            f"{cache_dir}: cache format {m.get('format')}, this code reads {FORMAT_VERSION}; delete it"
        )
    return tuple(
        PackedBlockDataset(cache_dir / s["file"], s["tokens"], m["dtype"], m["max_seq_len"])
        for s in (m["splits"]["train"], m["splits"]["eval"])
    )


def stream_blocks(tokenizer, data_path, seq_len: int, max_blocks: int) -> list[dict]:
    """Items as PackedBlockDataset's, without a cache: blocks of `seq_len` + 1 tokens over every
    document of `data_path` in order (EOS after each), packed as in training, up to `max_blocks`
    (-1: all). For scoring a source that is no run's split (scripts/eval_ppl.py --split all)."""
    items, buf = [], []
    for doc in iter_documents(resolve_sources(data_path)):
        buf += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        while len(buf) >= seq_len + 1 and (max_blocks < 0 or len(items) < max_blocks):
            block = torch.tensor(buf[: seq_len + 1])
            items.append({"input_ids": block[:-1], "labels": block[1:]})
            buf = buf[seq_len:]
        if 0 <= max_blocks <= len(items):
            break
    return items


# ---------------------------------------------------------------------------------------------
# the entry point


def _cache_inputs(
    sources: list[Source], split: tuple[int, int], seed: int, tokenizer, spec, max_seq_len: int
):
    return {
        "format": FORMAT_VERSION,
        "sources": [s.fingerprint() for s in sources],
        "tokenizer": spec_fingerprint(spec, tokenizer.eos_token_id, len(tokenizer)),
        "max_seq_len": max_seq_len,
        "split": list(split),
        "seed": seed,
    }


def pretrain_cache_dir(
    data_path, data_split: str, data_output_path, seed: int, tokenizer, max_seq_len: int
) -> Path:
    """Where `create_pretrain_dataset` keeps (or will keep) the cache for these arguments."""
    spec = encoder_spec(tokenizer)
    inputs = _cache_inputs(
        resolve_sources(data_path), parse_split(data_split), seed, tokenizer, spec, max_seq_len
    )
    return Path(data_output_path) / f"pretrain-{sha256_json(inputs)[:16]}"


def _mixture(mixture, local_rank, data_split, data_output_path, seed, tokenizer, max_seq_len):
    """(train, eval) MixtureDatasets of the components' own (cached) datasets."""
    components = []
    for share, src in mixture:
        try:  # each component is split into train/eval on its own, so each must fill both splits
            datasets = create_pretrain_dataset(
                local_rank, [src], data_split, data_output_path, seed, tokenizer, max_seq_len
            )
        except EmptySplitError as e:
            raise EmptySplitError(f"mixture component {src}: {e}") from None
        components.append((src, share, datasets))
    return build_mixture(components, seed, data_output_path, local_rank)


def create_pretrain_dataset(
    local_rank: int,
    data_path: str | list[str],
    data_split: str,
    data_output_path: str | os.PathLike,
    seed: int,
    tokenizer,
    max_seq_len: int,
) -> tuple[PackedBlockDataset, PackedBlockDataset]:
    """(train, eval) datasets of `max_seq_len`-token blocks from the documents of `data_path`.

    data_path: "builtin", "hf:NAME[:CONFIG]", .txt/.jsonl/.json/.parquet files, dirs, globs (sources.py),
    concatenated; or "WEIGHT SRC WEIGHT SRC ..." (mixture.py: MixtureDatasets). data_split: "TRAIN,EVAL"
    weights, by document (`document_splits`). tokenizer: a transformers tokenizer with an EOS token.
    Items are {"input_ids", "labels"} int64 tensors of length max_seq_len, labels pre-shifted
    (labels[t] = input_ids[t+1]); documents are packed back to back, each followed by EOS, no BOS.

    Built once per content key under data_output_path by local rank 0 (or -1), other local ranks wait.
    Raises DataSourceError (unusable input; EmptySplitError: a split cannot fill one block)."""
    if mixture := parse_mixture(data_path):  # WEIGHT SRC ...: each SRC cached on its own, then blended
        return _mixture(mixture, local_rank, data_split, data_output_path, seed, tokenizer, max_seq_len)
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"{type(tokenizer).__name__} has no EOS token, which separates packed documents")
    split = parse_split(data_split)
    sources = resolve_sources(data_path)
    spec = encoder_spec(tokenizer)
    inputs = _cache_inputs(sources, split, seed, tokenizer, spec, max_seq_len)
    key = sha256_json(inputs)
    dtype = token_dtype(len(tokenizer))

    def build(tmp: Path) -> dict:
        start = time.perf_counter()
        stats = _tokenize_to_files(
            tmp, iter_documents(sources), document_splits(split, seed), spec, tokenizer.eos_token_id, dtype
        )
        _check_splits(stats, max_seq_len, data_split, split)
        for s in stats.values():
            s["blocks"] = (s["tokens"] - 1) // max_seq_len
        return {
            "format": FORMAT_VERSION,
            "key": key,
            "inputs": inputs,
            "sources": [s.name for s in sources],
            "dtype": dtype,
            "eos_id": tokenizer.eos_token_id,
            "vocab_size": len(tokenizer),
            "max_seq_len": max_seq_len,
            "splits": stats,
            "encoder": spec[0],
            "workers": num_workers(),
            "build_seconds": round(time.perf_counter() - start, 3),
        }

    cache_dir = Path(data_output_path) / f"pretrain-{key[:16]}"
    manifest = build_once(cache_dir, build, local_rank, what="tokenized dataset")
    if manifest.get("key") != key:  # 16 hex digits collide with probability 2^-64; check anyway
        raise CacheError(f"{cache_dir} holds a cache for other inputs (key {manifest.get('key')}); delete it")
    return open_pretrain_datasets(cache_dir)


# ---------------------------------------------------------------------------------------------
# samplers


class EpochSampler(DistributedSampler):
    """The train order, the same for every world size: epoch e is one permutation of the whole
    dataset, `torch.randperm(len, seed + e)` -- DistributedSampler's own draw, which is also what a
    RandomSampler with a generator seeded seed + e gives. Iterated, a rank gets its share as
    DistributedSampler(shuffle=True, drop_last=True) gives it; `permutation()` is the epoch's whole
    order, which the trainers cut into global batches by consumed samples (llama_train/steps.py).
    Call `set_epoch(e)` before each epoch. One process is rank 0 of 1 (no process group needed)."""

    def __init__(self, dataset, seed: int, rank: int = 0, world_size: int = 1):
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)

    def permutation(self) -> np.ndarray:
        """The epoch's order (epoch_order)."""
        return epoch_order(len(self.dataset), self.seed, self.epoch)


@functools.lru_cache(maxsize=1)  # the trainer's loader and the sample ledger read the same epoch's
def epoch_order(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s order of `num_samples` train blocks, read-only: one int32 array (int64 past
    2**31 blocks), 4 bytes a block, not a Python list's ~36. torch's CPU randperm shuffles the same
    way whatever its dtype, so the order is exactly `torch.randperm(n, generator)`'s with the
    generator seeded seed + epoch (DistributedSampler's draw)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    dtype = torch.int32 if num_samples <= torch.iinfo(torch.int32).max else torch.int64
    order = torch.randperm(num_samples, generator=g, dtype=dtype).numpy()
    order.flags.writeable = False
    return order


def make_sampler(
    dataset,
    local_rank: int,
    train: bool,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
):
    """The train sampler is an `EpochSampler` (a DistributedSampler whose order does not depend on
    the world size; one process is rank 0 of 1), so 1 process and N ranks see the same global
    batches. Eval: `DistributedSampler` in order when distributed (`local_rank != -1`; it pads by
    repeating a few blocks so every rank gets as many), else `SequentialSampler`. Call
    `sampler.set_epoch(epoch)` each epoch when the sampler has it, so shuffles differ between epochs.

    rank / world_size default to torch.distributed's, which must then be initialized."""
    if local_rank == -1:
        return EpochSampler(dataset, seed) if train else SequentialSampler(dataset)
    if (rank is None or world_size is None) and not torch.distributed.is_initialized():
        raise ValueError(
            f"local_rank={local_rank} means distributed: pass rank and world_size, or init torch.distributed"
        )
    if rank is None or world_size is None:
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if train:
        return EpochSampler(dataset, seed, rank=rank, world_size=world_size)
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False, seed=seed)
