"""The data layer: sources, the token cache, blocks, splits, multi-process safety, samplers."""

import hashlib
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler
from transformers import default_data_collator

from llama_train.errors import DataSourceError, SourceNotFoundError, SourceUnavailableError
from utils.data import cache as cache_module
from utils.data import data_utils as D
from utils.data.sources import BuiltinSource, _stdlib_files, iter_documents, resolve_sources
from utils.data.tokenizer import load_tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512


def paragraphs() -> list[str]:
    """Real English: pydoc's topic texts, one document per paragraph (already stripped)."""
    return [p.strip() for k in sorted(topics) for p in topics[k].split("\n\n") if p.strip()]


def make_docs(n: int) -> list[str]:
    docs = paragraphs()[:n]
    docs[3] = "Emoji 😀, CJK 漢字, a literal </s> and <s> as text, digits 1234567."
    return docs


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("tok")
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n\n".join(topics[k] for k in sorted(topics)[:40]), encoding="utf-8")
    return train_tokenizer(str(corpus), VOCAB, tmp / "tokenizer")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(autouse=True)
def _one_worker_by_default(monkeypatch):
    # 2 cores shared with other work: tests pin workers unless they test the pool itself
    monkeypatch.setenv("LLAMA_TRAIN_DATA_WORKERS", "1")


def build(tok, data, cache, *, local_rank=-1, split="90,10", seed=3, max_seq_len=32):
    """create_pretrain_dataset with this module's usual split, seed and block length."""
    return D.create_pretrain_dataset(
        local_rank=local_rank,
        data_path=str(data),
        data_split=split,
        data_output_path=cache,
        seed=seed,
        tokenizer=tok,
        max_seq_len=max_seq_len,
    )


def no_cache_left(cache: Path) -> bool:
    return not cache.exists() or not [p for p in cache.iterdir() if not p.name.endswith(".lock")]


# ---------------------------------------------------------------------------------------------
# the token stream and its blocks


