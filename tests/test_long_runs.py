"""Long runs: files that survive a crash, a sampler that does not grow with the corpus in the wrong
place, hangs turned into a restart, stops across hosts, stragglers, goodput (issue 25)."""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch

from llama_train.gpu import launcher
from llama_train.launch import output_dir_of, quiet_deepspeed, resolve
from llama_train.ops.stopfile import STOP_NAME
from llama_train.ops.watchdog import EXIT_HANG, STALL_ENV, stalled_ranks
from llama_train.steps import DataPosition, StepPlan, train_steps
from llama_train.telemetry.goodput import goodput
from llama_train.telemetry.timing import StragglerAlarm
from tests.trainer_utils import BASE_FLAGS, ROOT, env, free_port, launch, read_metrics, small_corpus
from utils.data import make_sampler

CSV_ROWS = 6


def write_csv_rows(path, steps: int):
    from llama_train.telemetry.reporting import SCALAR_NAMES

    with open(path, "w", newline="") as f:
        table = csv.DictWriter(f, fieldnames=["step", *SCALAR_NAMES])
        table.writeheader()
        table.writerows({"step": s, "train/loss": 10.0 - s} for s in range(1, steps + 1))


def test_metrics_csv_survives_a_kill_right_after_a_resume(tmp_path):
    """A resumed process rewrites metrics.csv with the rows its checkpoint covers, then dies by
    SIGKILL before it logs anything: the file still holds every kept row (before: truncated to
    nothing, the rewrite still in the process's buffer)."""
    write_csv_rows(tmp_path / "metrics.csv", CSV_ROWS)
    code = (
        "import os, signal; from llama_train.telemetry.reporting import CSVWriter; "
        f"w = CSVWriter({str(tmp_path)!r}, done=4); os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["train/loss"]) for r in rows] == [9.0, 8.0, 7.0, 6.0]
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]


