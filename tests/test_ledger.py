"""The sample ledger (llama_train/telemetry/ledger.py, scripts/summarize_run.py --ledger): which train
samples every step read, across kills, moves, stops, requeues and re-mixes.

First the reader on ledgers written by hand (what a repeat or a gap looks like, by sample and step),
then real runs on a small corpus (an epoch is 3 optimizer steps of 16 sequences, so every run crosses
epochs): a kill -9 while an async save is in flight, resumed; ZeRO-2 on 2 ranks stopped by SIGTERM
mid-epoch and moved to DDP on 1; a mixture re-weighted with --allow_data_change; and the bad inputs
(a ledger cut short, one shorter than its checkpoints say, one of another run). The hang exit and
requeue is in tests/test_long_runs.py, on the runs it already makes."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llama_train.errors import LedgerError
from llama_train.telemetry.ledger import (
    check_against_checkpoints,
    ledger_report,
    order_digest,
    read_ledger,
    report_lines,
)
from tests.trainer_utils import BASE_FLAGS, ROOT, deepspeed_launcher, env, free_port, launch, small_corpus
from utils.data import epoch_order
from utils.data.sources import resolve_sources

pytestmark = pytest.mark.usefixtures("deepspeed_ops")  # tests/conftest.py

STEPS = 10


def summarize(out, *extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "scripts/summarize_run.py", str(out), "--ledger", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)


def report_of(out) -> dict:
    records = read_ledger(os.path.join(out, "ledger.jsonl"))
    return ledger_report(records, [r for r in records if r["event"] == "start"][-1]["run"])


# --- the reader, on ledgers written by hand ---


def written(*processes) -> list[dict]:
    """A ledger of 20 samples, seed 0, global batch 4: each process (done, consumed, [(step, start)])."""
    out = []
    for done, consumed, steps in processes:
        start = {"event": "start", "run": "r", "done": done, "position": {"epoch": 0, "consumed": consumed}}
        out.append({**start, "num_samples": 20, "seed": 0, "data": {}, "world_size": 1, "trainer": "t"})
        out.append(
            {"event": "epoch", "epoch": 0, "samples": 20, "order": order_digest(epoch_order(20, 0, 0))}
        )
        out += [{"event": "step", "step": s, "epoch": 0, "start": a, "end": a + 4} for s, a in steps]
    return out


def test_a_repeat_and_a_gap_are_named_by_sample_index_and_step():
    order = epoch_order(20, 0, 0).tolist()
    ok = ledger_report(written((0, 0, [(1, 0), (2, 4), (3, 8)]), (2, 8, [(3, 8), (4, 12)])), "r")
    assert ok["ok"] and [s for s, _, _ in ok["recomputed"]] == [3] and ok["once"] == 16
    text = "\n".join(report_lines(ok))
    assert "recomputed    step 3: trained by process 1 and lost with it, again by process 2" in text
    # process 2 says it resumed after step 3 but reads from position 8 again: 4 samples twice
    twice = ledger_report(written((0, 0, [(1, 0), (2, 4), (3, 8)]), (3, 8, [(4, 8)])), "r")
    text = "\n".join(report_lines(twice))
    assert not twice["ok"] and twice["epochs"][0]["twice"] == [{"positions": [8, 12], "steps": [3, 4]}]
    assert f"seen twice    4 sample(s): {', '.join(map(str, order[8:12]))} (steps 3-4)" in text
    assert report_lines(twice)[-1].startswith("verdict         NOT every sample up to step 4")
    gap = ledger_report(written((0, 0, [(1, 0), (2, 4)]), (2, 12, [(3, 12)])), "r")  # reads on past 8-11
    text = "\n".join(report_lines(gap))
    assert not gap["ok"] and f"skipped       epoch 0: 4 sample(s): {', '.join(map(str, order[8:12]))}" in text
    missing = ledger_report(written((3, 12, [(4, 12)])), "r")  # resumed from a checkpoint it never saw
    assert not missing["ok"] and missing["missing"] == [1, 2, 3]


def test_a_process_that_resumed_an_older_checkpoint_and_trained_no_step_loses_no_step():
    """Process 2 resumed step 2 (a roll-back) and died before its first step (or trained step 3 and
    died before saving); process 3 resumed `latest`, process 1's step 4: the model holds process 1's
    steps 1-4 and process 3's step 5, so no step is missing, none recomputed, every sample read once."""
    for rolled_back in ([], [(3, 8)]):
        report = ledger_report(
            written((0, 0, [(1, 0), (2, 4), (3, 8), (4, 12)]), (2, 8, rolled_back), (4, 16, [(5, 16)])), "r"
        )
        assert report["ok"] and not report["missing"] and not report["recomputed"], report_lines(report)
        assert report["last_step"] == 5 and report["once"] == 20
        assert report_lines(report)[-1].startswith("verdict         every sample up to step 5")


