"""Long runs: files that survive a crash, a sampler that does not grow with the corpus in the wrong
place, hangs turned into a restart, stops across hosts, stragglers, goodput (issue 25)."""

import csv
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llama_train.steps import DataPosition, StepPlan, train_steps
from tests.trainer_utils import ROOT, env
from utils.data import make_sampler

CSV_ROWS = 6


def write_csv_rows(path, steps: int):
    from llama_train.reporting import SCALAR_NAMES

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
        "import os, signal; from llama_train.reporting import CSVWriter; "
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