class IndexDataset(torch.utils.data.Dataset):
    """Item i is {"input_ids": [i]}: a batch shows which sequences it holds."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert type(i) is int, type(i)  # a numpy int32 index would overflow block * max_seq_len
        return {"input_ids": torch.tensor([i])}


def list_order_batches(n, seed, plan, rank, batch_size):
    """The micro-batches as the trainers took them before issue 25: the epoch's permutation as a Python
    list, the rank's epoch share as a list (the oracle for the array form)."""
    out = []
    for epoch, first, steps in plan.epochs():
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        mine = []
        for k in range(steps):
            start = first + k * plan.global_batch
            mine += order[start : start + plan.global_batch][rank :: plan.world]
        out += [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_array_sampler_gives_every_rank_the_batches_the_list_gave(world):
    """Per-step batches of train_steps, every rank, across epochs and from a resumed position: the same
    sequences in the same order as the list-based sampler before."""
    n, seed, batch_size, accumulation = 203, 7, 4, 2
    start = DataPosition(epoch=1, consumed=24 * world)
    for done, position in ((0, None), (5, start)):
        for rank in range(world):
            plan = StepPlan.make(n, batch_size, accumulation, world, 3, -1, done, position)
            data = SimpleNamespace(
                plan=plan,
                train_sampler=make_sampler(IndexDataset(n), 0, True, seed, rank, world),
                train_dataset=IndexDataset(n),
                pin_memory=False,
            )
            got = [b["input_ids"][:, 0].tolist() for _, micro in train_steps(data, batch_size) for b in micro]
            assert got == list_order_batches(n, seed, plan, rank, batch_size)
            assert len(got) == (plan.total_steps - done) * accumulation


def test_the_permutation_is_torchs_int64_randperm_at_4_bytes_a_block():
    sampler = make_sampler(IndexDataset(100_003), -1, True, seed=3)
    sampler.set_epoch(2)
    order = sampler.permutation()
    assert order.dtype == np.int32 and order.nbytes == 4 * 100_003
    oracle = torch.randperm(100_003, generator=torch.Generator().manual_seed(5))
    assert np.array_equal(order, oracle.numpy())


def test_bench_data_sampler_case_prints_bytes_per_block():
    """scripts/bench_data.py --cases sampler: the array form near 4 bytes a block, the list form ~10x."""
    cmd = [sys.executable, "scripts/bench_data.py", "--cases", "sampler"]
    cmd += ["--sampler_blocks", "4e6", "--sampler_list_blocks", "1e6"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        line.split()[0]: line.split()
        for line in proc.stdout.splitlines()
        if line.split()[:1] in (["list"], ["array"])
    }
    assert float(rows["array"][4]) < 12, proc.stdout
    assert float(rows["list"][4]) > 30, proc.stdout


# --- hangs: the watchdog (item 2), shared runs -----------------------------------------------------

STEPS, WATCHDOG_S, MARGIN_S = 10, 10, 30
TIMEOUT_MIN = 7  # --dist_timeout_minutes: neither torch's default (30) nor DeepSpeed's (10)
KINDS = {"ddp": "", "deepspeed": "--deepspeed_config ds_configs/zero2.json"}
# DDP: run A: rank 1 stalls after step 5 (checkpoint at 3); run B resumes, rank 0 stalls after step 8
# (checkpoint at 6); run C resumes and finishes: killed and resumed twice, 4 steps recomputed.
# ZeRO-2: run B's stall and run C only (killed and resumed once, 2 steps recomputed): a stall of either
# rank is the same code path under both launchers, and one launch less keeps the suite's budget.
STALLS = {"ddp": [("5:1", 1), ("8:0", 0), (None, None)], "deepspeed": [("8:0", 0), (None, None)]}
SLOW_ENV, SLOW_S = "LLAMA_TRAIN_TEST_SLOW", 0.5  # run C: rank 1 waits this long for each step's data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def hung(tmp_path_factory, corpus, deepspeed_ops):
    """kind -> (output_dir, [(CompletedProcess, seconds from its last logged step to its exit)])."""
    root, out = tmp_path_factory.mktemp("hang"), {}
    for kind, extra in KINDS.items():
        run, procs = root / kind, []
        for stall, _ in STALLS[kind]:
            flags = [
                *f"--data_path {corpus} --data_split 90,10 --accumulation_steps 2 --max_steps {STEPS}".split(),
                *f"--save_interval 3 --resume auto --watchdog_s {WATCHDOG_S} --report_to csv".split(),
                *f"--dist_timeout_minutes {TIMEOUT_MIN} --probe_interval 1".split(),  # the straggler alarm's
                *([] if kind == "ddp" else extra.split()),
            ]
            hook = {STALL_ENV: stall} if stall else {SLOW_ENV: f"1:{SLOW_S}"}  # run C: rank 1 straggles
            proc = launch(kind, flags, run, root / "data", check=stall is None, extra_env=hook)
            last = [r for r in read_metrics(run) if r["event"] == "train"][-1]["time"]
            procs.append((proc, time.time() - last))
            took = f"exit {procs[-1][1]:.1f} s after the last logged step, status {proc.returncode}\n"
            (run / f"launch_{len(procs)}.log").write_text(took + proc.stdout + proc.stderr)
            if stall:
                os.replace(run / "hang", run / f"hang_{len(procs)}")  # keep each incident's reports
        out[kind] = (run, procs)
    return out


def processes_steps(kind: str) -> list[list[int]]:
    """The steps each process of `kind`'s runs logs: up to its stall, from the checkpoint before it."""
    out, start = [], 1
    for stall, _ in STALLS[kind]:
        end = int(stall.split(":")[0]) if stall else STEPS
        out.append(list(range(start, end + 1)))
        start = end // 3 * 3 + 1  # --save_interval 3
    return out


def recomputed(kind: str) -> list[list[int]]:
    """The steps trained a second time after each hang exit."""
    steps = processes_steps(kind)
    return [sorted(set(a) & set(b)) for a, b in zip(steps, steps[1:])]


@pytest.mark.parametrize("kind", KINDS)
def test_a_stalled_rank_is_named_its_stacks_dumped_and_the_job_exits_75_in_time(hung, kind):
    run, procs = hung[kind]
    for i, (stall, who) in enumerate(STALLS[kind][:-1]):
        proc, took = procs[i]
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, output[-3000:]
        assert took < WATCHDOG_S + MARGIN_S, f"exited {took:.0f} s after its last step"
        hang = run / f"hang_{i + 1}"
        summary = (hang / "summary.txt").read_text()
        step = int(stall.split(":")[0])
        assert f"stalled: rank {who} (" in summary and f"after step {step}" in summary, summary
        assert f"last checkpoint (step_{step // 3 * 3:08d})" in summary
        assert summary.strip() in output  # rank 0 says it in the job's log too
        for rank in (0, 1):
            stacks = (hang / f"rank_{rank:05d}.txt").read_text()
            assert "most recent call first" in stacks
            report = json.loads((hang / f"rank_{rank:05d}.json").read_text())
            assert report["completed"] == step and report["collectives"] > 0
            assert report["last"]["op"].startswith("torch.distributed.")
        assert "injected_stall" in (hang / f"rank_{who:05d}.txt").read_text()
        if kind == "deepspeed":  # the deepspeed launcher passes a rank's exit status on
            assert proc.returncode == EXIT_HANG


@pytest.mark.parametrize("kind", KINDS)
def test_the_process_group_uses_dist_timeout_minutes(hung, kind):
    """The run's default process group's timeout, read back from its backend (the `config` record: the
    first process's; the resumed ones write none)."""
    run, _ = hung[kind]
    (config,) = [r for r in read_metrics(run) if r["event"] == "config"]
    assert config["collective_timeout_s"] == TIMEOUT_MIN * 60


@pytest.mark.parametrize("kind", KINDS)
def test_resume_auto_after_a_hang_continues_from_the_last_checkpoint_exactly(hung, kind):
    run, procs = hung[kind]
    records = [r for r in read_metrics(run) if r["event"] == "train"]
    steps, sizes = [r["step"] for r in records], [len(p) for p in processes_steps(kind)]
    assert steps == sum(processes_steps(kind), [])
    by_run = [records[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]
    for earlier, later in zip(by_run, by_run[1:]):  # recomputed steps: the same numbers
        again = {r["step"]: r["loss"] for r in later}
        assert [r["loss"] for r in earlier if r["step"] in again] == [
            again[r["step"]] for r in earlier if r["step"] in again
        ]
    assert "resum" in procs[1][0].stdout + procs[1][0].stderr
    with open(run / "metrics.csv", newline="") as f:  # csv: one row a step, across the restarts
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))