# --- real runs ---


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def flags(corpus, *extra: str) -> list[str]:
    """Global batch 4 x 2 x 2 = 16 on 2 ranks (x 4 accumulation on 1)."""
    common = f"--data_path {corpus} --data_split 90,10 --max_steps {STEPS} --no-hash_checkpoints"
    return [*common.split(), *" ".join(extra).split()]


def run_until(cmd: list[str], out: Path, line: str, extra_env: dict) -> subprocess.Popen:
    """Start `cmd` in a new session and return once `line` is in its output, the process still running."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env() | extra_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen = []
    for text in proc.stdout:
        seen.append(text)
        if line in text:
            return proc
    proc.wait()
    raise AssertionError("".join(seen)[-3000:])


@pytest.fixture(scope="module")
def killed(tmp_path_factory, corpus, data_dir):
    """One process, --async_save every 2 steps: step 4's save sleeps in its writer thread while training
    goes on; kill -9 once step 5 is logged (latest: step 2). --resume auto finishes the run."""
    out = tmp_path_factory.mktemp("killed")
    paths = ["--data_output_path", str(data_dir), "--output_dir", str(out)]
    extra = "--save_interval 2 --async_save --accumulation_steps 4 --log_interval 1"
    cmd = [sys.executable, "train_ddp.py", *BASE_FLAGS, *flags(corpus, extra), *paths]
    hook = {"LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP": "4", "LLAMA_TRAIN_TEST_SAVE_DELAY_S": "600"}
    proc = run_until(cmd, out, "step      5/", hook)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    launch("train_ddp.py", flags(corpus, extra, "--resume auto"), out, data_dir, nproc=1)
    return out


def test_a_kill_between_saves_names_the_recomputed_steps_and_every_sample_once(killed):
    report = report_of(killed)
    first = report["processes"][0]
    trained = sorted(first["steps"])  # what the killed process handed out before the kill
    assert trained[0] == 1 and trained[-1] >= 5
    assert [s for s, _, _ in report["recomputed"]] == list(range(3, trained[-1] + 1))
    assert report["ok"] and report["last_step"] == STEPS and report["once"] == STEPS * 16
    proc = summarize(killed)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        f"recomputed    steps 3-{trained[-1]}: trained by process 1 and lost with it, again by process 2"
        in proc.stdout
    )
    assert f"every sample up to step {STEPS} seen and applied exactly once" in proc.stdout


@pytest.fixture(scope="module")
def moved(tmp_path_factory, corpus, data_dir):
    """ZeRO-2 on 2 ranks under the launch front, SIGTERM while step 3's save is written (the ranks agree
    on the stop one step later and stop after step 5: inside epoch 1, steps 4-6), then DDP on 1 rank
    with 4 micro-batches (the same global batch) to the end."""
    out = tmp_path_factory.mktemp("moved")
    paths = ["--data_output_path", str(data_dir), "--output_dir", str(out)]
    zero2 = "--deepspeed_config ds_configs/zero2.json --accumulation_steps 2 --save_interval 3"
    launcher = [*deepspeed_launcher(2, free_port()), "train_deepspeed.py"]
    cmd = [sys.executable, "-m", "llama_train.launch", *launcher, *BASE_FLAGS, *flags(corpus, zero2), *paths]
    hook = {"LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP": "3", "LLAMA_TRAIN_TEST_SAVE_DELAY_S": "8"}
    proc = run_until(cmd, out, "test hook: sleeping mid-save", hook)
    os.kill(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=300)
    assert proc.returncode == 0
    launch("train_ddp.py", flags(corpus, "--accumulation_steps 4 --resume auto"), out, data_dir, nproc=1)
    return out


def test_a_sigterm_stop_loses_nothing(moved):
    report = report_of(moved)
    stopped = report["processes"][0]
    last = max(stopped["steps"])
    assert last in (4, 5) and report["processes"][1]["start"]["done"] == last
    assert report["ok"] and not report["recomputed"] and report["last_step"] == STEPS


def test_a_move_from_zero2_on_2_ranks_to_ddp_on_1_continues_the_samples(moved):
    """The second process reads on from where the first stopped, in the same order: each epoch's
    positions are read once, across the move, and each epoch's tail (the samples short of a global
    batch) is named."""
    report = report_of(moved)
    a, b = (p["start"] for p in report["processes"])
    assert (a["trainer"], a["world_size"]) == ("train_deepspeed.py ds_configs/zero2.json", 2)
    assert (b["trainer"], b["world_size"]) == ("train_ddp.py", 1)
    n, per_epoch = a["num_samples"], a["num_samples"] // 16
    assert a["global_batch"] == b["global_batch"] == 16 and per_epoch == 3  # epochs: steps 1-3, 4-6, ...
    assert (
        b["position"] == {"epoch": 1, "consumed": 16 * (b["done"] - per_epoch)} and b["done"] % 3
    )  # mid-epoch
    epochs = report["epochs"]
    assert [e["epoch"] for e in epochs] == list(range(len(epochs))) and len(epochs) == -(-STEPS // (n // 16))
    assert all(e["first"] == 0 and e["read"] == n // 16 * 16 and e["tail"] == n % 16 for e in epochs[:-1])
    proc = summarize(moved)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "process 2     train_ddp.py x1, resumed at step" in proc.stdout
    assert "left in its tail (shorter than a global batch)" in proc.stdout


def test_a_remix_with_allow_data_change_shows_where_the_new_draw_begins(tmp_path, corpus, data_dir):
    """A 0.5/0.5 mixture stopped after step 1, resumed as 0.9/0.1 with --allow_data_change: the run goes
    on at step 2 and sample 16 of the new mixture's order (the samples before it are not drawn), each
    sample of each draw read once. (Needs the fix that makes --allow_data_change continue at the
    checkpoint's step and sample count rather than at step 1.)"""
    other = tmp_path / "other.jsonl"
    docs = [d[:400] for d, _ in zip(resolve_sources(["builtin"])[0].documents(), range(24))][12:]
    other.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out, mix = tmp_path / "run", "--accumulation_steps 4 --max_steps 3 --no_export"
    launch(
        "train_ddp.py",
        flags(corpus, mix, f"--data_path 0.5 {corpus} 0.5 {other} --stop_after_steps 1"),
        out,
        data_dir,
        nproc=1,
    )
    launch(
        "train_ddp.py",
        flags(corpus, mix, f"--data_path 0.9 {corpus} 0.1 {other} --resume auto --allow_data_change"),
        out,
        data_dir,
        nproc=1,
    )
    report = report_of(out)
    assert len(report["draws"]) == 2 and report["draws"][1]["step"] == 2
    assert (report["draws"][1]["epoch"], report["draws"][1]["consumed"]) == (0, 16)
    assert report["ok"] and not report["recomputed"] and report["last_step"] == 3
    assert [(e["draw"], e["first"], e["read"]) for e in report["epochs"]] == [(0, 0, 16), (1, 16, 48)]
    proc = summarize(out, "--mixture")
    assert (
        "new draw      from step 2 (the data changed, --allow_data_change): the new order is read from sample 16"
        in proc.stdout
    )
    # the mixture audit: each source's share, configured -> delivered, over the run and per draw
    assert (
        "share of the train tokens per source, configured -> delivered (steps 1-3: 48 sequences, 2 draw(s))"
        in proc.stdout
    )
    want = delivered_by_hand(out / "ledger.jsonl")
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith(str(corpus)))
    whole = (want[0][0] + want[1][0]) / 48
    assert f"{(16 * 0.5 + 32 * 0.9) / 48:6.1%} -> {whole:6.1%}" in line  # configured: weighted by sequences
    assert (
        f"draw 1, steps 1: 50.0% -> {want[0][0] / 16:.1%}; draw 2, steps 2-3: 90.0% -> {want[1][0] / 32:.1%}"
        in line
    )