def test_stream_layout_round_trip_and_blocks(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_TRAIN_DATA_WORKERS", "2")
    docs = make_docs(400)
    data = write_jsonl(tmp_path / "d.jsonl", docs)
    L, eos = 64, tok.eos_token_id
    train, evl = build(tok, data, tmp_path / "cache", seed=7, max_seq_len=L)

    which = list(itertools.islice(D.document_splits(D.parse_split("90,10"), 7), len(docs)))
    ids = tok(docs, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # transformers' ids
    for ds, name in ((train, "train"), (evl, "eval")):
        chosen = [i for i, s in enumerate(which) if s == name]
        stream = np.asarray(ds.tokens)
        # doc1 EOS doc2 EOS ...: exactly the transformers tokenizer's ids, no BOS
        assert stream.tolist() == [t for i in chosen for t in ids[i] + [eos]]
        assert len(stream) == sum(len(ids[i]) + 1 for i in chosen)
        # text -> tokens -> text for every document
        pieces = np.split(stream, np.flatnonzero(stream == eos) + 1)[:-1]
        assert [tok.decode(p[:-1]) for p in pieces] == [docs[i] for i in chosen]
        # blocks cover the stream with stride L: each next-token prediction exactly once
        assert len(ds) == (len(stream) - 1) // L
        inputs = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
        labels = torch.cat([ds[i]["labels"] for i in range(len(ds))])
        assert inputs.tolist() == stream[: len(ds) * L].tolist()
        assert labels.tolist() == stream[1 : len(ds) * L + 1].tolist()  # pre-shifted
        assert len(stream) - (len(ds) * L + 1) < L  # only a tail shorter than a block is dropped
    manifest = D.read_manifest(train.path.parent)
    assert manifest["splits"]["eval"]["documents"] == 40 and manifest["splits"]["train"]["documents"] == 360
    assert manifest["dtype"] == "uint16" and manifest["workers"] == 2
    batch = default_data_collator([train[0], train[1]])
    assert (
        batch["input_ids"].shape == batch["labels"].shape == (2, L) and batch["labels"].dtype == torch.int64
    )
    with pytest.raises(IndexError):
        train[len(train)]


def test_tokenizers_backend_builds_the_same_stream(tok, tok_dir, tmp_path):
    """A tokenizer without tokenizer.model (workers use its tokenizers backend) gives the same tokens."""
    bare_dir = tmp_path / "bare"
    bare_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare_dir / name).write_bytes((tok_dir / name).read_bytes())
    data = str(write_jsonl(tmp_path / "d.jsonl", make_docs(100)))
    a, _ = build(tok, data, tmp_path / "c", seed=1)
    b, _ = build(load_tokenizer(bare_dir), data, tmp_path / "c", seed=1)
    assert a.path != b.path and D.read_manifest(b.path.parent)["encoder"] == "tokenizers"
    assert np.array_equal(a.tokens, b.tokens)


def test_open_is_lazy_and_detects_damage(tok, tmp_path):
    data = str(write_jsonl(tmp_path / "d.jsonl", make_docs(100)))
    train, _ = build(tok, data, tmp_path / "c", seed=1)
    again, _ = D.open_pretrain_datasets(train.path.parent)
    assert again._tokens is None  # nothing read yet: opening is O(1)
    assert len(pickle.dumps(again)) < 1000  # DataLoader workers get a path, not the data
    assert torch.equal(again[5]["input_ids"], train[5]["input_ids"]) and isinstance(again._tokens, np.memmap)
    with open(train.path, "r+b") as f:
        f.truncate(train.path.stat().st_size - 2)
    with pytest.raises(D.CacheError, match="delete its directory"):
        D.open_pretrain_datasets(train.path.parent)


def test_token_dtype_and_worker_count(monkeypatch):
    assert D.token_dtype(65536) == "uint16" and D.token_dtype(65537) == "uint32"
    monkeypatch.setenv("LLAMA_TRAIN_DATA_WORKERS", "3")
    assert D.num_workers() == 3
    monkeypatch.setenv("LLAMA_TRAIN_DATA_WORKERS", "0")
    with pytest.raises(ValueError, match="LLAMA_TRAIN_DATA_WORKERS"):
        D.num_workers()


# ---------------------------------------------------------------------------------------------
# sources


def docs_of(data_path) -> list[str]:
    return list(iter_documents(resolve_sources(data_path)))


def test_txt_documents_are_blank_line_separated_blocks(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes("\ufeffFirst doc, line 1\r\n  line 2\r\n\r\n\r\n \t \nSecond doc\n\n\nThird\n".encode())
    assert docs_of(str(p)) == ["First doc, line 1\n  line 2", "Second doc", "Third"]


def test_formats_directories_globs_and_lists(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha one\n\nalpha two\n")
    write_jsonl(d / "b.jsonl", ["bravo", "   "])  # whitespace-only documents are skipped
    pq.write_table(pa.table({"text": ["golf", "hotel"], "id": [1, 2]}), d / "f.parquet")
    (d / "sub" / "c.json").write_text(json.dumps([{"text": "charlie"}, {"text": "  delta  "}]))
    (d / "sub" / "e.json").write_text('{"text": "echo"}\n{"text": "foxtrot"}\n')  # JSON Lines named .json
    (d / ".hidden").mkdir()
    (d / ".hidden" / "x.txt").write_text("hidden files are skipped")
    (d / "notes.csv").write_text("unsupported types are skipped in directories")

    everything = ["alpha one", "alpha two", "bravo", "golf", "hotel", "charlie", "delta", "echo", "foxtrot"]
    assert docs_of(str(d)) == everything
    assert docs_of([str(d)]) == everything
    assert docs_of(str(d / "**" / "*.json")) == ["charlie", "delta", "echo", "foxtrot"]
    assert docs_of([str(d / "sub" / "e.json"), str(d / "b.jsonl")]) == ["echo", "foxtrot", "bravo"]


BAD_FILES = {
    "empty file": ("data.txt", b"", "data.txt: no documents"),
    "blank file": ("data.jsonl", b"\n  \n", "data.jsonl: no documents"),
    "malformed JSON line": ("data.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', "data.jsonl:3: invalid JSON"),
    "missing text field": ("data.jsonl", b'{"text": "a"}\n{"body": "b"}\n', r"data.jsonl:2: no 'text' field \(keys: body\)"),
    "text not a string": ("data.jsonl", b'{"text": ["a"]}\n', "data.jsonl:1: 'text' must be a string"),
    "not an object": ("data.jsonl", b'"just a string"\n', "data.jsonl:1: expected a JSON object"),
    "JSON array item": ("data.json", b'[{"text": "a"},\n {"txt": "b"}]', r"data.json: item 1: no 'text' field"),
    "non-UTF-8 txt": ("data.txt", b"fine\n\nbad \xff byte\n", "data.txt:3: not valid UTF-8"),
    "non-UTF-8 JSON array": ("data.json", b'[{"text": "a"},\n {"text": "\xe9"}]', "data.json:2: not valid UTF-8"),
    "lone surrogate": ("data.jsonl", b'{"text": "ok"}\n{"text": "\\ud800"}\n', "data.jsonl:2: 'text' has an unpaired"),
    "unsupported type": ("data.csv", b"text\nhello\n", "data.csv: unsupported file type"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_FILES, ids=list(BAD_FILES))
def test_bad_files_name_file_and_line(tok, tmp_path, case):
    name, content, message = BAD_FILES[case]
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataSourceError, match=message):
        build(tok, tmp_path / name, tmp_path / "cache", split="50,50", seed=0, max_seq_len=16)
    assert no_cache_left(tmp_path / "cache")


def test_parquet_without_text_column(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    with pytest.raises(DataSourceError, match=r"p.parquet: no 'text' column \(columns: body\)"):
        docs_of(str(tmp_path / "p.parquet"))


def test_missing_and_unknown_sources(tmp_path):
    with pytest.raises(SourceNotFoundError, match="nope.jsonl: no such file"):
        resolve_sources([str(tmp_path / "nope.jsonl")])
    with pytest.raises(FileNotFoundError, match="builtin, hf"):  # the message lists what exists
        resolve_sources("bultin")
    with pytest.raises(SourceNotFoundError, match="glob matches no"):
        resolve_sources(str(tmp_path / "*.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataSourceError, match="directory has no"):
        resolve_sources(str(tmp_path / "empty"))
    with pytest.raises(DataSourceError, match="data_path is empty"):
        resolve_sources([])


def test_hf_source_says_what_is_missing(monkeypatch):
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(SourceUnavailableError, match="`datasets` library"):
            resolve_sources("hf:wikitext:wikitext-2-raw-v1")
        return
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SourceUnavailableError, match="offline|OFFLINE"):
        resolve_sources("hf:wikitext:wikitext-2-raw-v1")


def test_hf_source_takes_a_row_cap_and_a_column():
    from utils.data.sources import parse_hf_spec

    assert parse_hf_spec("wikitext:wikitext-2-raw-v1") == ("wikitext", "wikitext-2-raw-v1", None, "text")
    assert parse_hf_spec("org/web@10000#content") == ("org/web", None, 10000, "content")
    assert parse_hf_spec("org/web:en@5") == ("org/web", "en", 5, "text")
    for bad in ("org/web@", "org/web@ten", "org/web@0", "org/web#", ":cfg"):
        with pytest.raises(DataSourceError, match=r"hf:NAME\[:CONFIG\]\[@ROWS\]\[#COLUMN\]"):
            parse_hf_spec(bad)


def test_builtin_is_deterministic_offline_prose():
    script = [sys.executable, "tests/helpers/builtin_digest.py"]
    other = subprocess.Popen(script, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    docs = docs_of("builtin")
    digest = hashlib.sha256(b"".join(d.encode() + b"\0" for d in docs)).hexdigest()
    assert other.communicate(timeout=120)[0].strip() == digest  # same content and order in another process

    assert docs[: len(topics)] == [topics[k].strip() for k in sorted(topics)]
    assert len(docs) > 400 and sum(map(len, docs)) > 1_500_000  # ~2.2 MB, ~640 documents on 3.11
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [p.relative_to(root).as_posix() for p in _stdlib_files()]
    assert rel == sorted(rel)
    for skipped in ("antigravity.py", "this.py", "idlelib/", "tkinter/", "test/", "site-packages/"):
        assert not any(r == skipped or r.startswith(skipped) or f"/{skipped}" in r for r in rel), skipped
    assert not any(r.endswith("__main__.py") for r in rel)
    assert BuiltinSource().fingerprint() == resolve_sources(["builtin"])[0].fingerprint()


# ---------------------------------------------------------------------------------------------
# train/eval split and too-small corpora


def test_split_parsing_and_windows():
    assert D.parse_split("98,2") == (49, 1) and D.parse_split(" 90 , 10 ") == (9, 1)
    assert D.parse_split("99.5,0.5") == (199, 1) and D.parse_split("1,1") == (1, 1)
    for bad in ("98", "1,2,3", "a,b", "-1,2", "0,0"):
        with pytest.raises(DataSourceError, match="two non-negative weights"):
            D.parse_split(bad)
    for empty in ("100,0", "1000000,1", "0,5"):
        with pytest.raises(D.EmptySplitError, match="empty"):
            D.parse_split(empty)

    first = list(itertools.islice(D.document_splits((9, 1), 1), 1000))
    assert all(first[w : w + 10].count("eval") == 1 for w in range(0, 1000, 10))  # exact per window
    assert first == list(itertools.islice(D.document_splits((9, 1), 1), 1000))  # deterministic
    assert first != list(itertools.islice(D.document_splits((9, 1), 2), 1000))  # seeded


def test_empty_eval_split_is_a_clear_error(tok, tmp_path):
    data = str(write_jsonl(tmp_path / "d.jsonl", make_docs(10)))
    with pytest.raises(D.EmptySplitError, match="eval split is empty.*at least 50 documents"):
        build(tok, data, tmp_path / "cache", split="98,2", seed=0, max_seq_len=16)
    with pytest.raises(D.EmptySplitError, match="leaves the eval split empty"):
        build(tok, data, tmp_path / "cache", split="100,0", seed=0, max_seq_len=16)
    assert no_cache_left(tmp_path / "cache")


def test_corpus_too_small_for_one_block(tok, tmp_path):
    data = str(write_jsonl(tmp_path / "d.jsonl", ["one short document", "and another"]))
    with pytest.raises(D.EmptySplitError, match="fewer than one block of max_seq_len \\+ 1 = 513"):
        build(tok, data, tmp_path / "cache", split="50,50", seed=0, max_seq_len=512)
    assert no_cache_left(tmp_path / "cache")


# ---------------------------------------------------------------------------------------------
# cache keys and multi-process safety


def test_cache_key_is_content_addressed(tok, tok_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", make_docs(50))
    cache = tmp_path / "cache"
    args = dict(data_path=str(data), data_split="90,10", data_output_path=cache, seed=1, max_seq_len=32)
    key = D.pretrain_cache_dir(tokenizer=tok, **args).name
    env = {**os.environ, "PYTHONHASHSEED": "4321"}  # a different hash() seed changes nothing
    script = [sys.executable, "tests/helpers/cache_key.py", str(tok_dir), str(data), str(cache)]
    out = subprocess.run(script, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split()[-1] == key
    assert D.pretrain_cache_dir(tokenizer=tok, **{**args, "data_split": "9,1"}).name == key  # same split

    other_tok = load_tokenizer(train_tokenizer(str(data), VOCAB + 64, tmp_path / "other_tok"))
    changed = [{"seed": 2}, {"data_split": "80,20"}, {"max_seq_len": 33}, {"data_path": [str(data)] * 2}]
    keys = {D.pretrain_cache_dir(tokenizer=tok, **{**args, **c}).name for c in changed}
    keys.add(D.pretrain_cache_dir(tokenizer=other_tok, **args).name)
    os.utime(data, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: mtime differs
    keys.add(D.pretrain_cache_dir(tokenizer=tok, **args).name)
    write_jsonl(data, make_docs(51))  # edited
    keys.add(D.pretrain_cache_dir(tokenizer=tok, **args).name)
    assert key not in keys and len(keys) == len(changed) + 3


def start(args, **env):
    env = {**os.environ, "LLAMA_TRAIN_DATA_WORKERS": "1", **env}
    script = [sys.executable, "tests/helpers/race_builder.py", *map(str, args)]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    return subprocess.Popen(script, env=env, cwd=ROOT, start_new_session=True, **pipes)


def wait_until(condition, timeout: float, procs=()):
    deadline = time.monotonic() + timeout
    while not condition():
        for p in procs:
            assert p.poll() is None, p.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def result_of(train, evl) -> str:
    digest = hashlib.sha256(bytes(train.tokens) + b"|" + bytes(evl.tokens)).hexdigest()
    return f"{train.path.parent.name} {len(train)} {len(evl)} {digest}"


def test_concurrent_builders_make_one_cache(tok, tok_dir, tmp_path):
    """Two local-rank-0 processes (as on two nodes sharing a file system) and a local rank 1 start
    together on an empty cache: all see identical data, one cache exists, no temp files remain."""
    data = write_jsonl(tmp_path / "d.jsonl", make_docs(600))  # several chunks
    cache, go = tmp_path / "cache", tmp_path / "go"
    procs = [
        start([tok_dir, data, cache, rank, go], LLAMA_TRAIN_TEST_BUILD_DELAY="0.05") for rank in (0, 0, 1)
    ]
    wait_until(lambda: len(list(tmp_path.glob("go.ready*"))) == len(procs), 120, procs)
    go.touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    results = {out.strip() for out, _ in outputs}
    assert results == {result_of(*build(tok, data, cache))}
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1
    assert not [p for p in cache.iterdir() if ".tmp" in p.name]


def test_killed_builder_leaves_no_readable_cache(tok, tok_dir, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", make_docs(600))
    cache, go = tmp_path / "cache", tmp_path / "go"
    go.touch()
    proc = start([tok_dir, data, cache, 0, go], LLAMA_TRAIN_TEST_BUILD_DELAY="60")  # sleeps after a chunk
    try:
        wait_until(lambda: list(cache.glob(".pretrain-*.tmp-*/train.bin")), 120, [proc])
        time.sleep(0.3)  # mid-build: after its first chunk it sleeps for a minute
        os.kill(proc.pid, signal.SIGKILL)  # like the OOM killer: no cleanup runs
        proc.wait()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its tokenizer worker, if still there
        except ProcessLookupError:
            pass
    (half,) = cache.glob(".pretrain-*.tmp-*")
    assert not (half / "manifest.json").exists() and not list(cache.glob("pretrain-*"))

    monkeypatch.setenv("LLAMA_TRAIN_DATA_WAIT_TIMEOUT", "0.3")
    with pytest.raises(TimeoutError):  # a waiting rank does not take the half-built cache
        build(tok, data, cache, local_rank=1)
    rebuilt = build(tok, data, cache, local_rank=0)
    assert not half.exists()  # the dead builder's temp dir was removed
    fresh = build(tok, data, tmp_path / "fresh")
    assert result_of(*rebuilt) == result_of(*fresh)


def test_rename_race_loser_keeps_the_winners_copy(tmp_path):
    final = tmp_path / "pretrain-x"
    final.mkdir()
    (final / cache_module.MANIFEST).write_text("{}")
    mine = tmp_path / ".pretrain-x.tmp-mine"
    mine.mkdir()
    (mine / "train.bin").write_bytes(b"12")
    cache_module._rename_into_place(mine, final)  # no error: the winner's complete copy stays
    assert not (final / "train.bin").exists()


# ---------------------------------------------------------------------------------------------
# samplers


def test_samplers_follow_local_rank():
    ds = list(range(101))
    train = D.make_sampler(ds, -1, train=True, seed=5)
    assert isinstance(D.make_sampler(ds, -1, train=False), SequentialSampler)
    train.set_epoch(0)
    e0 = list(train)
    train.set_epoch(1)
    assert list(train) != e0 and sorted(e0) == ds
    train.set_epoch(0)
    assert list(train) == e0 == list(D.make_sampler(ds, -1, train=True, seed=5))  # resumable order

    ranks = [D.make_sampler(ds, 0, train=True, seed=5, rank=r, world_size=2) for r in (0, 1)]
    assert all(isinstance(s, DistributedSampler) for s in ranks)
    epochs = []
    for epoch in (0, 1):
        for s in ranks:
            s.set_epoch(epoch)
        a, b = list(ranks[0]), list(ranks[1])
        assert len(a) == len(b) == 50 and not set(a) & set(b)  # disjoint, same length (tail dropped)
        epochs.append(a)
    assert epochs[0] != epochs[1]  # set_epoch gives a new shuffle
    evl = D.make_sampler(ds, 3, train=False, seed=5, rank=1, world_size=2)
    assert list(evl)[:3] == [1, 3, 5]  # in order
    with pytest.raises(ValueError, match="pass rank and world_size"):
        D.make_sampler(ds, 0, train=True, seed=5)


def test_train_order_is_the_same_permutation_for_every_world_size():
    """One process and every rank of N cut the same permutation: torch's own DistributedSampler
    (any world size) and a RandomSampler seeded seed + epoch draw exactly it."""
    ds = list(range(101))
    for epoch in (0, 3):
        g = torch.Generator()
        g.manual_seed(5 + epoch)
        oracle = list(RandomSampler(ds, generator=g))
        for world in (1, 2, 3):
            for rank in range(world):
                s = D.make_sampler(
                    ds, 0 if world > 1 else -1, train=True, seed=5, rank=rank, world_size=world
                )
                s.set_epoch(epoch)
                assert s.permutation().tolist() == oracle
                torch_own = DistributedSampler(ds, world, rank, shuffle=True, seed=5, drop_last=True)
                torch_own.set_epoch(epoch)
                assert list(s) == list(torch_own)