def test_under_the_front_a_hung_torchrun_job_exits_75(tmp_path, corpus):
    """python -m llama_train.launch torchrun ...: the ranks exit 75, torchrun 1, the front 75 (before: 1)."""
    run, flags = tmp_path / "run", f"--data_path {corpus} --data_split 90,10 --max_steps {STEPS}".split()
    cmd = [sys.executable, "-m", "llama_train.launch", "torchrun", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), "train_ddp.py", *BASE_FLAGS, *flags]
    cmd += [
        "--watchdog_s",
        str(WATCHDOG_S),
        "--data_output_path",
        str(tmp_path / "data"),
        "--output_dir",
        str(run),
    ]
    e = env() | {STALL_ENV: "2:1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_HANG, proc.stderr[-3000:]
    assert "exiting 75 instead of 1" in proc.stderr and (run / "hang" / "summary.txt").exists()


def test_stalled_ranks_are_the_ones_behind():
    def rep(started, n):
        return {"started": started, "collectives": n, "last": {"op": "torch.distributed.all_reduce"}}

    assert stalled_ranks({0: rep(6, 40), 1: rep(5, 40)}, 2)[0] == [1]
    assert stalled_ranks({0: rep(6, 41), 1: rep(6, 40), 2: rep(6, 41)}, 3)[0] == [1]
    behind, waiting, why = stalled_ranks({0: rep(6, 40), 1: rep(6, 40)}, 2)
    assert behind == [] and waiting == [0, 1] and "same collective" in why
    assert stalled_ranks({0: rep(6, 40)}, 1)[0] == [0]  # one process: it is the one stalled


LEAVES_BY_A_BROKEN_COLLECTIVE = """
import os, sys, time
from llama_train.ops.watchdog import Watchdog
dog = Watchdog(10, sys.argv[1], rank=1, world=2)  # not entered: no process group, no thread
dog.beat(8)  # rank 1's last step; then it waits in step 9's collective for the stalled rank 0
os.makedirs(dog.dir, exist_ok=True)
with open(os.path.join(dog.dir, "summary.txt"), "w") as f:
    f.write("stalled: rank 0 ...")  # rank 0's verdict, written just before it exited 75
try:
    raise RuntimeError("[gloo] Connection closed by peer")  # the collective rank 0's exit broke
except RuntimeError as e:
    dog.__exit__(type(e), e, None)
    raise
"""


def test_a_rank_whose_collective_breaks_after_the_hang_verdict_exits_75_too(tmp_path):
    """The waiting rank's collective fails the moment the stalled rank 0 exits 75; if that error left
    first (exit 1), the deepspeed launcher passed 1 on and a scheduler would not requeue the job."""
    proc = subprocess.run(
        [sys.executable, "-c", LEAVES_BY_A_BROKEN_COLLECTIVE, str(tmp_path)],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == EXIT_HANG, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_rank_without_a_report_is_named_first_as_the_stalled_one(tmp_path, monkeypatch):
    """Rank 1 stopped (SIGSTOP: its watchdog thread stopped with it) writes no report; rank 0, waiting
    for it in a collective, reports. The verdict names rank 1 first, with its host (gathered when the
    watchdog started), and rank 0 as waiting for it."""
    import socket

    import llama_train.ops.watchdog as wd

    monkeypatch.setattr(wd, "REPORT_WAIT_S", 0.5)
    dog = wd.Watchdog(10.0, str(tmp_path), rank=0, world=2)
    dog.hosts = [socket.gethostname(), "node-b"]
    dog.progress.started, dog.progress.completed = 12, 11
    dog.progress.entered("torch.distributed.all_reduce")
    summary = dog._summarize(dog._report())
    assert "stalled: rank 1 (node-b, no report: stopped" in summary, summary
    assert f"waiting: rank 0 ({socket.gethostname()}, step 12, in torch.distributed.all_reduce)" in summary
    assert summary.index("rank 1") < summary.index("rank 0"), summary
    behind, waiting, _ = stalled_ranks(
        {0: json.loads((tmp_path / "hang" / "rank_00000.json").read_text())}, 2
    )
    assert (behind, waiting) == ([1], [0])


@pytest.mark.parametrize("kind", KINDS)
def test_a_straggling_rank_is_named_once_with_its_host(hung, kind):
    """Run C: rank 1 takes SLOW_S longer for each step's data; with the default --straggler_factor 1.5
    and --straggler_patience 3 it is named at its third slow log step (step 9, or 10), once."""
    run, procs = hung[kind]
    output = procs[-1][0].stdout + procs[-1][0].stderr
    lines = [line for line in output.splitlines() if "straggler: rank" in line]
    assert len(lines) == 1 and "straggler: rank 1 (" in lines[0] and lines[0].lstrip().startswith("step"), (
        lines
    )
    (alarm,) = [r for r in read_metrics(run) if r["event"] == "straggler" and r["step"] > 6]
    assert alarm["rank"] == 1 and alarm["host"] == os.uname().nodename and alarm["step"] in (9, 10)
    assert alarm["ratio"] >= 1.5 and alarm["work_s"] >= SLOW_S


@pytest.mark.parametrize("kind", KINDS)
def test_goodput_across_two_restarts_counts_the_recomputed_steps_as_lost_work(hung, kind):
    """Killed (by the watchdog) and resumed twice (DDP: steps 4-5 and 7-8 were trained twice, 4 lost
    steps) or once (ZeRO-2: 7-8); the parts add up to the wall-clock; scripts/summarize_run.py --goodput
    says so and plots it."""
    run, _ = hung[kind]
    g, restarts, lost = goodput(read_metrics(run)), len(STALLS[kind]) - 1, sum(map(len, recomputed(kind)))
    assert g["restarts"] == restarts and g["lost_steps"] == lost
    parts = g["badput_s"]
    assert parts["hang"] >= restarts * WATCHDOG_S and parts["checkpoint_save"] > 0 and parts["evaluation"] > 0
    assert parts["data_build"] > 0 and parts["checkpoint_load"] > 0 and parts["startup"] > 0
    assert parts["between_runs"] > 0 and parts["lost_work"] > 0 and 0 < g["goodput"] < 1
    assert g["productive_s"] + sum(parts.values()) == pytest.approx(g["wall_s"])
    assert parts["other"] >= -1e-6
    cmd = [sys.executable, "scripts/summarize_run.py", str(run), "--goodput"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"lost work       {lost} steps recomputed" in proc.stdout and f"{restarts} restart(s)" in proc.stdout
    )
    assert (run / "loss.png").stat().st_size > 0


def test_dist_timeout_minutes_reaches_deepspeeds_own_groups(tmp_path, corpus, deepspeed_ops):
    """ZeRO-2, 2 ranks, rank 1 stopped after step 2, no watchdog: rank 0 waits in ZeRO's gradient
    reduction, a collective on a group DeepSpeed made itself (its data-parallel group), and fails after
    --dist_timeout_minutes (0.25: 15 s), not after the backend's default (gloo 30 min, NCCL 10). The
    config record reads the timeout of that group."""
    flags = f"--data_path {corpus} --data_split 90,10 --max_steps 6 --dist_timeout_minutes 0.25".split()
    flags += ["--deepspeed_config", "ds_configs/zero2.json"]
    run, hook = tmp_path / "run", {STALL_ENV: "2:1"}
    proc = launch("deepspeed", flags, run, tmp_path / "data", check=False, timeout=240, extra_env=hook)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert [r["step"] for r in read_metrics(run) if r["event"] == "train"] == [1, 2]
    (config,) = [r for r in read_metrics(run) if r["event"] == "config"]
    assert config["collective_timeout_s"] == 15.0
    assert "15000ms" in output or "0:00:15" in output, output[-3000:]


@pytest.mark.parametrize("kind", KINDS)
def test_the_sample_ledger_reads_every_sample_once_across_two_hang_exits(hung, kind):
    """Killed by the watchdog after steps 5 and 8 (checkpoints at 3 and 6) and requeued twice (ZeRO-2:
    after step 8, once): the ledger (scripts/summarize_run.py --ledger) names steps 4-5 and 7-8 (7-8) as
    recomputed and every sample up to step 10 as seen and applied exactly once; exit 0."""
    run, _ = hung[kind]
    again = [f"{r[0]}-{r[-1]}" for r in recomputed(kind)]
    which = f"{again[0]} " if len(again) > 1 else ""  # with more than one range, the line says which
    cmd = [sys.executable, "scripts/summarize_run.py", str(run), "--ledger"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert (
        f"in {len(STALLS[kind])} process(es)" in proc.stdout
        and f"recomputed    steps {', '.join(again)}: {which}trained by process 1" in proc.stdout
    ), proc.stdout
    assert f"every sample up to step {STEPS} seen and applied exactly once" in proc.stdout


def test_the_straggler_alarm_names_a_consistently_slow_rank_once():
    class Writer:
        def __init__(self):
            self.records = []

        def write(self, event, **fields):
            self.records.append((event, fields))

    alarm, writer, hosts = StragglerAlarm(1.5, 3), Writer(), ["a", "b", "c"]
    notes = [
        alarm.check(s, w, hosts, writer) for s, w in enumerate([[1, 1, 3], [1, 1, 1], [1, 1, 3], [1, 1, 3]])
    ]
    assert notes[:3] == [None] * 3 and "straggler: rank 2 (c) 3.0x" in notes[3]
    assert [alarm.check(9, [1, 1, 3], hosts, writer)] == [None]  # said once
    assert writer.records == [("straggler", writer.records[0][1])] and writer.records[0][1]["step"] == 3


def test_the_front_finds_the_output_dir_and_refuses_one_it_cannot_write(tmp_path):
    assert output_dir_of(["deepspeed", "t.py", "--output_dir", "a", "--output_dir=b"]) == "b"
    assert output_dir_of(["torchrun", "t.py"]) == "outputs/run"  # the trainers' default
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    cmd = [
        sys.executable,
        "-m",
        "llama_train.launch",
        "torchrun",
        "train_ddp.py",
        "--output_dir",
        f"{blocked}/run",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"error: --output_dir {blocked}/run: cannot write the stop file there" in proc.stderr


def test_the_front_does_not_wait_for_children_it_inherited(tmp_path):
    """A shell that execs the front leaves it its own children (multinode_sim.sh: the `sed` that
    prefixes the output, which ends only after the front does): the front returns when the launcher
    and the ranks are done, not when those are (before: it waited for them, here 30 s, there forever)."""
    front = f"exec {sys.executable} -m llama_train.launch true --output_dir {tmp_path}/run"
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", "-c", f"sleep 30 >/dev/null 2>&1 & echo $!; {front}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    took = time.monotonic() - start
    os.kill(int(proc.stdout.split()[0]), signal.SIGKILL)
    assert proc.returncode == 0 and took < 20, (took, proc.stderr)


AFTER_THE_OTHER_HOST = """
import os, sys, time
from llama_train import launch
real_remove, real_unlink = os.remove, os.unlink


def after_the_other_host(real):  # this host's front removes a shared file only once the other's has
    def remove(path, *args, **kwargs):
        open(os.environ["WAITING"], "a").close()
        deadline = time.monotonic() + 30
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        return real(path, *args, **kwargs)
    return remove


os.remove, os.unlink = after_the_other_host(real_remove), after_the_other_host(real_unlink)
sys.exit(launch.main(sys.argv[1:]))
"""


def test_two_fronts_on_one_shared_output_dir_both_exit_0_after_one_signal(tmp_path):
    """A front per host on a shared --output_dir (torchrun --nnodes 2, `python -m llama_train.launch`
    before each host's torchrun): each removes the stop file at start (a killed run's) and once its
    launcher exited, and the other host's front may have removed it first. Each front here runs its own
    launcher (one that waits for the stop file, as the ranks do); front 0 removes only after front 1 has,
    at start and at the end; one SIGTERM to front 0: both fronts exit 0, without a traceback."""
    out, waiting = tmp_path / "run", tmp_path / "front0-waiting"
    out.mkdir()
    (out / STOP_NAME).write_text("SIGTERM")  # left by a run killed before its front cleaned up

    def front(k: int, code: str | None) -> subprocess.Popen:
        wait = f"while [ ! -e {out / STOP_NAME} ]; do sleep 0.02; done; sleep {k}"  # host 1's ends 1 s later
        cmd = ["-c", code] if code else ["-m", "llama_train.launch"]
        return subprocess.Popen(
            [sys.executable, *cmd, "bash", "-c", wait, "launcher", "--output_dir", str(out)],
            cwd=ROOT, env={**env(), "WAITING": str(waiting)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def until(ready):
        deadline = time.monotonic() + 60
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)

    fronts = [front(0, AFTER_THE_OTHER_HOST)]
    until(lambda: waiting.exists() or fronts[0].poll() is not None)  # front 0 found the old stop file
    fronts.append(front(1, None))  # removes it
    until(lambda: fronts[0].poll() is not None or psutil.Process(fronts[0].pid).children())
    if fronts[0].poll() is None:  # front 0's launcher runs: one signal to front 0
        fronts[0].send_signal(signal.SIGTERM)
    else:  # front 0 failed: let front 1's launcher end
        (out / STOP_NAME).write_text("test")
    for f, (_, stderr) in zip(fronts, [f.communicate(timeout=60) for f in fronts]):
        assert f.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert not (out / STOP_NAME).exists()


def test_the_front_quiets_the_deepspeed_launcher_unless_asked():
    """In front of `deepspeed`: --log_level=error and, with no accelerator here, DS_ACCELERATOR=cpu
    (no "cmd = ...", "process N spawned" or CPU-fallback lines); a user's own choice wins; torchrun
    is left alone. The launch itself is checked in tests/test_resume.py's preemption run."""
    ds = ["/venv/bin/deepspeed", "--num_gpus", "2", "train_deepspeed.py", "--preset", "debug"]
    argv, got = quiet_deepspeed(ds, {})
    no_gpu = shutil.which("nvidia-smi") is None
    assert argv == [ds[0], "--log_level=error", *ds[1:]] and got == (
        {"DS_ACCELERATOR": "cpu"} if no_gpu else {}
    )
    for asked in (["--log_level", "info"], ["--log_level=debug"], ["--quiet"], ["--verbose"]):
        assert quiet_deepspeed(ds + asked, {})[0] == ds + asked
    assert quiet_deepspeed(ds, {"DS_ACCELERATOR": "cuda"})[1] == {"DS_ACCELERATOR": "cuda"}
    torchrun = ["torchrun", "--nproc_per_node", "2", "train_ddp.py"]
    assert quiet_deepspeed(torchrun, {}) == (torchrun, {})
    module = [*launcher("deepspeed"), "--num_gpus", "2", "train_deepspeed.py"]  # scripts/run_deepspeed.sh's
    assert quiet_deepspeed(module, {})[0] == [*module[:3], "--log_level=error", *module[3:]]
    pinned = ["env", "CUDA_DEVICE_ORDER=PCI_BUS_ID", *module]  # python -m llama_train.gpu deepspeed's words
    assert quiet_deepspeed(pinned, {})[0] == [*pinned[:5], "--log_level=error", *pinned[5:]]
    assert resolve(["torchrun", "t.py"]) == [*launcher("torchrun"), "t.py"] and resolve(["true"]) == ["true"]


def test_the_backstop_timer_is_armed_once_not_at_every_step(tmp_path, monkeypatch):
    """faulthandler.dump_traceback_later starts a C thread per call: arming it at every step cost a
    thread a step. It is armed at the first step, to fire limit + GRACE_S after the last beat."""
    import faulthandler

    from llama_train.ops.watchdog import GRACE_S, Watchdog

    armed = []
    monkeypatch.setattr(
        faulthandler, "dump_traceback_later", lambda timeout, exit: armed.append((timeout, exit))
    )
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", lambda: None)
    with Watchdog(30.0, str(tmp_path), rank=0, world=1) as dog:
        steps = [step for step, _ in dog.steps((s, None) for s in range(1, 1001))]
    assert steps == list(range(1, 1001)) and dog.progress.completed == 999
    ((timeout, exits),) = armed
    assert 30 + GRACE_S - 1 < timeout <= 30 + GRACE_S and exits is False  # it dumps; ExitTimer exits 75


def test_the_backstop_exits_with_the_hang_status_while_the_gil_is_held():
    """A hang in C code that holds the GIL (a CUDA call, here libc's sleep through ctypes.PyDLL, which
    keeps it): no Python thread runs, and ExitTimer still ends the process, with 75 (a requeue), not
    faulthandler's 1 (a failure)."""
    code = (
        "import ctypes; from llama_train.ops.watchdog import ExitTimer; t = ExitTimer(75); "
        "assert t.available; t.arm(0.5); ctypes.PyDLL(None).sleep(30)"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, timeout=120)
    assert proc.returncode == 75 and time.monotonic() - start < 25, proc.stderr[-2000:]


WATCHDOG_SAVE = """
import os, sys, time, torch
from llama_train.checkpoint import store as ckpt
from llama_train.checkpoint.async_save import Saver
from llama_train.ops.watchdog import Watchdog
out = sys.argv[1]
saver = Saver(async_save=True, hashes=True, keep_last=3, rank=0, world=1, timeout_s=60)
with Watchdog(1.0, out, 0, 1) as dog, saver:
    for step, _ in dog.steps((s, None) for s in range(1, 4)):
        files = lambda tmp, s=step: {os.path.join(tmp, "w.pt"): {"w": torch.full((4,), float(s))}}
        saver.save(ckpt.checkpoint_root(out), ckpt.tag_for(step), files, {"step": step})
    time.sleep(60)  # hung after step 3, whose checkpoint is still being written
"""


def test_a_watchdog_exit_finishes_the_async_save_in_flight(tmp_path):
    """The watchdog ends a hung process (1 s without a step) while step 3's checkpoint is still written
    in the background (3 s): the save is finished first, so `latest` names step 3, intact."""
    from llama_train.checkpoint.resuming import find_resume
    from llama_train.checkpoint.store import verify_checkpoint

    hooks = {"LLAMA_TRAIN_TEST_SAVE_DELAY_AT_STEP": "3", "LLAMA_TRAIN_TEST_SAVE_DELAY_S": "3"}
    cmd = [sys.executable, "-c", WATCHDOG_SAVE, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env() | hooks, capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_HANG, proc.stderr[-3000:]
    assert "watchdog: no step completed for 1 s after step 2" in proc.stderr
    latest = find_resume("auto", str(tmp_path))
    assert latest == str(tmp_path / "checkpoints" / "step_00000003"), proc.stderr[-3000:]
    assert verify_checkpoint(latest)["step"] == 3


def test_the_host_copy_is_frozen_and_saves_the_same_bytes(tmp_path):
    """async_save.host_copy: later in-place updates do not reach the copy; shared storages stay shared,
    and views made under autograd (which copy.deepcopy refuses) are copied, so torch.save writes the
    bytes it writes from the original."""
    from llama_train.checkpoint.async_save import host_copy

    flat = torch.arange(6.0, requires_grad=True)
    view = flat[2:] * 1  # a non-leaf tensor, as in ZeRO's state
    state = {"flat": flat, "part": flat.detach()[:3], "view": view, "n": 3, "groups": [{"lr": 0.1}]}
    copied = host_copy(state)
    for name, obj in (("a", state), ("b", copied)):
        (tmp_path / name).mkdir()
        torch.save(obj, tmp_path / name / "state.pt")  # the archive records the file's name
    assert (tmp_path / "a" / "state.pt").read_bytes() == (tmp_path / "b" / "state.pt").read_bytes()
    with torch.no_grad():
        flat.add_(1.0)
    assert copied["flat"][0].item() == 0.0 and copied["part"][0].item() == 0.0
    assert copied["part"].untyped_storage().data_ptr() == copied["flat"].untyped_storage().data_ptr()


def test_a_killed_run_continues_from_a_recent_checkpoint_and_a_fresh_start_is_refused(tmp_path, shared_data):
    """The README's long-run flags (--resume auto, the default --save_interval auto), the wall-clock
    bound scaled down to 0.12 s (1-15 steps here, so the first save comes by step 18): kill -9 at two
    thirds of the run, the same command again continues from a checkpoint at most the stated interval
    old, and the records read as one run's. A start without --resume in that --output_dir is refused
    by both trainers with one line; --start_over moves the run aside."""
    out, steps, kill_at = tmp_path / "run", 60, 40
    same = ["train_ddp.py", *BASE_FLAGS, "--max_steps", str(steps), "--save_max_minutes", "0.002"]
    same += ["--no_export", "--data_output_path", str(shared_data)]
    same += ["--output_dir", str(out), "--resume", "auto"]
    proc = subprocess.Popen([sys.executable, *same], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step     {kill_at}/{steps}"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    assert proc.wait(timeout=60) == -signal.SIGKILL, "".join(lines)[-3000:]
    plans = [r for r in read_metrics(out) if r["event"] == "save_plan"]
    saved = [r["step"] for r in read_metrics(out) if r["event"] == "save"]
    assert plans and plans[0]["step"] == 3 and saved and saved[-1] < kill_at, "".join(lines)[-3000:]
    assert kill_at - saved[-1] <= plans[-1]["interval"]  # the plan in effect when it was killed
    assert "--save_interval auto: a checkpoint every" in "".join(lines)

    again = subprocess.run(
        [sys.executable, *same], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    records = read_metrics(out)
    since = max(i for i, r in enumerate(records) if r["event"] == "resume")
    assert records[since]["step"] == saved[-1]
    assert [r["step"] for r in records[since:] if r["event"] == "train"] == list(
        range(saved[-1] + 1, steps + 1)
    )
    summary = subprocess.run([sys.executable, "scripts/summarize_run.py", str(out), "--ledger"], cwd=ROOT,
                             env=env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert summary.returncode == 0 and "checkpoints     auto: every" in summary.stdout, (
        summary.stdout + summary.stderr
    )

    fresh = [a for a in same if a not in ("--resume", "auto")]
    zero2 = ["train_deepspeed.py", "--deepspeed_config", "ds_configs/zero2.json", *fresh[1:]]
    for cmd in (fresh, zero2):
        refused = subprocess.run(
            [sys.executable, *cmd], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
        )
        (line,) = [x for x in refused.stderr.splitlines() if x.startswith("error:")]
        assert refused.returncode == 2 and f"--output_dir {out} holds an earlier run" in line, refused.stderr[
            -2000:
        ]
        assert "--resume auto" in line and "--start_over" in line
    over = (
        fresh[: fresh.index("--max_steps") + 1]
        + ["2"]
        + fresh[fresh.index("--max_steps") + 2 :]
        + ["--start_over"]
    )
    subprocess.run(
        [sys.executable, *over], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300, check=True
    )
    (aside,) = tmp_path.glob("run.old-*")
    assert [r["step"] for r in read_metrics(out) if r["event"] == "train"] == [1, 2]
    assert len([r for r in read_metrics(aside) if r["event"] == "train"]) >= steps
