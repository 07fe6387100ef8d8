"""A resume keeps what the run trained on (issue 24, items 1 and 4): its tokenizer (a requeued
--init_from run does not train a new one) and its data (a changed mixture weight, source or
tokenizer is refused by name; --allow_data_change re-mixes on purpose).

Single-process DDP runs (`python train_ddp.py`): the checks are the trainers' shared start-up code."""

import json

import pytest

from llama_train.checkpoint.resuming import find_resume
from tests.trainer_utils import launch, read_metrics
from utils.data import load_tokenizer
from utils.data.sources import resolve_sources
from utils.data.tokenizer import tokenizer_fingerprint

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

COMMON = "--data_split 90,10 --no-hash_checkpoints --no_export".split()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two small .jsonl corpora of different built-in documents (a tokenizer trained on each differs)."""
    root = tmp_path_factory.mktemp("corpora")
    docs = [d[:400] for _, d in zip(range(24), resolve_sources(["builtin"])[0].documents())]
    paths = []
    for name, part in (("a", docs[:12]), ("b", docs[12:])):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
        paths.append(path)
    return paths


def run(out, data_dir, *flags, check=True):
    return launch("train_ddp.py", [*COMMON, *" ".join(flags).split()], out, data_dir, nproc=1, check=check)


def fingerprint(path) -> str:
    return tokenizer_fingerprint(load_tokenizer(path))


def state(out) -> dict:
    with open(f"{find_resume('auto', str(out))}/trainer_state.json") as f:
        return json.load(f)


def test_requeued_init_from_run_keeps_its_tokenizer(tmp_path, corpora):
    a, b = corpora
    data = tmp_path / "data"
    run(tmp_path / "base", data, f"--data_path {a} --max_steps 1")  # its tokenizer: trained on a
    base = tmp_path / "base" / "tokenizer"
    job = f"--data_path {b} --init_from {base.parent}/checkpoints/step_00000001 --resume auto --max_steps 3"
    out = tmp_path / "new"
    run(out, data, job, "--stop_after_steps 1")
    assert fingerprint(out / "tokenizer") == fingerprint(base)
    proc = run(out, data, job)  # the scheduler requeues the job unchanged
    assert [r["step"] for r in read_metrics(out) if r["event"] == "train"][-2:] == [2, 3], proc.stderr[-2000:]
    assert fingerprint(out / "tokenizer") == fingerprint(base)  # not a tokenizer trained on b
    assert state(out)["data"]["tokenizer"] == fingerprint(base)
    other = tmp_path / "other_tokenizer"
    run(tmp_path / "other", data, f"--data_path {b} --max_steps 1")
    (tmp_path / "other" / "tokenizer").rename(other)
    proc = run(out, data, job, f"--max_steps 4 --tokenizer {other}", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "the tokenizer changed" in err[0] and str(other) in err[0], proc.stderr[-2000:]


def test_resume_with_other_mixture_weights_is_refused_unless_asked(tmp_path, corpora):
    a, b = corpora
    data, out = tmp_path / "data", tmp_path / "run"
    run(out, data, f"--data_path 0.5 {a} 0.5 {b} --max_steps 3 --stop_after_steps 1")
    remix = f"--data_path 0.9 {a} 0.1 {b} --max_steps 3 --resume auto"
    proc = run(out, data, remix, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "mixture weights: checkpoint [0.5, 0.5], now [0.9, 0.1]" in err[0], err
    assert "--allow_data_change" in err[0]
    proc = run(out, data, remix, "--allow_data_change")
    assert [r["step"] for r in read_metrics(out) if r["event"] == "train"][-2:] == [2, 3]
    assert state(out)["data"]["weights"] == [0.9, 0.1]