def delivered_by_hand(ledger: Path) -> list[list[int]]:
    """Per process, the samples of each source its steps read: the epoch order's positions through the
    mixture index its start record names."""
    out = []
    for r in map(json.loads, ledger.read_text().splitlines()):
        if r["event"] == "start":
            component, seed = np.load(Path(r["sources"]["index"]) / "train_component.npy"), r["seed"]
            out.append([0, 0])
        elif r["event"] == "step":
            order = epoch_order(len(component), seed, r["epoch"])[r["start"] : r["end"]]
            for c in component[order]:
                out[-1][c] += 1
    return out


# --- bad input: each one error line ---


def test_a_ledger_cut_short_shorter_than_its_checkpoints_or_of_another_run_is_refused(
    killed, moved, tmp_path
):
    run = tmp_path / "run"
    shutil.copytree(killed, run, ignore=shutil.ignore_patterns("hf", "*.pt", "*.safetensors"))
    ledger = run / "ledger.jsonl"
    whole = ledger.read_bytes()
    ledger.write_bytes(whole[:-7])  # the last line cut
    with pytest.raises(LedgerError, match=r"ledger.jsonl:\d+: the last line is cut short"):
        read_ledger(str(ledger))
    lines = whole.splitlines(keepends=True)
    ledger.write_bytes(b"".join(lines[:-3]))  # whole lines, but fewer than checkpoint step_10 saw
    states = {
        "step_00000010": json.loads(
            (run / "checkpoints" / "step_00000010" / "trainer_state.json").read_text()
        )
    }
    with pytest.raises(
        LedgerError, match="is truncated: it has .* checkpoint step_00000010 was saved when it had"
    ):
        check_against_checkpoints(str(ledger), read_ledger(str(ledger)), states)
    shutil.copy(moved / "ledger.jsonl", ledger)  # another run's ledger in this run's output_dir
    proc = summarize(run)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        len(errors) == 1
        and "is the ledger of run" in errors[0]
        and "not of this output_dir's run" in errors[0]
    )
