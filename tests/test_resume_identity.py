"""A resume keeps what the run trained on (issue 24, items 1 and 4): its tokenizer (a requeued
--init_from run does not train a new one) and its data (a changed mixture weight, source or
tokenizer is refused by name; --allow_data_change re-mixes on purpose).

Single-process DDP runs (`python train_ddp.py`): the checks are the trainers' shared start-up code."""

import json

import pytest

from llama_train.checkpoint.resuming import find_resume
from llama_train.steps import StepPlan
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


@pytest.fixture(scope="module")
def remix(tmp_path_factory, corpora):
    """A 0.5/0.5 mixture stopped after step 1 of 3, resumed as 0.9/0.1: refused, then with
    --allow_data_change."""
    a, b = corpora
    root = tmp_path_factory.mktemp("remix")
    data, out = root / "data", root / "run"
    run(out, data, f"--data_path 0.5 {a} 0.5 {b} --max_steps 3 --stop_after_steps 1")
    remixed = f"--data_path 0.9 {a} 0.1 {b} --max_steps 3 --resume auto"
    refused = run(out, data, remixed, check=False)
    allowed = run(out, data, remixed, "--allow_data_change")
    return {"dir": out, "refused": refused, "allowed": allowed}


def test_resume_with_other_mixture_weights_is_refused_unless_asked(remix):
    proc = remix["refused"]
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "mixture weights: checkpoint [0.5, 0.5], now [0.9, 0.1]" in err[0], err
    assert "--allow_data_change" in err[0]
    assert state(remix["dir"])["data"]["weights"] == [0.9, 0.1]  # the allowed run's checkpoints


def test_allow_data_change_continues_at_the_saved_step_and_sample(remix):
    """The re-mixed run goes on at step 2 (not step 1 again on top of the trained weights), with the
    step-1 checkpoint's consumed samples, the new mixture drawn from there; its resume line says what
    changed."""
    out = remix["dir"]
    assert [r["step"] for r in read_metrics(out) if r["event"] == "train"] == [1, 2, 3]
    (line,) = [x for x in remix["allowed"].stdout.splitlines() if x.startswith("resumed from")]
    assert (
        "at step 1 " in line
        and "data changed (mixture weights: checkpoint [0.5, 0.5], now [0.9, 0.1])" in line
    )
    saved = state(out)
    plan = StepPlan.make(saved["num_samples"], 4, 1, 1, 1, 3)
    assert saved["step"] == 3 and saved["position"] == plan.position_after(3).to_dict()
